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
_EXPECTED = ("a share of one GPU: a fraction 0 < f <= 1 or a percentage like 50%; or a memory "
             "size with its unit, like 2500M, 4G or 4Gi")
_PERCENT = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*%\s*$", re.ASCII)
# A byte count as earlier versions stored it (a bare integer above 1): what `stored_spec` reads.
_BARE_BYTES = re.compile(r"^[0-9]+$", re.ASCII)


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

    def meaning(self, total: int | None = None) -> str:
        """What was understood, for a sentence: ``0.25 of a GPU (4.0 GiB)``, ``2.3 GiB``."""
        if self.nbytes is not None:
            return format_bytes(self.nbytes)
        assert self.fraction is not None
        share = "a whole GPU" if self.fraction == 1 else f"{self.fraction:g} of a GPU"
        return f"{share} ({format_bytes(self.bytes_of(total))})" if total else share

    def __str__(self) -> str:
        if self.fraction is not None:
            return f"{self.fraction:g}"
        return format_bytes(self.nbytes or 0)


def _text(value: object, field: str) -> str:
    """The quantity as text, checked for what no spec (KAI's, Kubernetes') writes."""
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
    # float() takes "1_000" and "٤": what is stored must read back as the same quantity
    # anywhere.
    if not text.isascii() or "_" in text:
        raise QuantityError(field, f"expected ASCII digits only (no underscores or other "
                                   f"scripts' digits): {_EXPECTED}, got {text!r}")
    return text


def _number(text: str) -> float:
    """A plain decimal number, or nan (float() would also take "nan", "inf", "infinity")."""
    try:
        return float(text) if set(text) <= _NUMBER_CHARS else math.nan
    except ValueError:
        return math.nan


def _size(text: str, field: str) -> int | None:
    """Bytes of a size with a unit (``2500M``, ``4Gi``, ``512MiB``, ``100B``), or None."""
    match = _SIZE.match(text)
    if not match or not (match.group(2) or text.rstrip().endswith("B")):
        return None
    # Decimal: a float would round 4611686019G to a byte count nobody wrote.
    nbytes = int(Decimal(match.group(1)) * _UNITS[match.group(2) or ""])
    if not 0 < nbytes <= _MAX_BYTES:
        raise QuantityError(field, f"must be more than 0 bytes and at most 1 PiB, got {text!r}")
    return nbytes


def parse_quantity(value: object, field: str, *, several: str | None = None) -> Quantity:
    """A share of one GPU as people type it: ``0.25``, ``1``, ``50%``, ``2500M``, ``4Gi``.

    A bare number is a fraction of one GPU: one above 1 is never read as bytes (nor as GPUs)
    but answered with the question it raises (``2 GiB or 2 GPUs?``); ``several`` says how
    this surface asks for several GPUs (``--gpus 2``), where it can. A byte count is written
    with its unit (``4294967296B``).
    """
    text = _text(value, field)
    percent = _PERCENT.match(text)
    if percent:
        share = float(percent.group(1))
        if not 0 < share <= 100:
            more = (f"; for several GPUs use {several.format(n=math.ceil(share / 100))}"
                    if several and share > 100 else "")
            raise QuantityError(field, f"expected a share of one GPU above 0% and at most 100% "
                                       f"(a whole GPU), got {text!r}{more}")
        return Quantity(fraction=share / 100, spec=text)
    number = _number(text)
    if not math.isnan(number):
        if math.isinf(number) or number <= 0:
            raise QuantityError(field, f"expected {_EXPECTED}, got {text!r}")
        if number <= 1:
            return Quantity(fraction=number, spec=text)
        n = f"{number:g}"
        gpus = (f" For {n} GPUs use {several.format(n=n)}." if several
                else " A share here is of one GPU.")
        raise QuantityError(
            field, f"{n} GiB or {n} GPUs? A bare number is a share of one GPU, from 0 to 1 "
            f"(1 is the whole GPU, 0.5 or 50% half of it); a memory size needs its unit: "
            f"{n}Gi for {n} GiB, or {n}G for {n} GB.{gpus}")
    nbytes = _size(text, field)
    if nbytes is None:
        raise QuantityError(field, f"expected {_EXPECTED}, got {text!r}")
    return Quantity(nbytes=nbytes, spec=text)


def parse_size(value: object, field: str) -> int:
    """A memory size, not a share of a GPU: ``500Mi``, ``20GiB``, ``2500M``, or bytes (a bare
    whole number is bytes here: nothing else could be meant)."""
    text = _text(value, field)
    if _BARE_BYTES.match(text):
        nbytes = int(text)
        if not 0 < nbytes <= _MAX_BYTES:
            raise QuantityError(field, f"must be more than 0 bytes and at most 1 PiB, got "
                                       f"{text!r}")
        return nbytes
    size = _size(text, field)
    if size is None:
        raise QuantityError(field, f"expected a memory size such as 500Mi, 20GiB, 2500M or "
                                   f"bytes, got {text!r}")
    return size


def stored_spec(spec: str) -> str:
    """A spec as this version reads it: earlier versions stored byte counts bare
    (``4294967296``), which now read as a question; they mean bytes (``4294967296B``)."""
    text = spec.strip()
    return f"{text}B" if _BARE_BYTES.match(text) and int(text) > 1 else spec


def parse_kai_gpu_memory(value: object, field: str = "gpu-memory") -> Quantity:
    """KAI's ``gpu-memory`` annotation: a whole number of MiB."""
    text = str(value).strip()
    # isdigit() alone takes "٤" and "²" (which int() then refuses).
    if not (text.isascii() and text.isdigit()) or len(text) > _MAX_TEXT or int(text) <= 0:
        raise QuantityError(field, f"expected a whole number of MiB above 0, got {value!r}")
    # In our units it is bytes: "4096" MiB would read as 4096 bytes on the wire.
    return Quantity(nbytes=int(text) * MiB, spec=f"{int(text)}Mi")


def check_share(request: Quantity, limit: Quantity, total: int) -> tuple[int, int]:
    """Resolve request and limit on a GPU of ``total`` bytes; enforce ``request <= limit <= total``.
    A refusal says what each was understood as."""
    req, lim = request.bytes_of(total), limit.bytes_of(total)
    if lim < req:
        raise QuantityError(
            "limit", f"{_said(limit, total)} is below the request, {_said(request, total)}: "
            "a limit is at least the request")
    if req > total:
        raise QuantityError(
            "request", f"{_said(request, total)} is more than one GPU holds "
            f"({format_bytes(total)}), so it could never be placed: ask for at most "
            f"{format_bytes(total)}, or for a whole GPU (1)")
    return req, min(lim, total)


def _said(quantity: Quantity, total: int) -> str:
    """``0.2 (3.2 GiB here)``, ``32Gi (32.0 GiB)``: as written, then as understood."""
    meant = format_bytes(quantity.bytes_of(total))
    if not quantity.spec:
        return meant
    return f"{quantity.spec} ({meant} here)" if quantity.fraction is not None else (
        f"{quantity.spec} ({meant})")


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
    """``45 s``, ``3 min 5 s``, ``2 h 4 min``; ``under 1 s`` (never "0 s" for what took
    time): a span as people read it."""
    if 0 < seconds < 1:
        return "under 1 s"
    # nan and inf would make round() raise; no span here is longer than a few days.
    total = round(min(seconds, 1e12)) if seconds > 0 else 0
    if total < 60:
        return f"{total} s"
    minutes, secs = divmod(total, 60)
    if minutes < 60:
        return f"{minutes} min {secs} s" if secs else f"{minutes} min"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes} min" if minutes else f"{hours} h"
