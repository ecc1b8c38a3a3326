"""The agent's HTTP API on a Unix socket: who calls (SO_PEERCRED), what bodies say, which status."""

from __future__ import annotations

import asyncio
import errno
import hmac
import json
import logging
import math
import re
import reprlib
import resource
import socket
import struct
import time
from collections import OrderedDict, deque
from collections.abc import Awaitable, Iterable
from typing import Any

from tornado import httpserver, httputil, ioloop, iostream, netutil, web

from node_agent import policy
from node_agent.metrics import RenderedMetrics
from node_agent.quantities import Quantity, QuantityError, parse_quantity
from node_agent.service import (
    ACTIONS,
    KINDS,
    MAX_WAIT,
    Agent,
    Caller,
    Conflict,
    CreateLease,
    NotFound,
    NotYours,
    OverQuota,
    Refused,
    Resize,
)
from node_agent.stats import CHECKPOINT_TRIGGERS, OFFLOAD_REASONS, Observation

log = logging.getLogger("gpufrac.agent")

# Bounds on what a request may carry (an id is a UUID; a name is for people).
MAX_ID = 128
# The fields that are lists of GPU UUIDs (POST /v1/leases).
GPU_LISTS = ("logical_gpus", "reachable_gpus")
# More GPUs than any node has: a list longer than this is not a list of this node's GPUs.
MAX_GPUS = 64
# How long an unpark waits for a thaw before it answers `thawing` (the kernel then polls).
THAW_ANSWER_S = 5.0
MAX_TEXT = 200
# Bytes fit a signed 64-bit integer (SQLite's, Prometheus's float keeps them finite).
MAX_BYTES = 2**63 - 1
# pid_t is a signed 32-bit integer.
MAX_PID = 2**31 - 1
# A checkpoint longer than a day is a clock gone wrong, not a checkpoint.
MAX_OBSERVED_SECONDS = 86400.0
# A lease id in a path, as the agent makes them (l-3f9a0c1b2d4e), with room to spare.
LEASE_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")


TOKEN_REQUIRED = "a token is required over TCP: send 'Authorization: token <token>'"


def token_matches(token: str | None, authorization: str) -> bool:
    """Whether an ``Authorization`` header carries the TCP token (in constant time)."""
    # Bytes: compare_digest refuses str with characters outside ASCII.
    return bool(token) and hmac.compare_digest(authorization.encode("utf-8", "replace"),
                                               f"token {token}".encode())


class ApiError(Exception):
    """A refused request: HTTP status, the field at fault (or None) and what was expected."""

    def __init__(self, status: int, field: str | None, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.field = field
        self.message = message


# What each refusal of the service is on the wire; a plain Refused is a bad value.
_STATUS: dict[type[Refused], int] = {NotYours: 403, NotFound: 404, Conflict: 409, OverQuota: 429}


def _field(body: dict[str, Any], name: str, kind: type | tuple[type, ...], default: Any = None, *,
           required: bool = False, expected: str = "", low: float | None = None,
           high: float | None = None) -> Any:
    """``body[name]`` if it is a ``kind`` (numbers: within ``low``..``high``), else a 400
    naming the field and what was expected."""
    value = body.get(name)
    if value is None:
        if required:
            raise ApiError(400, name, f"is required: {expected}")
        return default
    # bool is an int to Python, never to a client.
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        raise ApiError(400, name, f"expected {expected}, got {_shown(value)}")
    # Every number is bounded: one absurd figure stored would break node-wide views.
    if isinstance(value, int | float) and not isinstance(value, bool) and (
            (isinstance(value, float) and not math.isfinite(value))
            or (low is not None and value < low) or (high is not None and value > high)):
        raise ApiError(400, name, f"expected {expected}, got {_shown(value)}")
    return value


NOT_TEXT = ("expected text, got a string that is not valid Unicode (a lone surrogate such as "
            "\\ud800 has no UTF-8 form)")


def _text_ok(text: str) -> bool:
    """Whether ``text`` is text: JSON's \\u escapes can name lone surrogates, which no UTF-8
    store, log or answer can hold."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _shown(value: Any) -> str:
    # A 10**400 would take a page (and Python refuses to print past 4300 digits).
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_BYTES:
        return "an integer below -2^63" if value < 0 else "an integer above 2^63-1"
    return reprlib.repr(value)


def _reject_unknown(body: dict[str, Any], allowed: Iterable[str]) -> None:
    for key in body:
        if key in ("uid", "owner_uid", "caller", "user"):
            raise ApiError(400, key, "not accepted: the caller is the socket's peer (SO_PEERCRED)")
        if key not in allowed:
            raise ApiError(400, key, f"unknown field; expected one of {sorted(allowed)}")


def _quantity(body: dict[str, Any], name: str, several: str | None = None) -> Quantity | None:
    if body.get(name) is None:
        return None
    try:
        return parse_quantity(body[name], name, several=several)
    except QuantityError as exc:
        raise ApiError(400, exc.field, exc.message) from exc


def _compute_fraction(body: dict[str, Any], name: str) -> float | None:
    """``compute_request`` or ``compute_limit``: a fraction of the GPU's compute."""
    quantity = _quantity(body, name)
    if quantity is None:
        return None
    if quantity.fraction is None:
        raise ApiError(400, name, f"expected a fraction 0 < f <= 1 of the GPU's compute, "
                                  f"got {body[name]!r}")
    return quantity.fraction


def parse_create_lease(body: dict[str, Any]) -> CreateLease:
    """``POST /v1/leases``."""
    _reject_unknown(body, ("kind", "request", "limit", "devices", "client", "kernel_id", "name",
                           "compute_request", "compute_limit", "logical_gpus", "reachable_gpus"))
    kind = _field(body, "kind", str, policy.NOTEBOOK, expected=f"one of {policy.KINDS}")
    if kind not in policy.KINDS:
        raise ApiError(400, "kind", f"expected one of {policy.KINDS}, got {kind!r}")
    client = _field(body, "client", str, required=True,
                    expected="a name for the program that holds the lease")
    if not client.strip() or len(client) > MAX_TEXT:
        raise ApiError(400, "client", f"expected 1 to {MAX_TEXT} characters")
    kernel_id = _field(body, "kernel_id", str, expected="a kernel id string")
    if kernel_id is not None and not 0 < len(kernel_id) <= MAX_ID:
        raise ApiError(400, "kernel_id", f"expected 1 to {MAX_ID} characters")
    name = _field(body, "name", str, "", expected="a string")
    if len(name) > MAX_TEXT:
        raise ApiError(400, "name", f"expected at most {MAX_TEXT} characters")
    devices = _field(body, "devices", int, 1, expected=f"a whole number of GPUs, 1 to {MAX_GPUS}",
                     low=1, high=MAX_GPUS)
    # A job takes a whole GPU unless it says otherwise; a notebook must say.
    several = '"devices": {n}'
    request = _quantity(body, "request", several) or (
        Quantity(fraction=1.0) if kind == policy.JOB else None
    )
    if request is None:
        raise ApiError(400, "request", "is required: a fraction like 0.25 or a size like 4Gi")
    return CreateLease(
        kind=kind, client=client, request=request, limit=_quantity(body, "limit", several) or request,
        devices=devices, kernel_id=kernel_id, name=name,
        compute_request=_compute_fraction(body, "compute_request"),
        compute_limit=_compute_fraction(body, "compute_limit"),
        logical=_gpu_list(body, "logical_gpus"), reach=_gpu_list(body, "reachable_gpus") or (),
    )


def _gpu_list(body: dict[str, Any], name: str) -> tuple[str, ...] | None:
    """A list of distinct GPU UUIDs (``logical_gpus``: the cluster's plan; ``reachable_gpus``:
    the GPUs the client's processes can see)."""
    value = _field(body, name, list, expected="a list of GPU UUIDs")
    if value is None:
        return None
    if not value or len(value) > MAX_GPUS or not all(
            isinstance(u, str) and 0 < len(u) <= MAX_ID for u in value) or len(set(value)) < len(value):
        raise ApiError(400, name, f"expected 1 to {MAX_GPUS} distinct GPU UUIDs, got "
                                  f"{reprlib.repr(value)}")
    return tuple(value)


def parse_resize(body: dict[str, Any]) -> Resize:
    """``PATCH /v1/leases/<id>``."""
    _reject_unknown(body, ("request", "limit", "compute_request", "compute_limit"))
    return Resize(
        request=_quantity(body, "request"), limit=_quantity(body, "limit"),
        compute_request=_compute_fraction(body, "compute_request"),
        compute_limit=_compute_fraction(body, "compute_limit"),
    )


def parse_pid(body: dict[str, Any]) -> int:
    """``POST /v1/leases/<id>/pids``."""
    _reject_unknown(body, ("pid",))
    pid: int = _field(body, "pid", int, required=True,
                      expected=f"a process id, 1 to {MAX_PID}", low=1, high=MAX_PID)
    return pid


def parse_park(body: dict[str, Any]) -> str | None:
    """``POST /v1/leases/<id>/park``: why, for people (None: the agent's own words)."""
    _reject_unknown(body, ("reason",))
    reason: str | None = _field(body, "reason", str, expected="a sentence for people")
    if reason is not None and not 0 < len(reason) <= MAX_TEXT:
        raise ApiError(400, "reason", f"expected 1 to {MAX_TEXT} characters")
    return reason


def parse_observation(body: dict[str, Any]) -> Observation:
    """``POST /v1/leases/<id>/observations``: a checkpoint or an offload the kernel made."""
    kind = _field(body, "kind", str, required=True, expected='"checkpoint" or "offload"')
    if kind == "checkpoint":
        _reject_unknown(body, ("kind", "trigger", "bytes", "written_bytes", "seconds"))
        why = _field(body, "trigger", str, required=True,
                     expected=f"one of {list(CHECKPOINT_TRIGGERS)}")
        if why not in CHECKPOINT_TRIGGERS:
            raise ApiError(400, "trigger", f"expected one of {list(CHECKPOINT_TRIGGERS)}, got {why!r}")
    elif kind == "offload":
        _reject_unknown(body, ("kind", "reason", "bytes"))
        why = _field(body, "reason", str, required=True,
                     expected=f"one of {list(OFFLOAD_REASONS)}")
        if why not in OFFLOAD_REASONS:
            raise ApiError(400, "reason", f"expected one of {list(OFFLOAD_REASONS)}, got {why!r}")
    else:
        raise ApiError(400, "kind", f'expected "checkpoint" or "offload", got {kind!r}')
    sizes = {}
    for name in ("bytes", "written_bytes"):
        sizes[name] = _field(body, name, int, 0, required=name == "bytes",
                             expected="a number of bytes, an integer >= 0 (at most 2^63-1)",
                             low=0, high=MAX_BYTES)
    seconds = _field(body, "seconds", (int, float), 0.0,
                     expected=f"0 to {MAX_OBSERVED_SECONDS:g} seconds", low=0,
                     high=MAX_OBSERVED_SECONDS)
    return Observation(kind, why, sizes["bytes"], sizes["written_bytes"], float(seconds))


def parse_usage(body: dict[str, Any]) -> int:
    """``POST /v1/leases/<id>/usage``: bytes in use."""
    _reject_unknown(body, ("bytes",))
    used: int = _field(body, "bytes", int, required=True,
                       expected="bytes in use, an integer >= 0 (at most 2^63-1)", low=0,
                       high=MAX_BYTES)
    return used

_UCRED = struct.Struct("3i")  # pid, uid, gid
SO_PEERGROUPS = getattr(socket, "SO_PEERGROUPS", 59)  # Linux 4.13; Python does not name it
_MAX_GROUPS = 65536


def peer_credentials(sock: socket.socket) -> tuple[int, int, int, frozenset[int]]:
    """(pid, uid, gid, supplementary gids) of the peer of a Unix socket, as they were when
    it connected: the kernel records them then, so nothing a pid later becomes can change them."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    pid, uid, gid = _UCRED.unpack(raw)
    size = 64 * 4
    while True:
        try:
            raw = sock.getsockopt(socket.SOL_SOCKET, SO_PEERGROUPS, size)
            break
        except OSError as exc:
            if exc.errno != errno.ERANGE or size >= _MAX_GROUPS * 4:
                raise
            size *= 4
    groups = frozenset(struct.unpack(f"{len(raw) // 4}I", raw[: len(raw) // 4 * 4]))
    return pid, uid, gid, groups | {gid}


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
            if not _text_ok(key):
                raise ApiError(400, None, f"body: a field name is not text: {key!r}"[:MAX_TEXT])
            if isinstance(item, list) and key in GPU_LISTS:
                if not all(_text_ok(u) for u in item if isinstance(u, str)):
                    raise ApiError(400, key, NOT_TEXT)
                continue  # checked, with the rest of its body, by its parser
            if not isinstance(item, str | int | float | bool | type(None)):
                raise ApiError(400, key[:MAX_ID], "expected a string, number, true/false or null, "
                                                  f"got {type(item).__name__}")
            if isinstance(item, str) and not _text_ok(item):
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
        _reject_unknown(self.lease_body(lease_id), ())
        # Accepted: the lease's client is asked to park it, and does so when it can.
        self.reply(self.agent.park_request(self.caller, lease_id).to_json(), 202)


class UnparkHandler(LeaseRoute):
    async def post(self, lease_id: str) -> None:
        _reject_unknown(self.lease_body(lease_id), ())
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
        log_function=_RequestLog(),
    )


# Refused requests (4xx) logged at debug level, at most this many a second: a client that
# keeps sending bad requests must not turn into a flood of log.
REFUSALS_LOGGED_PER_S = 10


class _RequestLog:
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
