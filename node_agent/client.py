"""The agent's Unix-socket API as a blocking AgentClient and an AsyncAgentClient, both on httpx."""

from __future__ import annotations

import os
import stat
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Generic, TypeVar

# httpx, json, shlex and asyncio are imported where first needed, not here: kernels import
# this module as they start, and should not pay for an HTTP stack before they use it.
if TYPE_CHECKING:
    from collections.abc import Callable
    from types import TracebackType

    import httpx

T = TypeVar("T")

SYSTEM_SOCKET = "/run/gpufrac/agent.sock"
# How long a client waits out an agent whose listen queue is full before it gives up.
CONNECT_PATIENCE = 5.0
CONNECT_SLICE = 0.02
# An idle connection is dropped before the agent's own 10 s idle timeout can close it under us.
KEEPALIVE_S = 5.0
# Only the Host header sees it: the transport connects to the socket.
BASE_URL = "http://agent"


def default_socket_path() -> str:
    """$GPUFRAC_AGENT_SOCKET, the system agent's socket when there is one, else a per-user one."""
    env = os.environ.get("GPUFRAC_AGENT_SOCKET")
    if env:
        return env
    if os.path.exists(SYSTEM_SOCKET) and os.stat(os.path.dirname(SYSTEM_SOCKET)).st_uid == 0:
        return SYSTEM_SOCKET
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isdir(runtime):
        return os.path.join(runtime, "gpufrac", "agent.sock")
    return f"/tmp/gpufrac-{os.getuid()}/agent.sock"


def own_socket_path(taken: str) -> str:
    """Where this user's agent may listen when the per-user folder of ``taken`` (under /tmp)
    is another user's: ``/run/user/<uid>/gpufrac`` when that runtime folder is the user's
    alone (systemd makes it, even where XDG_RUNTIME_DIR is not passed on), else a new folder
    of the user's own under /tmp with a name nobody can guess (made 0700 here)."""
    uid = os.geteuid()
    runtime = f"/run/user/{uid}"
    try:
        st = os.lstat(runtime)
    except OSError:
        st = None
    if st is not None and stat.S_ISDIR(st.st_mode) and st.st_uid == uid and \
            not st.st_mode & 0o077:
        return os.path.join(runtime, "gpufrac", os.path.basename(taken))
    import tempfile

    return os.path.join(tempfile.mkdtemp(prefix=f"gpufrac-{uid}-", dir="/tmp"),
                        os.path.basename(taken))


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
    import shlex

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


# -- what both clients share: the endpoints, the answers, the retry rule; no I/O -------------


def _same(answer: Any) -> Any:
    return answer


def _nothing(answer: Any) -> None:
    return None


class _Call(Generic[T]):
    """One request to the agent and how to read its answer."""

    __slots__ = ("body", "method", "parse", "path", "query", "timeout", "wait")

    def __init__(self, method: str, path: str, parse: Callable[[Any], T],
                 body: dict[str, Any] | None = None, query: dict[str, Any] | None = None,
                 timeout: float | None = None, wait: float = 0.0) -> None:
        self.method, self.path, self.parse = method, path, parse
        self.body, self.query = body, query
        self.timeout = timeout  # None: the client's own
        self.wait = wait  # a long poll: the agent may take this long before it answers


def _raw_call(method: str, path: str, body: dict[str, Any] | None,
              timeout: float | None) -> _Call[Any]:
    return _Call(method, path, _same, body, timeout=timeout)


def _node_call() -> _Call[dict[str, Any]]:
    return _Call("GET", "/v1/node", _same)


def _leases_call() -> _Call[list[dict[str, Any]]]:
    return _Call("GET", "/v1/leases", lambda answer: answer["leases"])


def _create_lease_call(fields: dict[str, Any]) -> _Call[dict[str, Any]]:
    body = {key: value for key, value in fields.items() if value is not None}
    return _Call("POST", "/v1/leases", _same, body)


def _lease_call(lease_id: str) -> _Call[dict[str, Any]]:
    return _Call("GET", f"/v1/leases/{lease_id}", _same)


def _resize_call(lease_id: str, request: str | float | None,
                 limit: str | float | None) -> _Call[dict[str, Any]]:
    body = {k: v for k, v in (("request", request), ("limit", limit)) if v is not None}
    return _Call("PATCH", f"/v1/leases/{lease_id}", _same, body)


def _release_call(lease_id: str) -> _Call[None]:
    return _Call("DELETE", f"/v1/leases/{lease_id}", _nothing)


def _register_pid_call(lease_id: str, pid: int) -> _Call[dict[str, Any]]:
    return _Call("POST", f"/v1/leases/{lease_id}/pids", _same, {"pid": pid})


def _report_usage_call(lease_id: str, nbytes: int) -> _Call[None]:
    return _Call("POST", f"/v1/leases/{lease_id}/usage", _nothing, {"bytes": nbytes})


def _observe_call(lease_id: str, observation: Mapping[str, Any]) -> _Call[None]:
    return _Call("POST", f"/v1/leases/{lease_id}/observations", _nothing, dict(observation))


def _migrated_call(lease_id: str) -> _Call[dict[str, Any]]:
    return _Call("POST", f"/v1/leases/{lease_id}/migrated", _same, {})


def _park_call(lease_id: str, reason: str | None) -> _Call[dict[str, Any]]:
    return _Call("POST", f"/v1/leases/{lease_id}/park", _same,
                 {} if reason is None else {"reason": reason})


# A freeze is answered once the driver has copied the kernel's GPU memory to host memory: about
# a second per GiB on an H100.
FREEZE_TIMEOUT = 600.0


def _freeze_call(lease_id: str, reason: str | None) -> _Call[dict[str, Any]]:
    return _Call("POST", f"/v1/leases/{lease_id}/freeze", _same,
                 {} if reason is None else {"reason": reason}, timeout=FREEZE_TIMEOUT)


def _park_request_call(lease_id: str) -> _Call[dict[str, Any]]:
    return _Call("POST", f"/v1/leases/{lease_id}/park-request", _same, {})


def _unpark_call(lease_id: str) -> _Call[dict[str, Any]]:
    return _Call("POST", f"/v1/leases/{lease_id}/unpark", _same, {})


def _directives_call(client: str | None, lease: str | None, after: int, timeout: float,
                     kinds: Sequence[str] | None) -> _Call[tuple[list[dict[str, Any]], int]]:
    query: dict[str, Any] = {"after": after, "timeout": timeout}
    if kinds is not None:
        query["kinds"] = ",".join(kinds)
    if client is not None:
        query["client"] = client
    if lease is not None:
        query["lease"] = lease
    return _Call("GET", "/v1/directives", lambda a: (list(a["directives"]), int(a["last"])),
                 query=query, wait=timeout)


def _metrics_call() -> _Call[str]:
    return _Call("GET", "/metrics", str)


def _decode(status: int, content_type: str, raw: bytes) -> Any:
    """The agent's answer: parsed JSON, text, or None; an AgentError for a 4xx or 5xx."""
    import json

    if status >= 400:
        try:
            error = json.loads(raw)["error"]
            raise AgentError(status, error.get("field"), error.get("message", ""))
        except (ValueError, KeyError, TypeError, AttributeError):
            raise AgentError(status, None, raw.decode(errors="replace")) from None
    if status == 204 or not raw:
        return None
    if content_type.startswith("application/json"):
        try:
            return json.loads(raw)
        except ValueError:
            raise AgentError(status, None, "the agent's answer is not JSON: "
                             + raw[:200].decode(errors="replace")) from None
    return raw.decode(errors="replace")


def _os_error(exc: BaseException) -> OSError | None:
    """The OSError under httpx's wrapping of a failed connect, read or write, if any."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, OSError):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


class _Attempts:
    """The retry rule for one call: a full listen queue is waited out, backing off, for up to
    CONNECT_PATIENCE; every other failure is final. A full queue shows as EAGAIN from connect()
    (the blocking client) or as a connect that times out (the async one: see connect_timeout)."""

    def __init__(self, socket_path: str, timeout: float, state_dir: str | None) -> None:
        self.socket_path = socket_path
        self.state_dir = state_dir
        self.deadline = time.monotonic() + min(timeout, CONNECT_PATIENCE)
        self.delay = 0.01

    def connect_timeout(self) -> float:
        """How long the next connect may take. anyio meets EAGAIN by trying again at once until
        this runs out, a busy loop; kept short, our backoff does the waiting instead. A connect
        that is neither refused nor queued is instant on a Unix socket."""
        return max(min(self.deadline - time.monotonic(), CONNECT_SLICE), 0.001)

    def after(self, exc: Exception) -> float:
        """Seconds to wait before the next attempt; raises what ``exc`` means when it is final."""
        import httpx

        if not isinstance(exc, httpx.HTTPError):
            raise exc
        cause = _os_error(exc)
        if isinstance(exc, httpx.ConnectTimeout) or (
                isinstance(exc, httpx.ConnectError) and isinstance(cause, BlockingIOError)):
            delay, self.delay = self.delay, min(self.delay * 2, 0.5)
            if time.monotonic() + delay <= self.deadline:
                return delay
            raise self._unavailable("it is too busy: its listen queue stayed full") from exc
        if not isinstance(exc, httpx.TransportError):  # it answered, but not in HTTP we read
            raise AgentError(0, None, f"unreadable answer from the agent: {exc}") from exc
        if isinstance(exc, httpx.TimeoutException):
            raise self._unavailable("timed out") from exc
        if cause is not None:
            raise self._unavailable(cause.strerror or str(cause)) from exc
        raise self._unavailable(str(exc) or type(exc).__name__) from exc

    def _unavailable(self, reason: str) -> AgentUnavailable:
        return AgentUnavailable(self.socket_path, reason, self.state_dir)


class _Common:
    """Settings, and the translation to and from httpx, that both clients share."""

    def __init__(self, socket_path: str | None = None, timeout: float = 10.0,
                 state_dir: str | None = None) -> None:
        self.socket_path = socket_path or default_socket_path()
        self.timeout = timeout
        # Only for the hint in AgentUnavailable: the agent's state directory, when known.
        self.state_dir = state_dir

    def _attempts(self) -> _Attempts:
        # Checked before every call, not once: the folder may change in between.
        problem = socket_folder_problem(self.socket_path)
        if problem:
            raise UnsafeSocket(self.socket_path, problem)
        return _Attempts(self.socket_path, self.timeout, self.state_dir)

    def _build(self, call: _Call[Any], attempts: _Attempts) -> httpx.Request:
        import json

        import httpx

        read = (call.timeout or self.timeout) + call.wait
        timeout = httpx.Timeout(read, connect=attempts.connect_timeout())
        content, headers = None, {}
        if call.body is not None:
            content, headers = json.dumps(call.body).encode(), {"Content-Type": "application/json"}
        return httpx.Request(call.method, BASE_URL + call.path, params=call.query,
                             content=content, headers=headers,
                             extensions={"timeout": timeout.as_dict()})

    @staticmethod
    def _answer(call: _Call[T], response: httpx.Response) -> T:
        return call.parse(_decode(response.status_code,
                                  response.headers.get("Content-Type", ""), response.content))

    def _transport_options(self, keep: int) -> dict[str, Any]:
        import httpx

        # Plain HTTP on a Unix socket: no TLS, so no certificates to load (verify=False).
        return {"uds": self.socket_path, "verify": False,
                "limits": httpx.Limits(max_keepalive_connections=keep,
                                       keepalive_expiry=KEEPALIVE_S)}


# -- the two clients: they only send ----------------------------------------------------------


class AgentClient(_Common):
    """One method per endpoint of docs/agent-api.md, blocking.

    Keeps one idle connection for the next call; httpx drops it when the agent closed it (a
    restart). The agent knows a caller by who opened the connection, so a forked child or a
    process that changed its uid or groups since gets a connection of its own.
    """

    def __init__(self, socket_path: str | None = None, timeout: float = 10.0,
                 state_dir: str | None = None) -> None:
        super().__init__(socket_path, timeout, state_dir)
        self._owner: tuple[int, int, int, tuple[int, ...]] | None = None
        self._client: httpx.Client | None = None

    def _http(self) -> httpx.Client:
        owner = (os.getpid(), os.geteuid(), os.getegid(), tuple(os.getgroups()))
        client = self._client
        if client is None or self._owner != owner:
            import httpx

            # The old one is dropped, not closed: after a fork it is the parent's, and its
            # pool's lock may have been held by another of the parent's threads. No lock
            # here either: two threads racing build one client too many, and one is dropped.
            transport = httpx.HTTPTransport(**self._transport_options(keep=1))
            client = self._client = httpx.Client(transport=transport, trust_env=False)
            self._owner = owner
        return client

    def _send(self, call: _Call[T]) -> T:
        attempts = self._attempts()
        while True:
            try:
                response = self._http().send(self._build(call, attempts))
            except Exception as exc:
                time.sleep(attempts.after(exc))
                continue
            return self._answer(call, response)

    def close(self) -> None:
        """Close the kept connection; a later call opens another."""
        client, self._client = self._client, None
        if client is not None:
            client.close()

    def __enter__(self) -> AgentClient:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def request(self, method: str, path: str, body: dict[str, Any] | None = None,
                timeout: float | None = None) -> Any:
        """Any request: the parsed answer (JSON, text, or None)."""
        return self._send(_raw_call(method, path, body, timeout))

    def ping(self) -> bool:
        """True when an agent answers at the socket."""
        try:
            self.node()
        except AgentUnavailable:
            return False
        return True

    def node(self) -> dict[str, Any]:
        return self._send(_node_call())

    def leases(self) -> list[dict[str, Any]]:
        return self._send(_leases_call())

    def create_lease(self, *, client: str, request: str | float | int | None = None,
                     limit: str | float | int | None = None, kind: str = "notebook",
                     devices: int = 1, kernel_id: str | None = None,
                     name: str | None = None, compute_request: str | float | None = None,
                     compute_limit: str | float | None = None,
                     logical_gpus: Sequence[str] | None = None,
                     reachable_gpus: Sequence[str] | None = None) -> dict[str, Any]:
        return self._send(_create_lease_call({
            "kind": kind, "client": client, "devices": devices, "request": request,
            "limit": limit, "kernel_id": kernel_id, "name": name,
            "compute_request": compute_request, "compute_limit": compute_limit,
            "logical_gpus": logical_gpus, "reachable_gpus": reachable_gpus}))

    def lease(self, lease_id: str) -> dict[str, Any]:
        return self._send(_lease_call(lease_id))

    def resize(self, lease_id: str, *, request: str | float | None = None,
               limit: str | float | None = None) -> dict[str, Any]:
        return self._send(_resize_call(lease_id, request, limit))

    def release(self, lease_id: str) -> None:
        self._send(_release_call(lease_id))

    def register_pid(self, lease_id: str, pid: int) -> dict[str, Any]:
        return self._send(_register_pid_call(lease_id, pid))

    def report_usage(self, lease_id: str, nbytes: int) -> None:
        self._send(_report_usage_call(lease_id, nbytes))

    def observe(self, lease_id: str, observation: Mapping[str, Any]) -> None:
        """A checkpoint or an offload this lease's kernel made (docs/agent-api.md)."""
        self._send(_observe_call(lease_id, observation))

    def migrated(self, lease_id: str) -> dict[str, Any]:
        return self._send(_migrated_call(lease_id))

    def park(self, lease_id: str, reason: str | None = None) -> dict[str, Any]:
        """The kernel now runs with no GPU: the lease gives its memory back (``reason``: why,
        for people)."""
        return self._send(_park_call(lease_id, reason))

    def park_request(self, lease_id: str) -> dict[str, Any]:
        """Ask the lease's client (its server) to park it: a ``park`` directive."""
        return self._send(_park_request_call(lease_id))

    def freeze(self, lease_id: str, reason: str | None = None) -> dict[str, Any]:
        """Park the lease by freezing its processes; answered once they are frozen. A 409
        (AgentError) says why freezing cannot be used."""
        return self._send(_freeze_call(lease_id, reason))

    def unpark(self, lease_id: str) -> dict[str, Any]:
        """A GPU for a parked lease: ``active`` on one, or ``pending`` with the reason."""
        return self._send(_unpark_call(lease_id))

    def directives(self, *, client: str | None = None, lease: str | None = None,
                   after: int = 0, timeout: float = 25.0, kinds: Sequence[str] | None = None
                   ) -> tuple[list[dict[str, Any]], int]:
        """Directives after ``after``, waiting up to ``timeout`` s for one; and the new cursor.
        ``kinds``: which to hear of (default: migrate, shrink, killed; park and the notices only
        when named)."""
        return self._send(_directives_call(client, lease, after, timeout, kinds))

    def metrics(self) -> str:
        return self._send(_metrics_call())


class AsyncAgentClient(_Common):
    """AgentClient's methods as coroutines, for code on an event loop.

    A connection per call, closed with it: a client nobody closes holds no socket, and a
    cancelled call (a long poll at shutdown) closes its connection on the spot.
    """

    def __init__(self, socket_path: str | None = None, timeout: float = 10.0,
                 state_dir: str | None = None) -> None:
        super().__init__(socket_path, timeout, state_dir)
        self._client: httpx.AsyncClient | None = None

    def _http(self) -> httpx.AsyncClient:
        if self._client is None:
            import httpx

            transport = httpx.AsyncHTTPTransport(**self._transport_options(keep=0))
            self._client = httpx.AsyncClient(transport=transport, trust_env=False)
        return self._client

    async def _send(self, call: _Call[T]) -> T:
        import asyncio

        attempts = self._attempts()
        while True:
            try:
                response = await self._http().send(self._build(call, attempts))
            except Exception as exc:
                await asyncio.sleep(attempts.after(exc))
                continue
            return self._answer(call, response)

    async def aclose(self) -> None:
        """Let go of the HTTP client (it holds no connection between calls)."""
        client, self._client = self._client, None
        if client is not None:
            await client.aclose()

    async def __aenter__(self) -> AsyncAgentClient:
        return self

    async def __aexit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.aclose()

    async def request(self, method: str, path: str, body: dict[str, Any] | None = None,
                      timeout: float | None = None) -> Any:
        """Any request: the parsed answer (JSON, text, or None)."""
        return await self._send(_raw_call(method, path, body, timeout))

    async def ping(self) -> bool:
        """True when an agent answers at the socket."""
        try:
            await self.node()
        except AgentUnavailable:
            return False
        return True

    async def node(self) -> dict[str, Any]:
        return await self._send(_node_call())

    async def leases(self) -> list[dict[str, Any]]:
        return await self._send(_leases_call())

    async def create_lease(self, *, client: str, request: str | float | int | None = None,
                           limit: str | float | int | None = None, kind: str = "notebook",
                           devices: int = 1, kernel_id: str | None = None,
                           name: str | None = None, compute_request: str | float | None = None,
                           compute_limit: str | float | None = None,
                           logical_gpus: Sequence[str] | None = None,
                           reachable_gpus: Sequence[str] | None = None) -> dict[str, Any]:
        return await self._send(_create_lease_call({
            "kind": kind, "client": client, "devices": devices, "request": request,
            "limit": limit, "kernel_id": kernel_id, "name": name,
            "compute_request": compute_request, "compute_limit": compute_limit,
            "logical_gpus": logical_gpus, "reachable_gpus": reachable_gpus}))

    async def lease(self, lease_id: str) -> dict[str, Any]:
        return await self._send(_lease_call(lease_id))

    async def resize(self, lease_id: str, *, request: str | float | None = None,
                     limit: str | float | None = None) -> dict[str, Any]:
        return await self._send(_resize_call(lease_id, request, limit))

    async def release(self, lease_id: str) -> None:
        await self._send(_release_call(lease_id))

    async def register_pid(self, lease_id: str, pid: int) -> dict[str, Any]:
        return await self._send(_register_pid_call(lease_id, pid))

    async def report_usage(self, lease_id: str, nbytes: int) -> None:
        await self._send(_report_usage_call(lease_id, nbytes))

    async def observe(self, lease_id: str, observation: Mapping[str, Any]) -> None:
        """A checkpoint or an offload this lease's kernel made (docs/agent-api.md)."""
        await self._send(_observe_call(lease_id, observation))

    async def migrated(self, lease_id: str) -> dict[str, Any]:
        return await self._send(_migrated_call(lease_id))

    async def park(self, lease_id: str, reason: str | None = None) -> dict[str, Any]:
        """The kernel now runs with no GPU: the lease gives its memory back (``reason``: why,
        for people)."""
        return await self._send(_park_call(lease_id, reason))

    async def park_request(self, lease_id: str) -> dict[str, Any]:
        """Ask the lease's client (its server) to park it: a ``park`` directive."""
        return await self._send(_park_request_call(lease_id))

    async def freeze(self, lease_id: str, reason: str | None = None) -> dict[str, Any]:
        """Park the lease by freezing its processes; answered once they are frozen. A 409
        (AgentError) says why freezing cannot be used."""
        return await self._send(_freeze_call(lease_id, reason))

    async def unpark(self, lease_id: str) -> dict[str, Any]:
        """A GPU for a parked lease: ``active`` on one, or ``pending`` with the reason."""
        return await self._send(_unpark_call(lease_id))

    async def directives(self, *, client: str | None = None, lease: str | None = None,
                         after: int = 0, timeout: float = 25.0,
                         kinds: Sequence[str] | None = None
                         ) -> tuple[list[dict[str, Any]], int]:
        """Directives after ``after``, waiting up to ``timeout`` s for one; and the new cursor.
        ``kinds``: which to hear of (default: migrate, shrink, killed; park and the notices only
        when named)."""
        return await self._send(_directives_call(client, lease, after, timeout, kinds))

    async def metrics(self) -> str:
        return await self._send(_metrics_call())
