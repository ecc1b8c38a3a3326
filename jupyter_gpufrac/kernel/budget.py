"""Checkpoint disk budgets: what one checkpoint may protect, and why the rest is not."""

from __future__ import annotations

import re
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from jupyter_gpufrac.checkpoint_disk import measure
from node_agent.quantities import QuantityError, format_bytes, parse_size

# The user's other kernels' checkpoints are measured (a walk of stat calls) at most this often.
OTHERS_CACHE_S = 30.0
_SHARE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*%\s*$", re.ASCII)
KERNEL_TRAIT = "c.GpuFrac.checkpoint_kernel_budget"
USER_TRAIT = "c.GpuFrac.checkpoint_user_budget"
STAGING_TRAIT = "c.GpuFrac.checkpoint_staging_budget"


def protect(sizes: Sequence[int], budget: int) -> list[int]:
    """Which units (indexes into ``sizes``, bytes each) one checkpoint protects under ``budget``.

    Smallest first (ties in namespace order), so that the most variables are protected: the
    protected ones fit, and every unit left out is larger than what is left of the budget.
    """
    if budget < 0:
        raise ValueError(f"budget: expected bytes >= 0, got {budget}")
    chosen: list[int] = []
    left = budget
    for index in sorted(range(len(sizes)), key=lambda i: (sizes[i], i)):
        if sizes[index] > left:
            break  # every later one is at least as large
        chosen.append(index)
        left -= sizes[index]
    return sorted(chosen)


def least_bytes(value: object) -> int:
    """Bytes a checkpoint of ``value`` takes at least, known without copying it: a tensor's
    storage, an array's buffer, a bytes object's length (0 for anything else)."""
    torch = sys.modules.get("torch")
    numpy = sys.modules.get("numpy")
    try:
        if torch is not None and isinstance(value, torch.Tensor):
            return int(value.untyped_storage().nbytes())
        if numpy is not None and isinstance(value, numpy.ndarray):
            return int(value.nbytes)
    except Exception:  # a sparse or meta tensor has no storage to size: pickling will tell
        return 0
    return len(value) if isinstance(value, bytes | bytearray) else 0


def staged_bytes(value: object) -> int:
    """Bytes a snapshot copies into memory for ``value`` when it changed: a tensor's storage
    (a GPU one into pinned memory) or an array's buffer. What a container holds is not counted
    here: its pickling tells."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        try:
            return int(value.untyped_storage().nbytes())
        except Exception:  # a sparse or meta tensor has no storage to size
            return 0
    numpy = sys.modules.get("numpy")
    if numpy is not None and isinstance(value, numpy.ndarray):
        return int(value.nbytes)
    return 0


def staging_room(staging_budget: int) -> Room:
    """The snapshot memory budget as a :class:`Room`, with the sentence that says why."""
    return Room(staging_budget,
                f"over the snapshot memory budget of {format_bytes(staging_budget)} (what a "
                f"checkpoint copies at a cell's end to write it in the background); raise "
                f"{STAGING_TRAIT} or delete variables you no longer need")


def parse_budget(value: object, field: str, of: str = "the free disk"
                 ) -> tuple[float | None, int | None]:
    """``(share, bytes)`` of a budget setting: ``"25%"`` of ``of``, or a size such as
    ``20GiB``, ``500M`` or bytes (``0`` protects nothing); QuantityError names ``field``."""
    text = str(value).strip()
    expected = f"a share of {of} like 25%, or a size like 20GiB, 500M or bytes"
    share = _SHARE.match(text)
    if share is not None:
        percent = float(share.group(1))
        if percent > 100:
            raise QuantityError(field, f"expected a share of at most 100%, got {value!r}")
        return percent / 100, None
    if text == "0":
        return None, 0
    try:
        return None, parse_size(text, field)
    except QuantityError:
        hint = " (a share needs a %)" if re.fullmatch(r"0?\.[0-9]+", text) else ""
        raise QuantityError(field, f"expected {expected}, got {value!r}{hint}") from None


@dataclass(frozen=True)
class Room:
    """What the next checkpoint may take on disk, and the sentence that says why not more."""

    bytes: int
    why: str


class DiskLimits:
    """A kernel's checkpoint budgets: its own, and its user's less what the user's other
    kernels' checkpoints take (measured at most every OTHERS_CACHE_S seconds)."""

    def __init__(self, folder: Path, kernel_budget: int | None, user_budget: int | None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.folder = Path(folder)
        self.kernel_budget = kernel_budget
        self.user_budget = user_budget
        self._clock = clock
        self._lock = threading.Lock()
        self._others: tuple[float, int] | None = None

    def others(self) -> int:
        """Bytes the user's other kernels' checkpoints take (cached)."""
        with self._lock:
            now = self._clock()
            if self._others is None or now - self._others[0] >= OTHERS_CACHE_S:
                usage = measure(self.folder.parent)
                taken = sum(f.bytes for f in usage.folders if f.name != self.folder.name)
                self._others = (now, taken)
            return self._others[1]

    def room(self) -> Room | None:
        """The tighter budget for the next checkpoint; None when neither is set."""
        rooms: list[Room] = []
        if self.kernel_budget is not None:
            rooms.append(Room(self.kernel_budget,
                              f"over the per-kernel checkpoint budget of "
                              f"{format_bytes(self.kernel_budget)}; raise {KERNEL_TRAIT} or "
                              f"delete variables you no longer need"))
        if self.user_budget is not None:
            others = self.others()
            rooms.append(Room(max(0, self.user_budget - others),
                              f"over the per-user checkpoint budget of "
                              f"{format_bytes(self.user_budget)}, of which your other kernels' "
                              f"checkpoints take {format_bytes(others)}; raise {USER_TRAIT} or "
                              f"shut down kernels you no longer need"))
        return min(rooms, key=lambda room: room.bytes) if rooms else None


def unprotected_line(unprotected: dict[str, int], why: str | None) -> str:
    """``not protected: big (4.0 GiB), ... — why``: the names the checkpoint left out."""
    shown = ", ".join(f"{name} ({format_bytes(size)})"
                      for name, size in sorted(unprotected.items(), key=lambda kv: -kv[1]))
    return f"not protected: {shown} — {why}" if why else f"not protected: {shown}"
