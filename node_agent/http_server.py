"""The agent's HTTP server: connection limits, turns per user, bounds on bodies, the access log."""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import resource
import socket
import time
from collections import OrderedDict, deque
from collections.abc import Awaitable, Iterable
from typing import Any

from tornado import httpserver, httputil, ioloop, iostream, netutil, web

from node_agent.peers import TOKEN_REQUIRED, peer_credentials, token_matches
from node_agent.request_bodies import MAX_TEXT

log = logging.getLogger("gpufrac.agent")

# Refused requests (4xx) logged at debug level, at most this many a second: a client that
# keeps sending bad requests must not turn into a flood of log.
REFUSALS_LOGGED_PER_S = 10


class RequestLog:
    """Tornado's access log for the agent: answers at debug level (refusals rate-limited,
    the ones left out counted in the next line), server errors as warnings."""

    def __init__(self) -> None:
        self._second = 0
        self._logged = 0
        self._left_out = 0

    def __call__(self, handler: web.RequestHandler) -> None:
        status = handler.get_status()
        request = handler.request
        if status >= 500:
            log.warning("%d %s %s", status, request.method, request.uri)
            return
        if status < 400 or not log.isEnabledFor(logging.DEBUG):
            log.debug("%d %s %s", status, request.method, request.uri)
            return
        second = int(time.monotonic())
        if second != self._second:
            self._second, self._logged = second, 0
        if self._logged >= REFUSALS_LOGGED_PER_S:
            self._left_out += 1
            return
        self._logged += 1
        left_out, self._left_out = self._left_out, 0
        log.debug("%d %s %s%s", status, request.method, (request.uri or "")[:MAX_TEXT],
                  f" ({left_out} more refusals not logged)" if left_out else "")


# Requests are small JSON documents: past MAX_JSON the handler answers 413, and past
# MAX_BODY the connection is closed unread.
MAX_JSON = 64 * 1024
MAX_BODY = 1024 * 1024
MAX_HEADERS = 16 * 1024
# A connection that has not sent its headers (or its body) by then is closed.
REQUEST_TIMEOUT = 10.0
# Connections one uid may hold at once (root is not counted: it runs the system's servers).
CONNECTIONS_PER_USER = 256
# TCP connections that have not shown the token yet, all together: past it the oldest of them
# is closed for a new one, so that connections that never send a token cannot keep out the
# one that does (it shows the token with its first request). Peer addresses are not counted:
# every local user shares 127.0.0.1 with the token holder.
TCP_UNAUTHENTICATED = 256
# TCP connections that have shown the token (the token holder's), all together.
TCP_CONNECTIONS = 256
# Request bodies being read, all connections together, and one caller's (a uid's, or the TCP
# token holder's) share of that: past them a new body is answered 503 before any of it is read;
# over TCP only once the token has been checked.
BODY_BUFFER = 16 * 1024 * 1024
BODY_BUFFER_PER_CALLER = 4 * 1024 * 1024
BACKLOG = 4096
# The key of TCP connections in the body accounting: one caller, the token holder.
TCP = "tcp"
# Requests of one uid (not root) served at once, from their headers to their answer; the rest
# wait their turn, in order, unread. However many connections one user floods from, another
# user's request waits behind this many of theirs, not all of them. A long-poll (and a freeze
# or an unpark that waits) gives its turn back while it waits.
TURNS_PER_USER = 4


class Turns:
    """Whose requests are served now: at most ``per_user`` of each uid's at once, the others
    waiting in the order they came."""

    def __init__(self, per_user: int = TURNS_PER_USER) -> None:
        self._per_user = per_user
        self._busy: dict[int, int] = {}
        self._waiting: dict[int, deque[asyncio.Future[None]]] = {}

    def take(self, uid: int) -> asyncio.Future[None] | None:
        """None when ``uid``'s request is served now; else a future done at its turn."""
        busy = self._busy.get(uid, 0)
        if busy < self._per_user:
            self._busy[uid] = busy + 1
            return None
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(uid, deque()).append(waiter)
        return waiter

    def give_back(self, uid: int) -> None:
        """One of ``uid``'s requests is done (or waits now): the next of its own goes on."""
        waiting = self._waiting.get(uid)
        while waiting:
            waiter = waiting.popleft()
            if not waiter.done():  # not given up (its connection closed)
                waiter.set_result(None)  # the turn passes on: as many busy as before
                return
        self._waiting.pop(uid, None)
        busy = self._busy.get(uid, 1) - 1
        if busy > 0:
            self._busy[uid] = busy
        else:
            self._busy.pop(uid, None)


class AgentServer(httpserver.HTTPServer):
    """Tornado's HTTP server with the hygiene the agent needs: connection limits per uid (Unix
    socket), TCP connections counted once their token is checked (those without one apart,
    the oldest closed for a new one), a bound on request bodies buffered at once, and an
    accept loop that backs off at the descriptor limit instead of spinning."""

    def initialize(self, *args: Any, connections_per_user: int = CONNECTIONS_PER_USER,
                   tcp_unauthenticated: int = TCP_UNAUTHENTICATED,
                   tcp_connections: int = TCP_CONNECTIONS, body_buffer: int = BODY_BUFFER,
                   body_buffer_per_caller: int = BODY_BUFFER_PER_CALLER, **kwargs: Any) -> None:
        super().initialize(*args, **kwargs)
        self._per_user = connections_per_user
        self._tcp_unauthenticated = tcp_unauthenticated
        self._tcp_total = tcp_connections
        self.tcp_token: str | None = None
        # TCP connections by id(stream): those yet to show the token (oldest first), and those
        # that did.
        self._pending: OrderedDict[int, iostream.IOStream] = OrderedDict()
        self._admitted: set[int] = set()
        # Unix socket connections per uid.
        self._open: dict[int, int] = {}
        self._key_of: dict[int, int | str] = {}  # id(stream) -> its uid, or TCP
        self.turns = Turns()
        self._body_total = body_buffer
        self._body_per_caller = body_buffer_per_caller
        self._buffering = 0
        self._buffering_of: dict[int | str, int] = {}
        self._last_warning = 0.0

    def add_sockets(self, sockets: Iterable[socket.socket]) -> None:
        """Serve on listening sockets, Unix or TCP (``listen`` and ``bind`` come here too): one
        accept loop for all, which pauses at the descriptor limit where Tornado's would spin."""
        loop = ioloop.IOLoop.current()
        for sock in sockets:
            self._add_socket(loop, sock)

    def add_unix_socket(self, sock: socket.socket) -> None:
        self.add_sockets([sock])

    def _add_socket(self, loop: ioloop.IOLoop, sock: socket.socket) -> None:
        def resume() -> None:
            if not self._stopped:
                loop.add_handler(sock, accept, ioloop.IOLoop.READ)

        def accept(_fd: Any, _events: int) -> None:
            for _ in range(BACKLOG):
                try:
                    conn, address = sock.accept()
                except BlockingIOError:
                    return
                except ConnectionAbortedError:
                    continue
                except OSError as exc:
                    if exc.errno not in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                        raise
                    # Out of descriptors: pause, so that closing connections make room,
                    # rather than wake up for the same waiting peer again and again.
                    self._warn("out of file descriptors (%s); not accepting for 0.5 s", exc)
                    loop.remove_handler(sock)
                    loop.call_later(0.5, resume)
                    return
                self._handle_connection(conn, address)

        # TCPServer.stop removes the handler (a no-op while paused) and closes the socket.
        self._sockets[sock.fileno()] = sock
        self._handlers[sock.fileno()] = lambda: loop.remove_handler(sock)
        loop.add_handler(sock, accept, ioloop.IOLoop.READ)

    def handle_stream(self, stream: iostream.IOStream, address: Any) -> None:
        sock = stream.socket
        if sock.family != socket.AF_UNIX:
            if len(self._pending) >= self._tcp_unauthenticated:
                # Full of connections that never showed the token: the oldest makes room.
                _, oldest = self._pending.popitem(last=False)
                self._warn("%d TCP connections have not shown the token; closing the oldest",
                           self._tcp_unauthenticated)
                oldest.close()
            self._pending[id(stream)] = stream
            self._key_of[id(stream)] = TCP
            super().handle_stream(stream, address)
            return
        stream.gpufrac_peer = peer_credentials(sock)  # type: ignore[attr-defined]
        uid: int = stream.gpufrac_peer[1]  # type: ignore[attr-defined]
        limit = self._per_user if uid > 0 else 0
        if limit and self._open.get(uid, 0) >= limit:
            self._warn("uid %s holds %d connections, the limit; refusing one", uid, limit)
            _refuse(stream, f"too many connections from uid {uid} (at most {limit} at once); "
                            "close some and try again")
            return
        self._open[uid] = self._open.get(uid, 0) + 1
        self._key_of[id(stream)] = uid
        super().handle_stream(stream, address)

    def admit_tcp(self, stream: object, authorization: str) -> tuple[int, str] | None:
        """A TCP request's headers have come: None when the connection may go on (its token is
        right, and it is counted among the token holder's), else the status and message."""
        if not token_matches(self.tcp_token, authorization):
            return 401, TOKEN_REQUIRED
        key = id(stream)
        if key in self._pending:
            if len(self._admitted) >= self._tcp_total:
                self._warn("%d TCP connections with the token, the limit; refusing one",
                           self._tcp_total)
                return 503, (f"too many TCP connections (at most {self._tcp_total} at once); "
                             "close some and try again")
            del self._pending[key]
            self._admitted.add(key)
        return None

    def on_close(self, server_conn: object) -> None:
        stream = getattr(server_conn, "stream", None)
        key = self._key_of.pop(id(stream), None)
        if key == TCP:
            self._pending.pop(id(stream), None)
            self._admitted.discard(id(stream))
        elif isinstance(key, int):
            self._open[key] -= 1
            if not self._open[key]:
                del self._open[key]
        super().on_close(server_conn)

    def start_request(self, server_conn: object, request_conn: httputil.HTTPConnection
                      ) -> httputil.HTTPMessageDelegate:
        inner = super().start_request(server_conn, request_conn)
        stream = getattr(request_conn, "stream", None)
        return _BoundedBody(self, self._key_of.get(id(stream), TCP), inner, request_conn, stream)

    def reserve_body(self, key: int | str, size: int) -> bool:
        """Count ``size`` bytes of a body about to be read against the bounds; False: over them."""
        mine = self._buffering_of.get(key, 0)
        if size and (self._buffering + size > self._body_total
                     or mine + size > self._body_per_caller):
            self._warn("%d bytes of request bodies being read (%d from one caller); refusing one "
                       "of %d", self._buffering, mine, size)
            return False
        self._buffering += size
        self._buffering_of[key] = mine + size
        return True

    def release_body(self, key: int | str, size: int) -> None:
        self._buffering -= size
        left = self._buffering_of.get(key, 0) - size
        if left > 0:
            self._buffering_of[key] = left
        else:
            self._buffering_of.pop(key, None)

    def _warn(self, message: str, *args: Any) -> None:
        # At most one line a second: a flood must not turn into a flood of log.
        now = time.monotonic()
        if now - self._last_warning >= 1.0:
            self._last_warning = now
            log.warning(message, *args)


class _BoundedBody(httputil.HTTPMessageDelegate):
    """One request on its way to the application: its body's size (Content-Length, or MAX_BODY
    when chunked) is counted against the server's bounds before a byte of it is read, and a
    body over them is answered 503 and its connection closed unread."""

    def __init__(self, server: AgentServer, key: int | str, inner: httputil.HTTPMessageDelegate,
                 conn: httputil.HTTPConnection, stream: object) -> None:
        self._server = server
        self._key = key
        self._inner = inner
        self._conn = conn
        self._stream = stream
        self._held = 0
        self._refused = False
        self._turn = False
        self._waiter: asyncio.Future[None] | None = None

    def headers_received(self, start_line: httputil.RequestStartLine | httputil.ResponseStartLine,
                         headers: httputil.HTTPHeaders) -> Awaitable[None] | None:
        if self._key == TCP:
            # The token first: a connection without it is answered and closed before its
            # body is read or counted, and never takes a slot of the token holder's.
            refused = self._server.admit_tcp(self._stream, headers.get("Authorization", ""))
            if refused is not None:
                self._refuse(*refused)
                return None
        elif isinstance(self._key, int) and self._key > 0:
            self._waiter = self._server.turns.take(self._key)
            if self._waiter is not None:
                return self._at_turn(start_line, headers)
            self._took_turn()
        return self._admitted(start_line, headers)

    async def _at_turn(self, start_line: httputil.RequestStartLine | httputil.ResponseStartLine,
                       headers: httputil.HTTPHeaders) -> None:
        assert self._waiter is not None
        await self._waiter
        self._took_turn()
        done = self._admitted(start_line, headers)
        if done is not None:
            await done

    def _took_turn(self) -> None:
        self._waiter = None
        self._turn = True
        # The handler gives the turn back when it is done, or when it starts a long wait.
        self._conn.gpufrac_leave = self._leave_turn  # type: ignore[attr-defined]

    def _leave_turn(self) -> None:
        if self._turn:
            self._turn = False
            assert isinstance(self._key, int)
            self._server.turns.give_back(self._key)

    def _admitted(self, start_line: httputil.RequestStartLine | httputil.ResponseStartLine,
                  headers: httputil.HTTPHeaders) -> Awaitable[None] | None:
        size = 0
        if "Content-Length" in headers:
            try:
                size = min(int(headers["Content-Length"]), MAX_BODY + 1)
            except ValueError:
                size = 0  # Tornado answers 400 for it
        elif headers.get("Transfer-Encoding", "").lower() == "chunked":
            size = MAX_BODY
        if size < 0 or not self._server.reserve_body(self._key, max(size, 0)):
            self._refuse(503, "the agent is reading too many request bodies at once; "
                              "try again in a moment")
            return None
        self._held = max(size, 0)
        return self._inner.headers_received(start_line, headers)

    def _refuse(self, status: int, message: str) -> None:
        self._refused = True
        self._leave_turn()
        body = _error_json(message)
        self._conn.write_headers(
            httputil.ResponseStartLine("HTTP/1.1", status, httputil.responses.get(status, "")),
            httputil.HTTPHeaders({"Content-Type": "application/json", "Connection": "close",
                                  "Content-Length": str(len(body))}), body)
        # Finished before the body is read: Tornado closes the connection, body unread.
        self._conn.finish()

    def data_received(self, chunk: bytes) -> Awaitable[None] | None:
        return None if self._refused else self._inner.data_received(chunk)

    def finish(self) -> None:
        self._release()
        if not self._refused:
            self._inner.finish()

    def on_connection_close(self) -> None:
        self._release()
        if self._waiter is not None:
            self._waiter.cancel()  # gone before its turn came
        self._leave_turn()
        if not self._refused:
            self._inner.on_connection_close()

    def _release(self) -> None:
        if self._held:
            self._server.release_body(self._key, self._held)
            self._held = 0


def _error_json(message: str) -> bytes:
    return json.dumps({"error": {"field": None, "message": message}}).encode()


def _refuse(stream: iostream.IOStream, message: str) -> None:
    """Answer 503 on a connection that is not served, and close it."""
    body = _error_json(message)
    written = stream.write(
        b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
        b"Connection: close\r\nContent-Length: " + str(len(body)).encode()
        + b"\r\n\r\n" + body)
    written.add_done_callback(lambda done: _close(stream, done))


def _close(stream: iostream.IOStream, written: Any) -> None:
    if not written.cancelled():
        written.exception()  # a peer that left already is no error worth a log line
    stream.close()


def raise_descriptor_limit() -> None:
    """Take the hard limit on open files as the soft one: every client holds one."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def listen_unix(app: web.Application, path: str) -> AgentServer:
    """Serve on a Unix socket anyone who can reach its folder may connect to: identity comes
    from SO_PEERCRED. The folder exists and has been checked (``gpufrac-agent serve``)."""
    sock = netutil.bind_unix_socket(path, mode=0o666, backlog=BACKLOG)
    server = AgentServer(app, max_body_size=MAX_BODY, max_header_size=MAX_HEADERS,
                         idle_connection_timeout=REQUEST_TIMEOUT, body_timeout=REQUEST_TIMEOUT)
    raise_descriptor_limit()
    server.add_unix_socket(sock)
    return server


def listen_tcp(server: AgentServer, host: str, port: int, token: str) -> None:
    """Serve ``server`` on TCP too (requests need ``token``): through the same accept loop
    and limits as the Unix socket."""
    server.tcp_token = token
    server.listen(port, host, backlog=BACKLOG)
