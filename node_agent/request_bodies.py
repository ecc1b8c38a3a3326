"""What the agent's request bodies may say: a parser per endpoint, and the 400 that names the field."""

from __future__ import annotations

import math
import reprlib
from collections.abc import Iterable
from typing import Any

from node_agent import policy
from node_agent.quantities import Quantity, QuantityError, parse_quantity
from node_agent.service import CreateLease, Resize
from node_agent.stats import CHECKPOINT_TRIGGERS, OFFLOAD_REASONS, Observation

# Bounds on what a request may carry (an id is a UUID; a name is for people).
MAX_ID = 128
# The fields that are lists of GPU UUIDs (POST /v1/leases).
GPU_LISTS = ("logical_gpus", "reachable_gpus")
# More GPUs than any node has: a list longer than this is not a list of this node's GPUs.
MAX_GPUS = 64
MAX_TEXT = 200
# Bytes fit a signed 64-bit integer (SQLite's, Prometheus's float keeps them finite).
MAX_BYTES = 2**63 - 1
# pid_t is a signed 32-bit integer.
MAX_PID = 2**31 - 1
# A checkpoint longer than a day is a clock gone wrong, not a checkpoint.
MAX_OBSERVED_SECONDS = 86400.0


class ApiError(Exception):
    """A refused request: HTTP status, the field at fault (or None) and what was expected."""

    def __init__(self, status: int, field: str | None, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.field = field
        self.message = message


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


def text_ok(text: str) -> bool:
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


def reject_unknown(body: dict[str, Any], allowed: Iterable[str]) -> None:
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
    reject_unknown(body, ("kind", "request", "limit", "devices", "client", "kernel_id", "name",
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
    reject_unknown(body, ("request", "limit", "compute_request", "compute_limit"))
    return Resize(
        request=_quantity(body, "request"), limit=_quantity(body, "limit"),
        compute_request=_compute_fraction(body, "compute_request"),
        compute_limit=_compute_fraction(body, "compute_limit"),
    )


def parse_pid(body: dict[str, Any]) -> int:
    """``POST /v1/leases/<id>/pids``."""
    reject_unknown(body, ("pid",))
    pid: int = _field(body, "pid", int, required=True,
                      expected=f"a process id, 1 to {MAX_PID}", low=1, high=MAX_PID)
    return pid


def parse_park(body: dict[str, Any]) -> str | None:
    """``POST /v1/leases/<id>/park``: why, for people (None: the agent's own words)."""
    reject_unknown(body, ("reason",))
    reason: str | None = _field(body, "reason", str, expected="a sentence for people")
    if reason is not None and not 0 < len(reason) <= MAX_TEXT:
        raise ApiError(400, "reason", f"expected 1 to {MAX_TEXT} characters")
    return reason


def parse_observation(body: dict[str, Any]) -> Observation:
    """``POST /v1/leases/<id>/observations``: a checkpoint or an offload the kernel made."""
    kind = _field(body, "kind", str, required=True, expected='"checkpoint" or "offload"')
    if kind == "checkpoint":
        reject_unknown(body, ("kind", "trigger", "bytes", "written_bytes", "seconds"))
        why = _field(body, "trigger", str, required=True,
                     expected=f"one of {list(CHECKPOINT_TRIGGERS)}")
        if why not in CHECKPOINT_TRIGGERS:
            raise ApiError(400, "trigger", f"expected one of {list(CHECKPOINT_TRIGGERS)}, got {why!r}")
    elif kind == "offload":
        reject_unknown(body, ("kind", "reason", "bytes"))
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
    reject_unknown(body, ("bytes",))
    used: int = _field(body, "bytes", int, required=True,
                       expected="bytes in use, an integer >= 0 (at most 2^63-1)", low=0,
                       high=MAX_BYTES)
    return used
