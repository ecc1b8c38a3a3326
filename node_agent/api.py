"""The agent's HTTP API on a Unix socket; the caller is the socket's peer (SO_PEERCRED)."""

from __future__ import annotations

import hmac
import json
import logging
import os
import socket
import struct
from typing import Any

from tornado import httpserver, netutil, web

from node_agent import procs
from node_agent.metrics import render_metrics
from node_agent.service import Agent, ApiError, Caller

log = logging.getLogger("gpufrac.agent")

_UCRED = struct.Struct("3i")  # pid, uid, gid


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end of a Unix socket."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    pid, uid, gid = _UCRED.unpack(raw)
    return pid, uid, gid


class BaseHandler(web.RequestHandler):
    agent: Agent
    caller: Caller

    def initialize(self, agent: Agent, admin_gid: int | None, token: str | None) -> None:
        self.agent = agent
        self._admin_gid = admin_gid
        self._token = token

    def prepare(self) -> None:
        self.caller = self._identify()

    def _identify(self) -> Caller:
        stream = getattr(self.request.connection, "stream", None)
        sock = getattr(stream, "socket", None)
        if sock is not None and sock.family == socket.AF_UNIX:
            pid, uid, gid = peer_credentials(sock)
            groups = procs.groups_of(pid) | {gid}
            admin = uid == 0 or (self._admin_gid is not None and self._admin_gid in groups)
            return Caller(uid=uid, pid=pid, admin=admin)
        # TCP exists only when a token is configured; a token holder is an admin.
        header = self.request.headers.get("Authorization", "")
        if self._token and hmac.compare_digest(header, f"token {self._token}"):
            return Caller(uid=-1, admin=True)
        raise ApiError(401, None, "a token is required over TCP: send 'Authorization: token <token>'")

    def body(self) -> dict[str, Any]:
        if not self.request.body:
            return {}
        try:
            value = json.loads(self.request.body)
        except (ValueError, UnicodeDecodeError) as exc:
            raise ApiError(400, None, f"body: expected a JSON object ({exc})") from exc
        if not isinstance(value, dict):
            raise ApiError(400, None, "body: expected a JSON object")
        return value

    def reply(self, value: Any, status: int = 200) -> None:
        self.set_status(status)
        self.set_header("Content-Type", "application/json")
        self.finish(json.dumps(value))

    def write_error(self, status_code: int, **kwargs: Any) -> None:
        exc = kwargs.get("exc_info", (None, None, None))[1]
        if isinstance(exc, ApiError):
            field, message = exc.field, exc.message
        elif isinstance(exc, web.HTTPError):
            field, message = None, exc.log_message or self._reason
        else:
            field, message = None, "internal error in the agent; its log has the details"
        self.set_header("Content-Type", "application/json")
        self.finish(json.dumps({"error": {"field": field, "message": message}}))

    def _handle_request_exception(self, e: BaseException) -> None:
        if isinstance(e, ApiError):
            self.send_error(e.status, exc_info=(type(e), e, e.__traceback__))
            return
        super()._handle_request_exception(e)

    def query_number(self, name: str, default: float, kind: type[int] | type[float],
                     expected: str) -> float:
        raw = self.get_query_argument(name, None)
        if raw is None:
            return default
        try:
            return kind(raw)
        except ValueError:
            raise ApiError(400, name, f"expected {expected}, got {raw!r}") from None


class NodeHandler(BaseHandler):
    def get(self) -> None:
        self.reply(self.agent.node(self.caller))


class LeasesHandler(BaseHandler):
    def get(self) -> None:
        self.reply({"leases": [lease.to_json() for lease in self.agent.visible(self.caller)]})

    def post(self) -> None:
        lease = self.agent.create_lease(self.caller, self.body())
        self.reply(lease.to_json(), 201)


class LeaseHandler(BaseHandler):
    def get(self, lease_id: str) -> None:
        lease = self.agent.lease(self.caller, lease_id)
        self.reply({**lease.to_json(), "room": self.agent.room(lease)})

    def patch(self, lease_id: str) -> None:
        self.reply(self.agent.resize(self.caller, lease_id, self.body()).to_json())

    def delete(self, lease_id: str) -> None:
        self.agent.release(self.caller, lease_id)
        self.set_status(204)
        self.finish()


class PidsHandler(BaseHandler):
    def post(self, lease_id: str) -> None:
        self.reply(self.agent.register_pid(self.caller, lease_id, self.body()).to_json())


class UsageHandler(BaseHandler):
    def post(self, lease_id: str) -> None:
        self.agent.report_usage(self.caller, lease_id, self.body())
        self.set_status(204)
        self.finish()


class MigratedHandler(BaseHandler):
    def post(self, lease_id: str) -> None:
        self.reply(self.agent.migrated(self.caller, lease_id).to_json())


class DirectivesHandler(BaseHandler):
    async def get(self) -> None:
        client = self.get_query_argument("client", None)
        lease_id = self.get_query_argument("lease", None)
        if (client is None) == (lease_id is None):
            raise ApiError(400, "client", "give exactly one of client=NAME or lease=ID")
        found, last = await self.agent.wait_directives(
            self.caller, client=client, lease_id=lease_id,
            after=int(self.query_number("after", 0, int, "an integer")),
            timeout=self.query_number("timeout", 0.0, float, "a number of seconds"),
        )
        self.reply({"directives": [d.to_json() for d in found], "last": last})


class MetricsHandler(BaseHandler):
    def get(self) -> None:
        self.set_header("Content-Type", "text/plain; version=0.0.4")
        self.finish(render_metrics(self.agent, self.caller))


class NotFound(BaseHandler):
    def prepare(self) -> None:
        super().prepare()
        method, path = self.request.method, self.request.path
        raise ApiError(404, None, f"no endpoint {method} {path}; see docs/agent-api.md")


def make_app(agent: Agent, admin_gid: int | None = None, token: str | None = None) -> web.Application:
    args = {"agent": agent, "admin_gid": admin_gid, "token": token}
    lease = r"/v1/leases/([A-Za-z0-9_-]{1,64})"
    return web.Application(
        [
            (r"/v1/node", NodeHandler, args),
            (r"/v1/leases", LeasesHandler, args),
            (lease, LeaseHandler, args),
            (lease + "/pids", PidsHandler, args),
            (lease + "/usage", UsageHandler, args),
            (lease + "/migrated", MigratedHandler, args),
            (r"/v1/directives", DirectivesHandler, args),
            (r"/metrics", MetricsHandler, args),
        ],
        default_handler_class=NotFound,
        default_handler_args=args,
        log_function=_log_request,
    )


def _log_request(handler: web.RequestHandler) -> None:
    status = handler.get_status()
    level = logging.DEBUG if status < 400 else logging.INFO
    log.log(level, "%d %s %s", status, handler.request.method, handler.request.uri)


def listen_unix(app: web.Application, path: str) -> httpserver.HTTPServer:
    """Serve on a Unix socket anyone may connect to: identity comes from SO_PEERCRED."""
    os.makedirs(os.path.dirname(path) or ".", mode=0o755, exist_ok=True)
    sock = netutil.bind_unix_socket(path, mode=0o666)
    server = httpserver.HTTPServer(app)
    server.add_socket(sock)
    return server
