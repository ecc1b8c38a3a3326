"""The GpuBackend protocol: GPUs by UUID, their memory and processes, and the backend errors."""

from __future__ import annotations

from collections.abc import Mapping
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


class FreezeError(DeviceError):
    """The driver did not freeze or thaw a process. ``retry``: trying again may work (a lock
    that timed out behind a long kernel); otherwise fall back to a checkpoint and restart."""

    def __init__(self, message: str, *, retry: bool = False) -> None:
        super().__init__(message)
        self.retry = retry


# A process's state as the driver's checkpoint API reports it (cuCheckpointProcessGetState).
RUNNING, LOCKED, CHECKPOINTED, FAILED = "running", "locked", "checkpointed", "failed"


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
class Freezer(Protocol):
    """Freezes a live process: its GPU memory and CUDA context go to its own host memory and
    the GPU is given back while its CPU threads run on; a thaw brings them back. Calls block
    for seconds (the driver copies the memory): the agent runs them off its event loop."""

    name: str

    def unavailable(self) -> str | None:
        """Why no process can be frozen on this node (None: they can): said in words a person
        reads, e.g. "the driver (535.104) predates the checkpoint API of r570"."""
        ...

    def can_remap(self) -> bool:
        """Whether a thaw can land on another GPU of the same model (driver r580 and newer)."""
        ...

    def state(self, pid: int) -> str:
        """RUNNING, LOCKED, CHECKPOINTED or FAILED. Raises FreezeError."""
        ...

    def freeze(self, pid: int, *, lock_timeout: float) -> None:
        """Lock ``pid`` (waiting at most ``lock_timeout`` seconds for its submitted work), then
        checkpoint it. On failure the process is left running (unlocked) where the driver
        allows, and FreezeError says why (``retry`` for a lock timeout)."""
        ...

    def thaw(self, pid: int, remap: Mapping[str, str] | None = None) -> None:
        """Restore ``pid`` (onto other GPUs: ``remap`` old UUID -> new UUID, covering every GPU
        it used) and unlock it; one left locked (a freeze cut short) is only unlocked. Raises
        FreezeError."""
        ...


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
