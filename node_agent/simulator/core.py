"""What the engine's handlers share: the durations it charges, its state, its clock and queue of events."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from node_agent.policy import Device, Rules
from node_agent.service import AgentConfig
from node_agent.simulator.metrics import Result
from node_agent.simulator.node_spec import NodeSpec
from node_agent.simulator.policies import Policy
from node_agent.simulator.records import JobRun, Lease, Node, SessionRun
from node_agent.simulator.shares import Share, job_share, notebook_share
from node_agent.simulator.traces import GB, JobSpec, Session

if TYPE_CHECKING:
    from node_agent.simulator.engine import Engine

_AGENT = AgentConfig()
# Measured on an H100 (NOTES.md, "The driver's own checkpoint"): 8 GiB frozen in 7.2 s, thawed in 2.1 s.
FREEZE_SECONDS_PER_GIB = 7.2 / 8
THAW_SECONDS_PER_GIB = 2.1 / 8


@dataclass(frozen=True)
class Timing:
    """Durations the simulation charges, in seconds.

    ``move``: a planned move of an idle kernel, directive to restored state (bench/migration_bench.py
    on the 2-core development box: 4.3 s). ``reattach``: a parked kernel's next cell getting a GPU
    back; charged as a move (bench/park_bench.py measures 0.03 s on the simulated node, without
    CUDA's initialisation and the copy back to the GPU, which only a GPU can time).
    ``migrate_grace``: how long a running cell may finish before a move cuts it off
    (``c.GpuFrac.migrate_grace_period``). ``reclaim_grace``, ``restore_grace`` and ``headroom``
    (a share of the GPU) are the agent's defaults. ``freeze_per_gib`` and ``thaw_per_gib``: seconds
    the driver takes per GiB of GPU memory to checkpoint a process into host memory and back.
    """

    move: float = 4.3
    reattach: float = 4.3
    migrate_grace: float = 30.0
    reclaim_grace: float = _AGENT.reclaim_grace
    restore_grace: float = _AGENT.restore_grace
    headroom: float = _AGENT.headroom
    freeze_per_gib: float = FREEZE_SECONDS_PER_GIB
    thaw_per_gib: float = THAW_SECONDS_PER_GIB

    def freeze(self, nbytes: int) -> float:
        """Seconds to freeze a process holding ``nbytes`` of GPU memory (all its GPUs together)."""
        return self.freeze_per_gib * nbytes / GB

    def thaw(self, nbytes: int) -> float:
        return self.thaw_per_gib * nbytes / GB


Observer = Callable[["Engine"], None]


class Core:
    """The engine's state: its runs and nodes, the time, the events to come and what waits."""

    # The handlers one event kind calls of another's, each defined in the module of its kind.
    _activate: Callable[[Node], None]  # placement
    _ask_lease: Callable[[SessionRun], None]  # sessions
    _begin_move: Callable[[Lease], None]  # compaction
    _cell_end: Callable[[SessionRun, int], None]  # sessions
    _compact: Callable[[Lease, tuple[str, ...]], None]  # compaction
    _cut_off: Callable[[SessionRun], None]  # sessions
    _fit: Callable[[Lease], int]  # reclaim
    _free: Callable[[Lease], int]  # reclaim
    _freeze: Callable[[Lease], None]  # freezing
    _grant: Callable[[Lease, int], bool]  # reclaim
    _job_end: Callable[[JobRun, int], None]  # jobs
    _move_frozen: Callable[[Lease, tuple[str, ...]], None]  # freezing
    _reclaim_for: Callable[[Lease, Device, int], bool]  # reclaim
    _release: Callable[[Lease], None]  # placement
    _restored: Callable[[Lease, int], None]  # placement
    _set_frozen: Callable[[SessionRun, int], None]  # freezing
    _set_speed: Callable[[SessionRun | JobRun, float], None]  # running
    _shrink: Callable[[Lease], None]  # reclaim

    def __init__(self, policy_: Policy, spec: NodeSpec, nodes: int, sessions: Sequence[Session],
                 jobs: Sequence[JobSpec], timing: Timing = Timing(), *, start: float | None = None,
                 end: float | None = None, observer: Observer | None = None,
                 progress: Callable[[float], None] | None = None, contention: bool = True,
                 traced_compute: bool = False) -> None:
        self.policy = policy_
        self.contention = contention
        self.traced_compute = traced_compute
        self.rules = Rules(spread=False) if policy_.reserve else policy_.rules
        self.spec = spec
        self.timing = timing
        self.nodes = [Node(i, spec.devices(i)) for i in range(nodes)]
        self.context = spec.context
        self.sessions = [
            SessionRun(s, notebook_share(s, spec.largest, spec.context, all_burstable=policy_.all_burstable))
            for s in sessions
        ]
        self.jobs = [JobRun(j, job_share(j, spec.largest)) for j in jobs]
        times = [s.start for s in sessions] + [j.arrival for j in jobs]
        t0 = min(times, default=0.0) if start is None else start
        t1 = max([s.stop for s in sessions] + [j.arrival for j in jobs], default=t0) if end is None else end
        self.result = Result(policy_.name, nodes, spec.gpus, t0, t1)
        self.result.in_use_s, self.result.notebooks_in_use_s = traced_use(sessions, jobs, t0, t1)
        self.now = t0
        self.observer = observer
        self.progress = progress
        self._events: list[tuple[float, int, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self._ids = itertools.count()
        self._queue: list[SessionRun | JobRun] = []
        self._fresh = False
        self._freed = False
        self._waiting: set[str] = set()  # leases waiting for memory others borrow
        self._no_room: set[tuple[int, int, str, Share]] = set()
        # Sessions whose next cell is due, jobs placed but not started (dicts: ordered sets).
        self._due: dict[SessionRun, None] = {}
        self._starting: dict[JobRun, None] = {}
        # Cells and jobs running (ordered set), and whether who runs where changed since the speeds.
        self._busy: dict[SessionRun | JobRun, None] = {}
        self._dirty = False
        self._thawing: dict[Lease, None] = {}  # frozen leases on their GPU, waiting for room
        self._frozen_kernels = 0
        self._frozen_bytes = 0

    def _at(self, when: float, action: Callable[[], None], *, first: bool = False) -> None:
        """Schedule ``action``; at equal times what frees (``first``) goes before what asks."""
        heapq.heappush(self._events, (when, 0 if first else 1, next(self._seq), action))


def traced_use(sessions: Iterable[Session], jobs: Iterable[JobSpec], start: float,
               end: float) -> tuple[float, float]:
    """GPU-seconds within [start, end) that the workload uses as traced: (everything, cells alone)."""
    def within(t0: float, t1: float) -> float:
        return max(0.0, min(t1, end) - max(t0, start))

    cells = sum(c.gpus * within(c.start, c.start + c.duration) for s in sessions for c in s.cells)
    return cells + sum(j.in_use * within(j.arrival, j.arrival + j.duration) for j in jobs), cells

