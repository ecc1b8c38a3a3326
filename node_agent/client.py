"""A small blocking client for the agent's Unix-socket API (wrap in asyncio.to_thread on a loop)."""

from __future__ import annotations

import http.client
import json
import os
import shlex
import socket
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

SYSTEM_SOCKET = "/run/gpufrac/agent.sock"


def default_socket_path() -> str:
    """$GPUFRAC_AGENT_SOCKET, the system agent's socket when there is one, else a per-user one."""
    env = os.environ.get("GPUFRAC_AGENT_SOCKET")
    if env:
        return env
    if os.path.exists(SYSTEM_SOCKET):
        return SYSTEM_SOCKET
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isdir(runtime):
        return str(Path(runtime) / "gpufrac" / "agent.sock")
    return f"/tmp/gpufrac-{os.getuid()}/agent.sock"


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
                conn.request(method, path, body=payload, headers=headers)
                response = conn.getresponse()
                raw = response.read()
            except (FileNotFoundError, ConnectionRefusedError) as exc:
                raise self._unavailable(exc.strerror or str(exc)) from exc
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
                     name: str | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {"kind": kind, "client": client, "devices": devices}
        for key, value in (("request", request), ("limit", limit), ("kernel_id", kernel_id),
                           ("name", name)):
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
