"""The GpuBackend protocol: GPUs by UUID, their memory and processes, and the backend errors."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
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
    """The driver did not do what was asked of a process. ``kind`` says what the agent can make
    of it: TIMEOUT (a lock behind long GPU work: trying again may work), NO_CUDA (the process
    never initialised CUDA: nothing of it is on a GPU), GONE (it ended), OUT_OF_MEMORY (a
    restore without room), NOT_PERMITTED, NOT_SUPPORTED, ILLEGAL_STATE, OS_ERROR (304: after a
    restore out of memory, the process is wedged), or OTHER."""

    def __init__(self, message: str, *, kind: str = "other") -> None:  # OTHER
        super().__init__(message)
        self.kind = kind

    @property
    def retry(self) -> bool:
        """Trying again may work: a lock that timed out behind a long kernel."""
        return self.kind == TIMEOUT


TIMEOUT, NO_CUDA, GONE, OUT_OF_MEMORY = "timeout", "no_cuda", "gone", "out_of_memory"
NOT_PERMITTED, NOT_SUPPORTED, ILLEGAL_STATE, OS_ERROR, OTHER = (
    "not_permitted", "not_supported", "illegal_state", "os_error", "other")


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
    """The driver's checkpoint calls on a live process, one step each: RUNNING -> lock ->
    LOCKED -> checkpoint (its GPU memory and context go to its own host memory and the GPU is
    given back; its CPU threads run on, its CUDA calls wait) -> CHECKPOINTED -> restore ->
    LOCKED -> unlock -> RUNNING. Each call blocks (a copy takes seconds per GiB; a call can
    hang): the agent runs them off its event loop, each with a deadline, and reads the state
    after any failure rather than guessing it."""

    name: str
    # Whether the agent must first see it freeze and thaw a process of its own (a real driver).
    needs_proof: bool

    def unavailable(self) -> str | None:
        """Why no process can be frozen on this node (None: they can): said in words a person
        reads, e.g. "the driver (535.104) predates the checkpoint API of r570"."""
        ...

    def can_remap(self) -> bool:
        """Whether a thaw can land on another GPU of the same model (driver r580 and newer)."""
        ...

    def state(self, pid: int) -> str:
        """RUNNING, LOCKED, CHECKPOINTED or FAILED. Raises FreezeError (NO_CUDA for a process
        that never initialised CUDA)."""
        ...

    def lock(self, pid: int, *, timeout: float) -> None:
        """Block the process's CUDA calls once its submitted work is done, waiting at most
        ``timeout`` seconds for that work (FreezeError TIMEOUT: it runs on)."""
        ...

    def checkpoint(self, pid: int) -> None:
        """Copy a LOCKED process's GPU memory into its host memory and release its GPUs."""
        ...

    def restore(self, pid: int, pairs: Mapping[str, str] | None = None) -> None:
        """Bring a CHECKPOINTED process's GPU memory back (onto other GPUs: ``pairs``, old UUID
        -> new UUID, a permutation of every GPU of the node); it is LOCKED after."""
        ...

    def unlock(self, pid: int) -> None:
        """Let a LOCKED process's CUDA calls run again."""
        ...


def full_permutation(moves: Mapping[str, str], gpus: Sequence[str]) -> dict[str, str]:
    """The GPU pairs of a remapped restore: the driver wants every GPU it sees named once as old
    and once as new (cuda-checkpoint#35), so the GPUs no move names are paired among
    themselves, each with itself where it can. ``moves``: old UUID -> new UUID."""
    if len(set(moves.values())) != len(moves) or not set(moves) | set(moves.values()) <= set(gpus):
        raise ValueError(f"not a remap of this node's GPUs: {dict(moves)}")
    pairs = dict(moves)
    left_old = [g for g in gpus if g not in pairs]
    left_new = [g for g in gpus if g not in pairs.values()]
    for old in [g for g in left_old if g in left_new]:
        pairs[old] = old
    for old, new in zip([g for g in left_old if g not in pairs],
                        [g for g in left_new if g not in pairs.values()], strict=True):
        pairs[old] = new
    return pairs


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
