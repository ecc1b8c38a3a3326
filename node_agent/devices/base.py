"""The GpuBackend protocol: GPUs by UUID, their memory and processes, and the backend errors."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Protocol, runtime_checkable


class DeviceError(Exception):
    """A backend could not answer; the message says what to do."""


class BackendUnavailable(DeviceError):
    """The backend cannot start at all (no driver, no library)."""


class NotSupported(DeviceError):
    """The device does not offer this query (e.g. utilization on some boards)."""


class GpuLost(DeviceError):
    """The device fell off the bus or stopped answering: treat it as unhealthy."""


class NoPermission(DeviceError):
    """The agent lacks the privilege for the query."""


@dataclass(frozen=True)
class GpuInfo:
    """One GPU as the backend sees it now; memory in bytes."""

    uuid: str
    index: int
    name: str
    memory_total: int
    memory_used: int
    memory_free: int
    memory_reserved: int = 0  # kept by the driver: total = reserved + used + free
    utilization: int | None = None
    healthy: bool = True
    error: str | None = None
    # What one process's CUDA context takes here (0: unknown; the agent then estimates it).
    context_size: int = 0

    @property
    def memory_usable(self) -> int:
        """What processes can ever hold: the total less the driver's reserve."""
        return self.memory_total - self.memory_reserved

    def to_json(self) -> dict[str, Any]:
        # Not dataclasses.asdict: its deep copies cost the node view a tenth of its time.
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True)
class ProcessMemory:
    """Device memory one process holds on one GPU; ``None`` when the driver will not say."""

    pid: int
    used: int | None


@dataclass(frozen=True)
class Sweep:
    """What one poll needs of the node, read in one pass."""

    gpus: list[GpuInfo]
    # uuid -> pid -> bytes (None: the driver would not say); uuid absent: no process list.
    processes: dict[str, dict[int, int | None]]
    # uuid -> pid -> SM utilization in percent; uuid absent: the driver does not sample.
    utilization: dict[str, dict[int, int]]


@runtime_checkable
class GpuBackend(Protocol):
    """What the agent needs to know about the node's GPUs.

    Calls may block (NVML does): the agent runs them off its event loop.
    """

    name: str
    simulated: bool

    def gpus(self) -> list[GpuInfo]:
        """Every GPU of the node, ordered by index. An unhealthy one is listed with ``healthy=False``."""
        ...

    def processes(self, uuid: str) -> list[ProcessMemory]:
        """Processes with device memory on the GPU ``uuid``. Raises GpuLost, NotSupported."""
        ...

    def process_utilization(self, uuid: str) -> dict[int, int]:
        """SM utilization (0-100) of each process sampled on ``uuid`` since the last call;
        processes not sampled are absent. Raises NotSupported where the driver does not say."""
        ...

    def sweep(self) -> Sweep:
        """The GPUs, and the processes and utilization of each healthy one that reports them:
        every figure of one poll, each read once. Never raises for one GPU's trouble."""
        ...

    def track(self, pid: int, uuid: str) -> None:
        """The agent placed ``pid`` on ``uuid``. Real drivers know this already and ignore it."""
        ...

    def untrack(self, pid: int) -> None:
        """``pid`` no longer has a GPU (its lease is parked). Real drivers ignore it too."""
        ...

    def close(self) -> None:
        """Release the backend's resources."""
        ...
