"""The agent's HTTP API: its endpoints' handlers, who calls (SO_PEERCRED), which status a refusal is."""

from __future__ import annotations

import json
import math
import re
import socket
from typing import Any

from tornado import web

from node_agent.http_server import MAX_JSON, RequestLog
from node_agent.metrics import RenderedMetrics
from node_agent.peers import TOKEN_REQUIRED, peer_credentials, token_matches
from node_agent.request_bodies import (
    GPU_LISTS,
    MAX_ID,
    MAX_TEXT,
    NOT_TEXT,
    ApiError,
    parse_create_lease,
    parse_observation,
    parse_park,
    parse_pid,
    parse_resize,
    parse_usage,
    reject_unknown,
    text_ok,
)
from node_agent.service import (
    ACTIONS,
    KINDS,
    MAX_WAIT,
    Agent,
    Caller,
    Conflict,
    NotFound,
    NotYours,
    OverQuota,
    Refused,
)

# How long an unpark waits for a thaw before it answers `thawing` (the kernel then polls).
THAW_ANSWER_S = 5.0
# A lease id in a path, as the agent makes them (l-3f9a0c1b2d4e), with room to spare.
LEASE_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")

# What each refusal of the service is on the wire; a plain Refused is a bad value.
_STATUS: dict[type[Refused], int] = {NotYours: 403, NotFound: 404, Conflict: 409, OverQuota: 429}


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
            # Taken once per connection: a connection handed to another process keeps the
            # identity of the one that opened it, and /proc is never consulted.
            caller: Caller | None = getattr(stream, "gpufrac_caller", None)
            if caller is None:
                pid, uid, _gid, groups = getattr(stream, "gpufrac_peer", None) or \
                    peer_credentials(sock)
                admin = uid == 0 or (self._admin_gid is not None and self._admin_gid in groups)
                caller = Caller(uid=uid, pid=pid, admin=admin)
                stream.gpufrac_caller = caller  # type: ignore[union-attr]
            return caller
        # TCP exists only when a token is configured; a token holder is an admin.
        if token_matches(self._token, self.request.headers.get("Authorization", "")):
            return Caller(uid=-1, admin=True)
        raise ApiError(401, None, TOKEN_REQUIRED)

    def body(self) -> dict[str, Any]:
        """The request's JSON object; every field a scalar, or a list of GPU UUIDs where a
        request takes one (no request needs more)."""
        if not self.request.body:
            return {}
        if len(self.request.body) > MAX_JSON:
            raise ApiError(413, None, f"body: expected at most {MAX_JSON} bytes of JSON, got "
                                      f"{len(self.request.body)}")
        try:
            value = json.loads(self.request.body)
        except (ValueError, UnicodeDecodeError, RecursionError) as exc:
            raise ApiError(400, None, f"body: expected a JSON object ({str(exc)[:200]})") from exc
        if not isinstance(value, dict):
            raise ApiError(400, None, "body: expected a JSON object")
        for key, item in value.items():
            if not text_ok(key):
                raise ApiError(400, None, f"body: a field name is not text: {key!r}"[:MAX_TEXT])
            if isinstance(item, list) and key in GPU_LISTS:
                if not all(text_ok(u) for u in item if isinstance(u, str)):
                    raise ApiError(400, key, NOT_TEXT)
                continue  # checked, with the rest of its body, by its parser
            if not isinstance(item, str | int | float | bool | type(None)):
                raise ApiError(400, key[:MAX_ID], "expected a string, number, true/false or null, "
                                                  f"got {type(item).__name__}")
            if isinstance(item, str) and not text_ok(item):
                raise ApiError(400, key[:MAX_ID], NOT_TEXT)
        return value

    def log_exception(self, typ: type[BaseException] | None, value: BaseException | None,
                      tb: Any) -> None:
        if isinstance(value, web.HTTPError) and value.status_code < 500:
            return  # a refusal (Tornado's own, such as a query argument that is not UTF-8):
            # the request log has it, at debug level
        super().log_exception(typ, value, tb)

    def lease_body(self, lease_id: str) -> dict[str, Any]:
        """The body of a request about one lease. A lease the caller cannot see is a 404
        before any field is judged, whatever the body holds."""
        body = self.body()
        self.agent.lease(self.caller, lease_id)
        return body

    def leave_turn(self) -> None:
        """Give back this request's turn among its user's (see Turns): it is done, or it is
        about to wait on something other than the agent's loop."""
        leave = getattr(self.request.connection, "gpufrac_leave", None)
        if leave is not None:
            leave()

    def on_finish(self) -> None:
        self.leave_turn()

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
        if isinstance(e, Refused):
            e = ApiError(_STATUS.get(type(e), 400), e.field, e.message)
        if isinstance(e, ApiError):
            self.send_error(e.status, exc_info=(type(e), e, e.__traceback__))
            return
        super()._handle_request_exception(e)

    def query_number(self, name: str, default: float, kind: type[int] | type[float],
                     low: float, high: float) -> float:
        """Query argument ``name``: a finite number of ``kind`` from ``low`` to ``high``."""
        raw = self.get_query_argument(name, None)
        if raw is None:
            return default
        expected = f"{'an integer' if kind is int else 'a number'} from {low:g} to {high:g}"
        try:
            number = kind(raw[:64])
        except ValueError:
            raise ApiError(400, name, f"expected {expected}, got {raw[:64]!r}") from None
        if len(raw) > 64 or not math.isfinite(number) or not low <= number <= high:
            raise ApiError(400, name, f"expected {expected}, got {raw[:64]!r}")
        return number


class NodeHandler(BaseHandler):
    def get(self) -> None:
        self.reply(self.agent.node(self.caller))


class LeasesHandler(BaseHandler):
    def get(self) -> None:
        self.reply({"leases": [lease.to_json() for lease in self.agent.visible(self.caller)]})

    def post(self) -> None:
        lease = self.agent.create_lease(self.caller, parse_create_lease(self.body()))
        # What it waits for, as GET says: a freeze of a moment may be over by the first GET.
        self.reply({**lease.to_json(),
                    "waiting_for": self.agent.waiting_for(lease, self.caller.uid)}, 201)


class LeaseRoute(BaseHandler):
    """A handler of ``/v1/leases/<id>...``: an id that cannot be one is the field at fault."""

    def prepare(self) -> None:
        super().prepare()
        if not LEASE_ID.fullmatch(self.path_args[0]):
            raise ApiError(400, "lease", "expected a lease id: 1 to 64 letters, digits, '-' or "
                                         "'_', such as l-3f9a0c1b2d4e")


class LeaseHandler(LeaseRoute):
    def get(self, lease_id: str) -> None:
        lease = self.agent.lease(self.caller, lease_id)
        self.reply({**lease.to_json(), "room": self.agent.room(lease),
                    "waiting_for": self.agent.waiting_for(lease, self.caller.uid)})

    def patch(self, lease_id: str) -> None:
        change = parse_resize(self.lease_body(lease_id))
        self.reply(self.agent.resize(self.caller, lease_id, change).to_json())

    def delete(self, lease_id: str) -> None:
        self.agent.release(self.caller, lease_id)
        self.set_status(204)
        self.finish()


class PidsHandler(LeaseRoute):
    async def post(self, lease_id: str) -> None:
        pid = parse_pid(self.lease_body(lease_id))
        here = await self.agent.locate_pid(self.caller, pid)
        self.reply(self.agent.register_pid(self.caller, lease_id, pid, here).to_json())


class UsageHandler(LeaseRoute):
    def post(self, lease_id: str) -> None:
        self.agent.report_usage(self.caller, lease_id, parse_usage(self.lease_body(lease_id)))
        self.set_status(204)
        self.finish()


class ObservationsHandler(LeaseRoute):
    def post(self, lease_id: str) -> None:
        self.agent.observe(self.caller, lease_id, parse_observation(self.lease_body(lease_id)))
        self.set_status(204)
        self.finish()


class MigratedHandler(LeaseRoute):
    def post(self, lease_id: str) -> None:
        self.reply(self.agent.migrated(self.caller, lease_id).to_json())


class ParkHandler(LeaseRoute):
    def post(self, lease_id: str) -> None:
        reason = parse_park(self.lease_body(lease_id))
        self.reply(self.agent.park(self.caller, lease_id, reason).to_json())


class FreezeHandler(LeaseRoute):
    async def post(self, lease_id: str) -> None:
        # Answered once the driver has frozen the lease's processes (seconds for GiB), or
        # with a 409 that says why freezing cannot be used, for the caller's fallback.
        reason = parse_park(self.lease_body(lease_id))
        self.leave_turn()  # the driver takes seconds: the user's other requests go on
        lease = await self.agent.freeze(self.caller, lease_id, reason)
        self.reply(lease.to_json())


class ParkRequestHandler(LeaseRoute):
    def post(self, lease_id: str) -> None:
        reject_unknown(self.lease_body(lease_id), ())
        # Accepted: the lease's client is asked to park it, and does so when it can.
        self.reply(self.agent.park_request(self.caller, lease_id).to_json(), 202)


class UnparkHandler(LeaseRoute):
    async def post(self, lease_id: str) -> None:
        reject_unknown(self.lease_body(lease_id), ())
        lease = self.agent.unpark(self.caller, lease_id)
        if lease.state == "thawing":
            # A short thaw is answered done: the waiting cell need not poll for it.
            self.leave_turn()
            lease = await self.agent.acted(lease.id, THAW_ANSWER_S) or lease
        self.reply(lease.to_json())


class DirectivesHandler(BaseHandler):
    async def get(self) -> None:
        client = self.get_query_argument("client", None)
        lease_id = self.get_query_argument("lease", None)
        if (client is None) == (lease_id is None):
            raise ApiError(400, "client", "give exactly one of client=NAME or lease=ID")
        for name, value in (("client", client), ("lease", lease_id)):
            if value is not None and not 0 < len(value) <= MAX_TEXT:
                raise ApiError(400, name, f"expected 1 to {MAX_TEXT} characters")
        kinds: tuple[str, ...] = ACTIONS
        if (named := self.get_query_argument("kinds", None)) is not None:
            kinds = tuple(dict.fromkeys(k.strip() for k in named.split(",") if k.strip()))
            unknown = [k for k in kinds if k not in KINDS]
            if unknown or not kinds:
                raise ApiError(400, "kinds", "expected a comma-separated list of "
                               f"{', '.join(KINDS)}, got {named[:MAX_TEXT]!r}")
        after = int(self.query_number("after", 0, int, -1, 2**63 - 1))
        timeout = self.query_number("timeout", 0.0, float, 0, MAX_WAIT)
        if timeout:
            self.leave_turn()  # a long-poll waits for an event, at no cost to the loop
        found, last = await self.agent.wait_directives(
            self.caller, client=client, lease_id=lease_id, kinds=kinds, after=after,
            timeout=timeout)
        self.reply({"directives": [d.to_json() for d in found], "last": last})


class MetricsHandler(BaseHandler):
    def initialize(self, agent: Agent, admin_gid: int | None, token: str | None,
                   rendered: RenderedMetrics | None = None) -> None:
        super().initialize(agent, admin_gid, token)
        self._rendered = rendered or RenderedMetrics()

    def get(self) -> None:
        self.set_header("Content-Type", "text/plain; version=0.0.4")
        self.finish(self._rendered.get(self.agent, self.caller))


class NoEndpoint(BaseHandler):
    def prepare(self) -> None:
        super().prepare()
        method, path = self.request.method, self.request.path
        raise ApiError(404, None, f"no endpoint {method} {path}; see docs/agent-api.md")


def make_app(agent: Agent, admin_gid: int | None = None, token: str | None = None) -> web.Application:
    args = {"agent": agent, "admin_gid": admin_gid, "token": token}
    # Any segment: LeaseRoute refuses one that is not a lease id, naming the field.
    lease = r"/v1/leases/([^/]+)"
    return web.Application(
        [
            (r"/v1/node", NodeHandler, args),
            (r"/v1/leases", LeasesHandler, args),
            (lease, LeaseHandler, args),
            (lease + "/pids", PidsHandler, args),
            (lease + "/usage", UsageHandler, args),
            (lease + "/observations", ObservationsHandler, args),
            (lease + "/migrated", MigratedHandler, args),
            (lease + "/park", ParkHandler, args),
            (lease + "/park-request", ParkRequestHandler, args),
            (lease + "/freeze", FreezeHandler, args),
            (lease + "/unpark", UnparkHandler, args),
            (r"/v1/directives", DirectivesHandler, args),
            (r"/metrics", MetricsHandler, {**args, "rendered": RenderedMetrics()}),
        ],
        default_handler_class=NoEndpoint,
        default_handler_args=args,
        log_function=RequestLog(),
    )

