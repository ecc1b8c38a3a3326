"""A simulated node: GPUs from a spec, and device memory that real processes really hold."""

from __future__ import annotations

import os
import re
import threading
import time
import uuid as uuidlib
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import NamedTuple

from node_agent import procs
from node_agent.devices.base import (
    CHECKPOINTED,
    GONE,
    ILLEGAL_STATE,
    LOCKED,
    OS_ERROR,
    OUT_OF_MEMORY,
    RUNNING,
    FreezeError,
    GpuInfo,
    GpuLost,
    NotSupported,
    ProcessMemory,
    Sweep,
)
from node_agent.quantities import GiB, QuantityError, parse_size

MiB = 2**20

# Known boards, so that specs such as 4xH100-80GB read naturally: the name, the memory, what
# the driver reserves and what one process's CUDA context takes. The last two are typical
# figures for recent drivers and CUDA 12 (they vary with both); override them in the spec.
_MODELS = {
    "A100-40GB": ("NVIDIA A100-SXM4-40GB", 40 * GiB, 410 * MiB, 420 * MiB),
    "A100-80GB": ("NVIDIA A100-SXM4-80GB", 80 * GiB, 512 * MiB, 420 * MiB),
    "H100-80GB": ("NVIDIA H100 80GB HBM3", 80 * GiB, 528 * MiB, 500 * MiB),
    "H200-141GB": ("NVIDIA H200", 141 * GiB, 600 * MiB, 520 * MiB),
    "L4-24GB": ("NVIDIA L4", 24 * GiB, 300 * MiB, 300 * MiB),
    "T4-16GB": ("Tesla T4", 16 * GiB, 250 * MiB, 310 * MiB),
}
_SPEC = re.compile(r"^\s*(\d+)\s*[xX]\s*([^:\s]+)\s*((?::[^:]*)*)$")
FAULTS = ("lost", "not_supported")


class Board(NamedTuple):
    """One simulated GPU: its name, memory, driver-reserved memory and per-process context."""

    name: str
    total: int
    reserved: int = 0
    context: int = 0


def parse_spec(spec: str) -> list[Board]:
    """``2x16GiB``, ``4xH100-80GB`` or ``2x16GiB:reserved=512Mi:context=300Mi`` (several
    joined by ``,``) → one :class:`Board` per GPU."""
    boards: list[Board] = []
    for part in spec.split(","):
        match = _SPEC.match(part)
        if not match or int(match.group(1)) < 1:
            raise QuantityError(
                "simulate", "expected COUNTxSIZE or COUNTxMODEL such as 2x16GiB or 4xH100-80GB, "
                f"optionally with :reserved=SIZE:context=SIZE, got {part!r}"
            )
        count, what = int(match.group(1)), match.group(2)
        if what.upper() in _MODELS:
            name, total, reserved, context = _MODELS[what.upper()]
        else:
            name, total, reserved, context = f"GPU {what}", parse_size(what, "simulate"), 0, 0
        options = _options(match.group(3), part)
        reserved, context = options.get("reserved", reserved), options.get("context", context)
        if reserved + context >= total:
            raise QuantityError("simulate", f"reserved and context leave no memory on {part!r}")
        boards.extend(Board(f"{name} (simulated)", total, reserved, context) for _ in range(count))
    if len(boards) > 64:
        raise QuantityError("simulate", f"at most 64 GPUs, got {len(boards)}")
    return boards


def _options(text: str, part: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for option in filter(None, text.split(":")):
        key, _, value = option.partition("=")
        if key not in ("reserved", "context") or not value:
            raise QuantityError("simulate", f"expected :reserved=SIZE or :context=SIZE in {part!r}, "
                                f"got {option!r}")
        out[key] = parse_size(value, f"simulate {key}")
    return out


def simulated_uuid(index: int) -> str:
    return "GPU-" + str(uuidlib.UUID(int=(0x5EED << 112) | index))


@dataclass
class _Tracked:
    uuid: str
    start: int  # its start time: a pid that names another process is no longer it
    baseline: int
    context: int
    # As on a GPU, a process has a context (and is listed) from its first use of the device on.
    using: bool = False
    # CPU time (clock ticks) and when it was read, for the next utilization.
    cpu: tuple[int, float] | None = None


@dataclass
class _Gpu:
    info: GpuInfo
    fault: str | None = None


# Growth above the baseline that counts as a tracked process's first use of its GPU.
FIRST_USE = 2**20
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


class SimulatedBackend:
    """GPUs described by a spec; a tracked process uses its CUDA context (from its first use
    of the device on) plus what it holds above its baseline, and the driver keeps its reserved
    memory.

    The baseline is the process's resident memory when it was placed, so allocations a
    test makes in a real process (torch tensors, bytearrays) show up as device memory.
    Each call reads each tracked process once, from /proc/<pid>/stat.
    """

    name = "simulated"
    simulated = True

    def __init__(self, spec: str) -> None:
        self.spec = spec
        self._lock = threading.Lock()
        self._gpus: dict[str, _Gpu] = {}
        for index, board in enumerate(parse_spec(spec)):
            uuid = simulated_uuid(index)
            free = board.total - board.reserved
            self._gpus[uuid] = _Gpu(GpuInfo(uuid, index, board.name, board.total, 0, free,
                                            board.reserved, context_size=board.context))
        self._tracked: dict[int, _Tracked] = {}
        # Processes whose GPU was taken while they live on (parked or frozen), as they were
        # tracked: tracked again, they hold what they held, as a thawed process does.
        self._untracked: dict[int, _Tracked] = {}
        # Every process of the node as last listed: pid -> (start time, parent). Kept while
        # something is tracked, to find what tracked processes start.
        self._table: dict[int, tuple[int, int]] = {}
        # Something was tracked since the last look for children: it may have some already.
        self._rescan = False

    def gpus(self) -> list[GpuInfo]:
        with self._lock:
            held = self._held_locked()
            return [self._info_locked(uuid, held) for uuid in self._gpus]

    def processes(self, uuid: str) -> list[ProcessMemory]:
        with self._lock:
            gpu = self._gpus.get(uuid)
            if gpu is None:
                raise GpuLost(f"no GPU {uuid} on this simulated node")
            if gpu.fault == "lost":
                raise GpuLost(f"GPU {uuid} is lost (simulated fault)")
            if gpu.fault == "not_supported":
                raise NotSupported(f"GPU {uuid} does not report processes (simulated fault)")
            listed = self._listed_locked(uuid, self._held_locked())
            return [ProcessMemory(pid, used) for pid, used in listed.items()]

    def process_utilization(self, uuid: str) -> dict[int, int]:
        """A process's CPU use since the last call stands in for its SM utilization: busy
        processes look busy, as on a GPU."""
        with self._lock:
            gpu = self._gpus.get(uuid)
            if gpu is None or gpu.fault == "lost":
                raise GpuLost(f"no GPU {uuid} on this simulated node")
            if gpu.fault == "not_supported":
                raise NotSupported(f"GPU {uuid} does not sample processes (simulated fault)")
            return self._busy_locked(uuid, self._read_locked(), time.monotonic())

    def sweep(self) -> Sweep:
        with self._lock:
            readings = self._read_locked()
            held = self._held_locked(readings)
            now = time.monotonic()
            gpus: list[GpuInfo] = []
            processes: dict[str, dict[int, int | None]] = {}
            utilization: dict[str, dict[int, int]] = {}
            for uuid, gpu in self._gpus.items():
                gpus.append(self._info_locked(uuid, held))
                if gpu.fault is None:
                    processes[uuid] = self._listed_locked(uuid, held)
                    utilization[uuid] = self._busy_locked(uuid, readings, now)
            return Sweep(gpus, processes, utilization)

    def track(self, pid: int, uuid: str) -> None:
        with self._lock:
            if uuid not in self._gpus:
                raise GpuLost(f"no GPU {uuid} on this simulated node")
            st = procs.stat(pid)
            if st is None or st.state == "Z":
                return
            before = self._untracked.pop(pid, None)
            if before is not None and before.start == st.start_time:
                self._tracked[pid] = replace(before, uuid=uuid, cpu=None)
            else:
                self._tracked[pid] = _Tracked(uuid, st.start_time, st.rss,
                                              self._gpus[uuid].info.context_size)
            self._rescan = True

    def untrack(self, pid: int) -> None:
        # Its host memory (a parked kernel's variables) is no device memory from now on.
        with self._lock:
            gone = self._tracked.pop(pid, None)
            if gone is not None:
                self._untracked[pid] = gone

    def model(self, uuid: str) -> str | None:
        """The board's name of GPU ``uuid`` (None: no such GPU)."""
        gpu = self._gpus.get(uuid)
        return gpu.info.name if gpu is not None else None

    def close(self) -> None:
        with self._lock:
            self._tracked.clear()
            self._table.clear()

    # Scripted faults, for tests and demos.
    def set_fault(self, uuid: str, fault: str | None) -> None:
        if fault is not None and fault not in FAULTS:
            raise ValueError(f"fault: expected one of {FAULTS} or None, got {fault!r}")
        with self._lock:
            self._gpus[uuid].fault = fault

    # --- one pass over the tracked processes ----------------------------------------
    def _read_locked(self) -> dict[int, procs.Stat]:
        """Adopts new children, then reads each tracked process once; one that exited (or
        whose pid now names another process) is no longer tracked."""
        fresh = self._adopt_children()
        readings: dict[int, procs.Stat] = {}
        for pid, tracked in list(self._tracked.items()):
            st = fresh.get(pid) or procs.stat(pid)
            if st is None or st.state == "Z" or st.start_time != tracked.start:
                del self._tracked[pid]
            else:
                readings[pid] = st
        for pid, kept in list(self._untracked.items()):
            st = fresh.get(pid) or procs.stat(pid)
            if st is None or st.state == "Z" or st.start_time != kept.start:
                del self._untracked[pid]
        return readings

    def _held_locked(self, readings: dict[int, procs.Stat] | None = None) -> dict[int, int | None]:
        """Device memory of each tracked process: None until its first use of the device."""
        if readings is None:
            readings = self._read_locked()
        held: dict[int, int | None] = {}
        for pid, st in readings.items():
            tracked = self._tracked[pid]
            above = max(0, st.rss - tracked.baseline)
            # What an interpreter's resident memory drifts by is not a use of the device.
            tracked.using = tracked.using or above >= FIRST_USE
            held[pid] = tracked.context + above if tracked.using else None
        return held

    def _info_locked(self, uuid: str, held: dict[int, int | None]) -> GpuInfo:
        gpu = self._gpus[uuid]
        if gpu.fault == "lost":
            return _unhealthy(gpu.info, "GPU is lost (simulated fault)")
        # As NVML's v2 memory info: total = reserved + used + free.
        usable = gpu.info.memory_total - gpu.info.memory_reserved
        used = min(usable, sum(h or 0 for pid, h in held.items()
                               if self._tracked[pid].uuid == uuid))
        return GpuInfo(
            uuid, gpu.info.index, gpu.info.name, gpu.info.memory_total, used, usable - used,
            gpu.info.memory_reserved, utilization=None if gpu.fault == "not_supported" else 0,
            context_size=gpu.info.context_size,
        )

    def _listed_locked(self, uuid: str, held: dict[int, int | None]) -> dict[int, int | None]:
        return {pid: h for pid, h in sorted(held.items())
                if h is not None and self._tracked[pid].uuid == uuid}

    def _busy_locked(self, uuid: str, readings: dict[int, procs.Stat],
                     now: float) -> dict[int, int]:
        out: dict[int, int] = {}
        for pid, st in readings.items():
            tracked = self._tracked[pid]
            if tracked.uuid != uuid or not tracked.using:
                continue
            busy = 0.0
            if tracked.cpu is not None and now > tracked.cpu[1]:
                busy = (st.cpu_ticks - tracked.cpu[0]) / CLOCK_TICKS / (now - tracked.cpu[1])
            tracked.cpu = (st.cpu_ticks, now)
            out[pid] = min(100, round(busy * 100))
        return out

    def _adopt_children(self) -> dict[int, procs.Stat]:
        """Processes a tracked one started see its GPU too (they inherit CUDA_VISIBLE_DEVICES):
        from when they are first seen, they pay a context and what they hold, as on a GPU.

        One listing of /proc; only processes not in the last one are read (and returned, read
        once a sweep). A process is taken as started by a tracked one only through parents
        that started before it: a parent's pid reused since names a newer process.
        """
        if not self._tracked:
            self._table.clear()
            return {}
        listed = {int(name) for name in os.listdir("/proc") if name.isdigit()}
        for pid in self._table.keys() - listed:
            del self._table[pid]
        fresh: dict[int, procs.Stat] = {}
        for pid in listed - self._table.keys():
            st = procs.stat(pid)
            if st is not None:
                fresh[pid] = st
                self._table[pid] = (st.start_time, st.ppid)
        candidates = list(self._table) if self._rescan else list(fresh)
        self._rescan = False
        for pid in candidates:
            if pid in self._tracked:
                continue
            owner = self._tracked_ancestor(pid)
            if owner is None:
                continue
            st = fresh.get(pid) or procs.stat(pid)
            if st is not None and st.state != "Z" and st.start_time == self._table[pid][0]:
                self._tracked[pid] = _Tracked(owner.uuid, st.start_time, st.rss, owner.context)
        return fresh

    def _tracked_ancestor(self, pid: int) -> _Tracked | None:
        start, parent = self._table[pid]
        for _ in range(64):
            if parent <= 1 or parent not in self._table:
                return None
            parent_start, grandparent = self._table[parent]
            if parent_start > start:
                return None
            tracked = self._tracked.get(parent)
            if tracked is not None and tracked.start == parent_start:
                return tracked
            start, parent = parent_start, grandparent
        return None


class SimulatedFreezer:
    """Freezing on a simulated node: the process's device memory leaves its GPU (the agent
    untracks it, and tracks it again on the thaw, holding what it held) and the process runs on.

    Each pid goes through the driver's states and refuses a call out of order as the driver
    does. A real frozen process also runs on; only its next CUDA call waits, and a simulated
    kernel makes none, so a cell that was running goes on, while the next one waits for the
    thaw (the kernel asks for its GPU back before it runs, as a parked one does). Faults are
    scripted with :meth:`fail`.
    """

    name = "simulated"
    needs_proof = False

    def __init__(self, backend: SimulatedBackend) -> None:
        self.backend = backend
        self._lock = threading.Lock()
        self._states: dict[int, str] = {}
        self._wedged: set[int] = set()
        # (call, pid or None for any) -> (message, kind, times left; -1: always)
        self._faults: dict[tuple[str, int | None], tuple[str, str, int]] = {}
        self.calls: list[tuple[str, int, dict[str, str] | None]] = []

    def fail(self, call: str, message: str, *, pid: int | None = None, kind: str = "other",
             times: int = 1) -> None:
        """Make the next ``times`` (-1: every) ``call`` (lock, checkpoint, restore, unlock) of
        ``pid`` (None: of any process) fail with ``message``; a restore that fails
        OUT_OF_MEMORY leaves the process checkpointed for good, as the driver does."""
        if call not in STEPS:
            raise ValueError(f"call: expected one of {STEPS}, got {call!r}")
        with self._lock:
            self._faults[(call, pid)] = (message, kind, times)

    def unavailable(self) -> str | None:
        return None

    def can_remap(self) -> bool:
        return True

    def state(self, pid: int) -> str:
        with self._lock:
            if procs.stat(pid) is None:
                self._states.pop(pid, None)
                raise FreezeError(f"process {pid} has exited", kind=GONE)
            return self._states.get(pid, RUNNING)

    def lock(self, pid: int, *, timeout: float) -> None:
        self._act("lock", pid, RUNNING, LOCKED)

    def checkpoint(self, pid: int) -> None:
        self._act("checkpoint", pid, LOCKED, CHECKPOINTED)

    def restore(self, pid: int, pairs: Mapping[str, str] | None = None) -> None:
        for old, new in (pairs or {}).items():
            if self.backend.model(old) != self.backend.model(new):
                raise FreezeError(f"cannot thaw onto {new}: another model than {old}")
        self._act("restore", pid, CHECKPOINTED, LOCKED, dict(pairs) if pairs else None)

    def unlock(self, pid: int) -> None:
        self._act("unlock", pid, LOCKED, RUNNING)

    def _act(self, call: str, pid: int, before: str, after: str,
             pairs: dict[str, str] | None = None) -> None:
        with self._lock:
            self.calls.append((call, pid, pairs))
            st = procs.stat(pid)
            if st is None or st.state == "Z":
                self._states.pop(pid, None)
                raise FreezeError(f"process {pid} has exited", kind=GONE)
            if call == "restore" and pid in self._wedged:
                raise FreezeError(f"process {pid} cannot be restored after a restore that ran "
                                  "out of memory", kind=OS_ERROR)
            for key in ((call, pid), (call, None)):
                fault = self._faults.get(key)
                if fault is None:
                    continue
                message, kind, times = fault
                if times > 0:
                    times -= 1
                if times == 0:
                    del self._faults[key]
                else:
                    self._faults[key] = (message, kind, times)
                if call == "restore" and kind == OUT_OF_MEMORY:
                    self._wedged.add(pid)
                raise FreezeError(message, kind=kind)
            if self._states.get(pid, RUNNING) != before:
                raise FreezeError(f"process {pid} is {self._states.get(pid, RUNNING)}, "
                                  f"not {before}", kind=ILLEGAL_STATE)
            self._states[pid] = after


# The driver's calls a simulated fault can stand in for.
STEPS = ("lock", "checkpoint", "restore", "unlock")


def _unhealthy(info: GpuInfo, error: str) -> GpuInfo:
    return GpuInfo(
        info.uuid, info.index, info.name, info.memory_total, 0, 0,
        healthy=False, error=error,
    )
