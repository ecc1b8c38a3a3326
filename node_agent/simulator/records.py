"""The simulation's records: leases and their states, nodes, and sessions' and jobs' runs."""

from __future__ import annotations

from dataclasses import dataclass, field

from node_agent.policy import Device, Placement
from node_agent.simulator.shares import Share
from node_agent.simulator.traces import Cell, JobSpec, Session

# Lease states.
PENDING = "pending"  # placed, waits until its GPUs hold it (plan_activation)
ACTIVE = "active"
LEAVING = "leaving"  # compaction asked it to move; its cell may finish, then it is checkpointed
IN_FLIGHT = "in-flight"  # checkpointed and restarting elsewhere; counted where it was until done
RESTARTING = "restarting"  # on its GPU, restoring its state (after a re-attach or a reclaim kill)
FREEZING = "freezing"  # the driver copies its GPU memory to host memory; a running cell waits
FROZEN = "frozen"  # on its GPU holding nothing, owed its request: it thaws when its memory fits
THAWING = "thawing"  # its memory is being copied back; its cell waits until done

# A frozen lease holds no memory (usage 0) but is counted with the others: it is owed its request.
_HOLDS_MEMORY = (ACTIVE, LEAVING, IN_FLIGHT, RESTARTING, FREEZING, FROZEN, THAWING)
FROZEN_STATES = (FREEZING, FROZEN, THAWING)


@dataclass(eq=False)
class Lease:
    """A workload's claim on one node's GPUs."""

    id: str
    kind: str
    share: Share
    node: Node
    logical: tuple[str, ...]
    physical: tuple[str, ...]
    created: float
    owner: SessionRun | JobRun
    state: str = PENDING
    usage: int = 0
    move_to: tuple[str, ...] | None = None
    # Usage to come back to once it lands (a move or a re-attach restores what it held).
    restore_to: int = 0
    reattach: bool = False
    shrinking: bool = False
    deadline: float | None = None
    restore_until: float = float("-inf")
    token: int = 0
    # Bytes per GPU frozen in host memory; nonzero while the process waits to thaw.
    frozen_bytes: int = 0
    parking: bool = False  # freezing to park: the lease goes once the memory is off the GPU

    def planned(self) -> Placement:
        """As the planner sees it: a lease on its way somewhere is already there."""
        physical = self.move_to if self.move_to is not None else self.physical
        return Placement(self.id, self.kind, self.share.request, self.logical, physical, self.usage,
                         self.created, self.share.limit)

    def running(self) -> Placement:
        """Where it is now: a lease that left is pending at its destination."""
        return Placement(self.id, self.kind, self.share.request, self.logical, self.physical, self.usage,
                         self.created, self.share.limit)


@dataclass(eq=False)
class Node:
    index: int
    devices: list[Device]
    leases: dict[str, Lease] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.by_uuid = {d.uuid: d for d in self.devices}
        self.capacity = sum(d.total for d in self.devices)
        # Bumped whenever a lease comes, goes or changes GPUs: what the planner sees changed.
        self.version = 0
        self._share: tuple[int, float] = (-1, 0.0)

    def changed(self) -> None:
        self.version += 1

    def planned(self) -> list[Placement]:
        return [lease.planned() for lease in self.leases.values()]

    def running(self) -> list[Placement]:
        """Every lease where it runs or waits to run, for plan_activation."""
        return [lease.running() for lease in self.leases.values()]

    def holding(self) -> list[Placement]:
        """Leases whose processes hold device memory now."""
        return [lease.running() for lease in self.leases.values() if lease.state in _HOLDS_MEMORY]

    def logical_share(self) -> float:
        """Share of the node's memory its leases request (what a cluster scheduler sees)."""
        if self._share[0] != self.version:
            requested = sum(lease.share.request * lease.share.devices for lease in self.leases.values())
            self._share = (self.version, requested / self.capacity)
        return self._share[1]


@dataclass(eq=False)
class SessionRun:
    session: Session
    share: Share | None
    lease: Lease | None = None
    queued: bool = False
    next_cell: int = 0
    # When the waiting cell was due: its start in the trace, or the end of the cell before it if
    # that ran late (a user runs cells in order); its delay is counted from then.
    due: float | None = None
    cell: Cell | None = None  # the cell running now
    cell_end: float = 0.0
    finished_cells: int = 0
    stopping: bool = False
    done: bool = False
    waited: bool = False
    # What a parked kernel held: it comes back with it at its next cell (None: not parked).
    parked_usage: int | None = None
    token: int = 0
    # The running cell's work left (seconds at full speed), its speed and since when it holds.
    left: float = 0.0
    speed: float = 0.0
    since: float = 0.0
    run_token: int = 0
    paused_at: float | None = None  # a GPU cell waiting inside a CUDA call while its kernel is frozen
    # Frozen in host memory (bytes, all GPUs) and, parked so, the node its process lives on.
    frozen_host: int = 0
    parked_frozen: bool = False
    home: Node | None = None
    thaw_wait_from: float | None = None  # a due cell waiting for its kernel to thaw
    thaw_wait: float = 0.0  # what the current (or next) cell waited for thaws


@dataclass(eq=False)
class JobRun:
    spec: JobSpec
    share: Share
    lease: Lease | None = None
    started: float | None = None
    queued: bool = False
    ended: bool = False
    left: float = 0.0
    speed: float = 0.0
    since: float = 0.0
    run_token: int = 0
    paused_at: float | None = None  # never set: jobs are not frozen
