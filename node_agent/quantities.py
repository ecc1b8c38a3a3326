"""GPU memory quantities: fractions of one GPU, or memory sizes, as Run:ai and KAI write them."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from decimal import Decimal

KiB = 1024
MiB = 1024**2
GiB = 1024**3

_UNITS = {
    "": 1,
    "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
    "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40,
}
# ASCII only: Python's \d, int() and float() also take other scripts' digits and underscores.
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([KMGT]i?)?B?\s*$", re.ASCII)
_NUMBER_CHARS = frozenset("0123456789.eE+-")
_MAX_BYTES = 2**50
# The most any count or byte figure the agent stores or shows may be: a signed 64-bit integer.
MAX_COUNT = 2**63 - 1
_MAX_TEXT = 32
_EXPECTED = "a fraction 0 < f <= 1 of one GPU, or a memory size like 2500M, 4G, 4Gi or bytes"


class QuantityError(ValueError):
    """A malformed quantity; names the field at fault and what was expected."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


@dataclass(frozen=True)
class Quantity:
    """Either a fraction of one GPU or a number of bytes (exactly one is set).

    ``spec`` keeps the text it was parsed from, which is what goes on the wire and into
    the ledger (``4.0 GiB`` for ``4300M`` would not say what the user asked for).
    """

    fraction: float | None = None
    nbytes: int | None = None
    spec: str = field(default="", compare=False)

    def bytes_of(self, total: int) -> int:
        """Bytes this quantity means on a GPU with ``total`` bytes."""
        if self.fraction is not None:
            return int(self.fraction * total)
        assert self.nbytes is not None
        return self.nbytes

    def __str__(self) -> str:
        if self.fraction is not None:
            return f"{self.fraction:g}"
        return format_bytes(self.nbytes or 0)


def parse_quantity(value: object, field: str) -> Quantity:
    """Parse ``0.25``, ``1``, ``2500M``, ``4G``, ``4Gi`` or a byte count.

    A bare number up to 1 is a fraction of one GPU; a bare integer above 1 is bytes.
    """
    if isinstance(value, bool) or value is None:
        raise QuantityError(field, f"expected {_EXPECTED}, got {value!r}")
    if isinstance(value, int | float):
        text = repr(value)
    elif isinstance(value, str):
        text = value.strip()
    else:
        raise QuantityError(field, f"expected {_EXPECTED}, got {type(value).__name__}")
    # Checked first: converting a number of a million digits takes the process seconds.
    if len(text) > _MAX_TEXT:
        raise QuantityError(field, f"expected at most {_MAX_TEXT} characters, got {len(text)}")
    # float() takes "1_000" and "٤", which no spec (KAI's, Kubernetes') writes: what is
    # stored must read back as the same quantity anywhere.
    if not text.isascii() or "_" in text:
        raise QuantityError(field, f"expected ASCII digits only (no underscores or other "
                                   f"scripts' digits): {_EXPECTED}, got {text!r}")
    try:
        # Only plain decimal numbers: float() would also take "nan", "inf" and "infinity".
        number = float(text) if set(text) <= _NUMBER_CHARS else math.nan
    except ValueError:
        number = math.nan
    if not math.isnan(number):
        if math.isinf(number) or number <= 0:
            raise QuantityError(field, f"expected {_EXPECTED}, got {text!r}")
        if number <= 1:
            return Quantity(fraction=number, spec=text)
        if number != int(number):
            raise QuantityError(
                field, f"a fraction must be at most 1 and bytes a whole number, got {text!r}"
            )
        if number > _MAX_BYTES:
            raise QuantityError(field, f"must be at most 1 PiB, got {text!r}")
        return Quantity(nbytes=int(text) if text.isdigit() else int(number), spec=text)
    match = _SIZE.match(text)
    if not match:
        raise QuantityError(field, f"expected {_EXPECTED}, got {text!r}")
    # Decimal: a float would round 4611686019G to a byte count nobody wrote.
    nbytes = int(Decimal(match.group(1)) * _UNITS[match.group(2) or ""])
    if not 0 < nbytes <= _MAX_BYTES:
        raise QuantityError(field, f"must be more than 0 bytes and at most 1 PiB, got {text!r}")
    return Quantity(nbytes=nbytes, spec=text)


def parse_kai_gpu_memory(value: object, field: str = "gpu-memory") -> Quantity:
    """KAI's ``gpu-memory`` annotation: a whole number of MiB."""
    text = str(value).strip()
    # isdigit() alone takes "٤" and "²" (which int() then refuses).
    if not (text.isascii() and text.isdigit()) or len(text) > _MAX_TEXT or int(text) <= 0:
        raise QuantityError(field, f"expected a whole number of MiB above 0, got {value!r}")
    # In our units it is bytes: "4096" MiB would read as 4096 bytes on the wire.
    return Quantity(nbytes=int(text) * MiB, spec=str(int(text) * MiB))


def check_share(request: Quantity, limit: Quantity, total: int) -> tuple[int, int]:
    """Resolve request and limit on a GPU of ``total`` bytes; enforce ``request <= limit <= total``."""
    req, lim = request.bytes_of(total), limit.bytes_of(total)
    if lim < req:
        raise QuantityError(
            "limit", f"must be at least the request ({format_bytes(req)}), got {format_bytes(lim)}"
        )
    if req > total:
        raise QuantityError(
            "request", f"{format_bytes(req)} is more than one GPU holds ({format_bytes(total)}), "
            f"so it could never be placed: ask for at most {format_bytes(total)}, or for a whole "
            "GPU (1)"
        )
    return req, min(lim, total)


def format_bytes(n: int) -> str:
    """Human-readable binary size: ``1.5 GiB``."""
    # Clamped: float() of an integer past 1e308 raises, and a view must not fail on one.
    value = float(max(-MAX_COUNT, min(n, MAX_COUNT)))
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"


def format_duration(seconds: float) -> str:
    """``45 s``, ``3 min 5 s``, ``2 h 4 min``: a span as people read it."""
    # nan and inf would make round() raise; no span here is longer than a few days.
    total = round(min(seconds, 1e12)) if seconds > 0 else 0
    if total < 60:
        return f"{total} s"
    minutes, secs = divmod(total, 60)
    if minutes < 60:
        return f"{minutes} min {secs} s" if secs else f"{minutes} min"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes} min" if minutes else f"{hours} h"
