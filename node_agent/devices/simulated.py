"""A simulated node: GPUs from a spec, and device memory that real processes really hold."""

from __future__ import annotations

import re
import threading
import uuid as uuidlib
from dataclasses import dataclass
from typing import NamedTuple

import psutil

from node_agent.devices.base import GpuInfo, GpuLost, NotSupported, ProcessMemory
from node_agent.quantities import GiB, QuantityError, parse_quantity

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
            size = parse_quantity(what, "simulate")
            if size.nbytes is None:
                raise QuantityError("simulate", f"the size of a simulated GPU must be memory, got {what!r}")
            name, total, reserved, context = f"GPU {what}", size.nbytes, 0, 0
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
        size = parse_quantity(value, "simulate")
        if size.nbytes is None:
            raise QuantityError("simulate", f"{key} must be a memory size such as 512Mi, got {value!r}")
        out[key] = size.nbytes
    return out


def simulated_uuid(index: int) -> str:
    return "GPU-" + str(uuidlib.UUID(int=(0x5EED << 112) | index))


@dataclass
class _Tracked:
    uuid: str
    baseline: int
    process: psutil.Process
    context: int
    # As on a GPU, a process has a context (and is listed) from its first use of the device on.
    using: bool = False


@dataclass
class _Gpu:
    info: GpuInfo
    fault: str | None = None


# Growth above the baseline that counts as a tracked process's first use of its GPU.
FIRST_USE = 2**20


class SimulatedBackend:
    """GPUs described by a spec; a tracked process uses its CUDA context (from its first use
    of the device on) plus what it holds above its baseline, and the driver keeps its reserved
    memory.

    The baseline is the process's resident memory when it was placed, so allocations a
    test makes in a real process (torch tensors, bytearrays) show up as device memory.
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

    def gpus(self) -> list[GpuInfo]:
        with self._lock:
            out = []
            for uuid, gpu in self._gpus.items():
                if gpu.fault == "lost":
                    out.append(_unhealthy(gpu.info, "GPU is lost (simulated fault)"))
                    continue
                # As NVML's v2 memory info: total = reserved + used + free.
                usable = gpu.info.memory_total - gpu.info.memory_reserved
                used = min(usable, self._used_locked(uuid))
                out.append(
                    GpuInfo(
                        uuid, gpu.info.index, gpu.info.name, gpu.info.memory_total,
                        used, usable - used, gpu.info.memory_reserved,
                        utilization=None if gpu.fault == "not_supported" else 0,
                        context_size=gpu.info.context_size,
                    )
                )
            return out

    def processes(self, uuid: str) -> list[ProcessMemory]:
        with self._lock:
            gpu = self._gpus.get(uuid)
            if gpu is None:
                raise GpuLost(f"no GPU {uuid} on this simulated node")
            if gpu.fault == "lost":
                raise GpuLost(f"GPU {uuid} is lost (simulated fault)")
            if gpu.fault == "not_supported":
                raise NotSupported(f"GPU {uuid} does not report processes (simulated fault)")
            self._adopt_children(uuid)
            listed = []
            for pid, tracked in sorted(self._tracked.items()):
                held = self._held(pid) if tracked.uuid == uuid else None
                if held is not None:
                    listed.append(ProcessMemory(pid, held))
            return listed

    def process_utilization(self, uuid: str) -> dict[int, int]:
        """A process's CPU use since the last call stands in for its SM utilization: busy
        processes look busy, as on a GPU."""
        with self._lock:
            gpu = self._gpus.get(uuid)
            if gpu is None or gpu.fault == "lost":
                raise GpuLost(f"no GPU {uuid} on this simulated node")
            if gpu.fault == "not_supported":
                raise NotSupported(f"GPU {uuid} does not sample processes (simulated fault)")
            out = {}
            for pid, tracked in list(self._tracked.items()):
                if tracked.uuid != uuid or not tracked.using:
                    continue
                try:
                    out[pid] = min(100, round(tracked.process.cpu_percent(None)))
                except psutil.Error:
                    continue
            return out

    def track(self, pid: int, uuid: str) -> None:
        with self._lock:
            if uuid not in self._gpus:
                raise GpuLost(f"no GPU {uuid} on this simulated node")
            try:
                process = psutil.Process(pid)
                baseline = process.memory_info().rss
            except psutil.Error:
                return
            self._tracked[pid] = _Tracked(uuid, baseline, process,
                                          self._gpus[uuid].info.context_size)

    def _adopt_children(self, uuid: str) -> None:
        """Processes a tracked one started see its GPU too (they inherit CUDA_VISIBLE_DEVICES):
        from when they are first seen, they pay a context and what they hold, as on a GPU."""
        for tracked in list(self._tracked.values()):
            if tracked.uuid != uuid:
                continue
            try:
                children = tracked.process.children(recursive=True)
            except psutil.Error:
                continue
            for child in children:
                if child.pid in self._tracked:
                    continue
                try:
                    baseline = child.memory_info().rss
                except psutil.Error:
                    continue
                self._tracked[child.pid] = _Tracked(uuid, baseline, child,
                                                    self._gpus[uuid].info.context_size)

    def close(self) -> None:
        with self._lock:
            self._tracked.clear()

    # Scripted faults, for tests and demos.
    def set_fault(self, uuid: str, fault: str | None) -> None:
        if fault is not None and fault not in FAULTS:
            raise ValueError(f"fault: expected one of {FAULTS} or None, got {fault!r}")
        with self._lock:
            self._gpus[uuid].fault = fault

    def _held(self, pid: int) -> int | None:
        tracked = self._tracked.get(pid)
        if tracked is None:
            return None
        try:
            if not tracked.process.is_running():
                raise psutil.NoSuchProcess(pid)
            held = max(0, tracked.process.memory_info().rss - tracked.baseline)
        except psutil.Error:
            del self._tracked[pid]
            return None
        # What an interpreter's resident memory drifts by is not a use of the device.
        tracked.using = tracked.using or held >= FIRST_USE
        return tracked.context + held if tracked.using else None

    def _used_locked(self, uuid: str) -> int:
        return sum(
            self._held(pid) or 0 for pid, t in list(self._tracked.items()) if t.uuid == uuid
        )


def _unhealthy(info: GpuInfo, error: str) -> GpuInfo:
    return GpuInfo(
        info.uuid, info.index, info.name, info.memory_total, 0, 0,
        healthy=False, error=error,
    )
