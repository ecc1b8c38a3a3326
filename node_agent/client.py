"""A small blocking client for the agent's Unix-socket API (wrap in asyncio.to_thread on a loop)."""

from __future__ import annotations

import http.client
import json
import os
import shlex
import socket
import stat
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

SYSTEM_SOCKET = "/run/gpufrac/agent.sock"
# How long a client waits out an agent whose listen queue is full before it gives up.
CONNECT_PATIENCE = 5.0


def default_socket_path() -> str:
    """$GPUFRAC_AGENT_SOCKET, the system agent's socket when there is one, else a per-user one."""
    env = os.environ.get("GPUFRAC_AGENT_SOCKET")
    if env:
        return env
    if os.path.exists(SYSTEM_SOCKET) and os.stat(os.path.dirname(SYSTEM_SOCKET)).st_uid == 0:
        return SYSTEM_SOCKET
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isdir(runtime):
        return str(Path(runtime) / "gpufrac" / "agent.sock")
    return f"/tmp/gpufrac-{os.getuid()}/agent.sock"


def personal_socket_folders() -> set[str]:
    """The per-user socket folders this user's defaults name."""
    folders = {f"/tmp/gpufrac-{os.geteuid()}"}
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime:
        folders.add(os.path.join(runtime, "gpufrac"))
    return folders


def socket_folder_problem(socket_path: str) -> str | None:
    """Why the folder holding ``socket_path`` cannot be trusted, or None.

    Whoever can write the folder can put their own agent there and hear this user's
    requests; a personal folder must be this user's own with mode 0700, any other the
    user's or root's and writable by its owner only.
    """
    folder = os.path.dirname(os.path.abspath(socket_path))
    try:
        st = os.lstat(folder)
    except FileNotFoundError:
        return None
    uid, mode = os.geteuid(), stat.S_IMODE(st.st_mode)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        return f"{folder} is not a directory (a symbolic link, or a file)"
    if folder in personal_socket_folders():
        if st.st_uid != uid or mode != 0o700:
            return (f"{folder} must be yours with mode 0700, and it belongs to uid {st.st_uid} "
                    f"with mode {mode:04o}; someone else may have made it to listen in: remove "
                    "it (or set XDG_RUNTIME_DIR) and try again")
        return None
    if st.st_uid not in (uid, 0):
        return (f"{folder} belongs to uid {st.st_uid}, neither you (uid {uid}) nor root, so "
                "its owner could answer in the agent's place")
    if mode & (stat.S_IWGRP | stat.S_IWOTH):
        return (f"{folder} is writable by group or others (mode {mode:04o}), so anyone could "
                "answer in the agent's place; use a folder only its owner can write")
    return None


def serve_command(socket_path: str, state_dir: str | None = None) -> str:
    """The exact command that starts an agent on this socket (and state directory, when known)."""
    words = ["gpufrac-agent", "serve", "--socket", socket_path]
    if state_dir:
        words += ["--state-dir", state_dir]
    return shlex.join(words)


class AgentError(Exception):
    """The agent refused a request: ``status``, the ``field`` at fault, and its ``message``."""

    def __init__(self, status: int, field: str | None, message: str) -> None:
        super().__init__(f"{field}: {message}" if field else message)
        self.status = status
        self.field = field
        self.message = message


class AgentUnavailable(AgentError):
    """Nothing answers at the socket ``path``; the message says how to start an agent there."""

    def __init__(self, path: str, reason: str, state_dir: str | None = None) -> None:
        super().__init__(
            0, None,
            f"no gpufrac agent answers at {path} ({reason}); start one with "
            f"`{serve_command(path, state_dir)}` (add `--simulate 2x16GiB` on a machine "
            "without a GPU)",
        )
        self.path = path
        self.reason = reason
        self.state_dir = state_dir


class UnsafeSocket(AgentError):
    """The socket's folder is not one this user can trust; the message says why and what to do."""

    def __init__(self, path: str, problem: str) -> None:
        super().__init__(0, "socket", f"refusing the agent socket {path}: {problem}")


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self._path)
        except OSError:
            sock.close()
            raise
        self.sock = sock


class AgentClient:
    """One method per endpoint of docs/agent-api.md. Each call opens its own connection."""

    def __init__(self, socket_path: str | None = None, timeout: float = 10.0,
                 state_dir: str | None = None) -> None:
        self.socket_path = socket_path or default_socket_path()
        self.timeout = timeout
        # Only for the hint in AgentUnavailable: the agent's state directory, when known.
        self.state_dir = state_dir

    def request(self, method: str, path: str, body: dict[str, Any] | None = None,
                timeout: float | None = None) -> Any:
        conn = _UnixConnection(self.socket_path, timeout or self.timeout)
        try:
            payload = None if body is None else json.dumps(body)
            headers = {"Content-Type": "application/json"} if payload is not None else {}
            try:
                self._connect(conn)
                conn.request(method, path, body=payload, headers=headers)
                response = conn.getresponse()
                raw = response.read()
            except (FileNotFoundError, ConnectionRefusedError) as exc:
                raise self._unavailable(exc.strerror or str(exc)) from exc
            except BlockingIOError as exc:
                raise self._unavailable("it is too busy: its listen queue stayed full") from exc
            except TimeoutError as exc:
                raise self._unavailable("timed out") from exc
            except OSError as exc:
                raise self._unavailable(str(exc)) from exc
        finally:
            conn.close()
        if response.status >= 400:
            try:
                error = json.loads(raw)["error"]
                raise AgentError(response.status, error.get("field"), error.get("message", ""))
            except (ValueError, KeyError, TypeError):
                raise AgentError(response.status, None, raw.decode(errors="replace")) from None
        if response.status == 204 or not raw:
            return None
        if response.getheader("Content-Type", "").startswith("application/json"):
            return json.loads(raw)
        return raw.decode()

    def _connect(self, conn: _UnixConnection) -> None:
        """Connect, waiting out a full listen queue (a busy agent, not an absent one)."""
        problem = socket_folder_problem(self.socket_path)
        if problem:
            raise UnsafeSocket(self.socket_path, problem)
        delay = 0.01
        deadline = time.monotonic() + min(self.timeout, CONNECT_PATIENCE)
        while True:
            try:
                conn.connect()
                return
            except BlockingIOError:
                # EAGAIN from connect() on a Unix socket: the backlog is full right now.
                if time.monotonic() + delay > deadline:
                    raise
                time.sleep(delay)
                delay = min(delay * 2, 0.5)

    def _unavailable(self, reason: str) -> AgentUnavailable:
        return AgentUnavailable(self.socket_path, reason, self.state_dir)

    def ping(self) -> bool:
        """True when an agent answers at the socket."""
        try:
            self.node()
        except AgentUnavailable:
            return False
        return True

    def node(self) -> dict[str, Any]:
        return self.request("GET", "/v1/node")

    def leases(self) -> list[dict[str, Any]]:
        return self.request("GET", "/v1/leases")["leases"]

    def create_lease(self, *, client: str, request: str | float | int | None = None,
                     limit: str | float | int | None = None, kind: str = "notebook",
                     devices: int = 1, kernel_id: str | None = None,
                     name: str | None = None, compute_request: str | float | None = None,
                     compute_limit: str | float | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {"kind": kind, "client": client, "devices": devices}
        for key, value in (("request", request), ("limit", limit), ("kernel_id", kernel_id),
                           ("name", name), ("compute_request", compute_request),
                           ("compute_limit", compute_limit)):
            if value is not None:
                body[key] = value
        return self.request("POST", "/v1/leases", body)

    def lease(self, lease_id: str) -> dict[str, Any]:
        return self.request("GET", f"/v1/leases/{lease_id}")

    def resize(self, lease_id: str, *, request: str | float | None = None,
               limit: str | float | None = None) -> dict[str, Any]:
        body = {k: v for k, v in (("request", request), ("limit", limit)) if v is not None}
        return self.request("PATCH", f"/v1/leases/{lease_id}", body)

    def release(self, lease_id: str) -> None:
        self.request("DELETE", f"/v1/leases/{lease_id}")

    def register_pid(self, lease_id: str, pid: int) -> dict[str, Any]:
        return self.request("POST", f"/v1/leases/{lease_id}/pids", {"pid": pid})

    def report_usage(self, lease_id: str, nbytes: int) -> None:
        self.request("POST", f"/v1/leases/{lease_id}/usage", {"bytes": nbytes})

    def migrated(self, lease_id: str) -> dict[str, Any]:
        return self.request("POST", f"/v1/leases/{lease_id}/migrated", {})

    def directives(self, *, client: str | None = None, lease: str | None = None,
                   after: int = 0, timeout: float = 25.0) -> tuple[list[dict[str, Any]], int]:
        """Directives after ``after``, waiting up to ``timeout`` s for one; and the new cursor."""
        query: dict[str, Any] = {"after": after, "timeout": timeout}
        if client is not None:
            query["client"] = client
        if lease is not None:
            query["lease"] = lease
        answer = self.request("GET", "/v1/directives?" + urlencode(query),
                              timeout=timeout + self.timeout)
        return answer["directives"], answer["last"]

    def metrics(self) -> str:
        return self.request("GET", "/metrics")
