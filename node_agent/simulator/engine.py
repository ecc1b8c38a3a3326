"""The discrete-event simulation: sessions, cells and jobs over time, every decision by node_agent.policy."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import partial

from node_agent import policy
from node_agent.policy import JOB, NOTEBOOK, Device, Placement, Rules
from node_agent.service import AgentConfig
from node_agent.simulator.contention import speeds
from node_agent.simulator.metrics import Result, Sample
from node_agent.simulator.node_spec import NodeSpec
from node_agent.simulator.policies import (
    COMPACT_BY_KILL,
    COMPACT_BY_MOVE,
    NO_COMPACTION,
    NO_RECLAIM,
    RECLAIM_BY_KILL,
    Policy,
)
from node_agent.simulator.records import (
    ACTIVE,
    FREEZING,
    FROZEN,
    FROZEN_STATES,
    IN_FLIGHT,
    LEAVING,
    PENDING,
    RESTARTING,
    THAWING,
    JobRun,
    Lease,
    Node,
    SessionRun,
)
from node_agent.simulator.shares import Share, cell_demand, job_share, notebook_share
from node_agent.simulator.traces import GB, Cell, JobSpec, Session

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


class Engine:
    """One policy over one workload on ``nodes`` nodes of ``spec``.

    Placement (``plan_logical``, ``plan_physical``), room for an arrival (``plan_compaction``), when
    a placed lease may start (``plan_activation``), memory a lease may take (``room``) and taking it
    back (``plan_reclaim``, ``reclaim_step``) are the agent's policy functions, called as the agent
    calls them; this module decides only time, and which node (a cluster scheduler's binpack).
    """

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

    # -- the event loop ------------------------------------------------------------------------

    def _at(self, when: float, action: Callable[[], None], *, first: bool = False) -> None:
        """Schedule ``action``; at equal times what frees (``first``) goes before what asks."""
        heapq.heappush(self._events, (when, 0 if first else 1, next(self._seq), action))

    def run(self) -> Result:
        for s in self.sessions:
            if s.share is not None:
                self._at(s.session.start, partial(self._session_start, s))
        for j in self.jobs:
            self._at(j.spec.arrival, partial(self._job_arrival, j))
        span = max(self.result.end - self.result.start, 1.0)
        handled = 0
        while self._events:
            when, _, _, action = heapq.heappop(self._events)
            if when > self.result.end and self._finished():
                break  # only jobs running past the horizon are left
            self.result.advance(when)
            self.now = when
            action()
            self._settle()
            self._rebalance()
            self.result.observe(self.now, self._sample())
            if self.observer is not None:
                self.observer(self)
            handled += 1
            if self.progress is not None and handled % 2000 == 0:
                self.progress(min(1.0, (when - self.result.start) / span))
        self.result.advance(self.result.end)
        self.result.jobs_never_started = sum(1 for j in self.jobs if j.started is None)
        return self.result

    def _finished(self) -> bool:
        return all(s.done or s.share is None for s in self.sessions) and all(
            j.started is not None for j in self.jobs)

    def _settle(self) -> None:
        """Retry what waits: placements (first come, first served, later ones may pass a blocked
        one), then cells and jobs waiting for their GPU or its memory."""
        for _ in range(100):  # each pass that progresses starts or places something: few suffice
            progressed = False
            if self._freed or self._fresh:
                self._freed = self._fresh = False
                for request in list(self._queue):
                    if self._place(request):
                        self._queue.remove(request)
                        progressed = True
            for s in list(self._due):
                if s.lease is not None and s.lease.state == ACTIVE:
                    progressed |= self._try_cell(s)
            for j in list(self._starting):
                if j.lease is not None and j.lease.state == ACTIVE:
                    progressed |= self._try_job(j)
            for lease in list(self._thawing):
                progressed |= self._try_thaw(lease)
            if not progressed and not self._freed:
                return

    # -- sessions and their cells ----------------------------------------------------------------

    def _session_start(self, s: SessionRun) -> None:
        self._ask_lease(s)
        if s.session.cells:
            self._at(s.session.cells[0].start, lambda: self._cell_due(s, 0))
        self._at(s.session.stop, lambda: self._session_stop(s), first=True)
        self._idle(s)

    def _ask_lease(self, s: SessionRun) -> None:
        if not s.queued and s.lease is None and not s.done:
            s.queued = True
            self._queue.append(s)
            self._fresh = True

    def _idle(self, s: SessionRun) -> None:
        """The kernel has nothing to run: it parks if nothing comes within ``park_after``."""
        if self.policy.park_after is not None:
            token = s.token
            self._at(self.now + self.policy.park_after, lambda: self._park(s, token), first=True)

    def _cell_due(self, s: SessionRun, index: int) -> None:
        s.next_cell = index
        s.due = self.now
        s.token += 1
        self._due[s] = None
        if s.parked_frozen or (s.lease is not None and s.lease.state in FROZEN_STATES):
            s.thaw_wait_from = self.now
        if s.lease is None:
            self._ask_lease(s)  # a parked kernel's next cell gets a GPU first

    def _try_cell(self, s: SessionRun) -> bool:
        """Start the waiting cell if its kernel is on a GPU and the memory is there."""
        lease, share = s.lease, s.share
        assert lease is not None and share is not None and s.due is not None
        cell = s.session.cells[s.next_cell]
        if cell.gpus > 0 and not self._grant(lease, cell_demand(cell, share, self.context)):
            return False
        self.result.cell_delays.append(self.now - s.due)
        self.result.cell_lateness.append(self.now - cell.start)
        del self._due[s]
        s.due = None
        s.cell = cell
        s.token += 1
        # Its end is set by _rebalance, at the speed the GPU's other work leaves it.
        s.left, s.speed, s.since = cell.duration, 0.0, self.now
        self._busy[s] = None
        self._dirty = True
        return True

    def _cell_end(self, s: SessionRun, token: int) -> None:
        if token != s.run_token or s.cell is None:
            return
        self._done_with_cell(s)
        lease = s.lease
        if lease is not None:
            if lease.shrinking:
                self._shrink(lease)  # between cells the kernel offloads what it borrowed
            if lease.state == LEAVING:
                self._begin_move(lease)

    def _cut_off(self, s: SessionRun) -> None:
        """The running cell is interrupted. The user is told which; whether they run it again is
        theirs to say, so the session goes on with its next cell as traced."""
        if s.cell is None:
            return
        self.result.cells_cut_off += 1
        self._done_with_cell(s)

    def _done_with_cell(self, s: SessionRun) -> None:
        s.cell = None
        s.token += 1
        s.run_token += 1
        s.paused_at = None
        self._busy.pop(s, None)
        self._dirty = True
        if s.thaw_wait > 0:
            self.result.thaw_waits.append(s.thaw_wait)
            s.thaw_wait = 0.0
        s.finished_cells += 1
        if s.finished_cells < len(s.session.cells):
            nxt = s.session.cells[s.next_cell + 1]
            self._at(max(nxt.start, self.now), partial(self._cell_due, s, s.next_cell + 1))
        elif s.stopping:
            # Not at once: the lease may be in the middle of a move or a kill.
            self._at(self.now, partial(self._finish, s), first=True)
        self._idle(s)

    def _park(self, s: SessionRun, token: int) -> None:
        lease = s.lease
        if token != s.token or s.cell is not None or s.due is not None:
            return
        if lease is None or lease.state != ACTIVE:
            return
        self.result.parks += 1
        if self.policy.freeze:
            lease.parking = True  # it leaves once frozen (_frozen)
            self._freeze(lease)
            return
        self.result.restarts += 1  # parked by a restart without CUDA, restored at its next cell
        s.parked_usage = lease.usage
        self._release(lease)
        s.lease = None

    def _session_stop(self, s: SessionRun) -> None:
        s.stopping = True
        if s.finished_cells >= len(s.session.cells):
            self._finish(s)

    def _finish(self, s: SessionRun) -> None:
        if s.done:
            return
        s.done = True
        s.token += 1
        self._due.pop(s, None)
        self._set_frozen(s, 0)  # a kernel shut down frozen frees its host memory
        s.parked_frozen, s.home = False, None
        if s.lease is not None:
            self._release(s.lease)
            s.lease = None
        if s in self._queue:
            self._queue.remove(s)
            s.queued = False

    # -- jobs --------------------------------------------------------------------------------------

    def _job_arrival(self, j: JobRun) -> None:
        j.queued = True
        self._queue.append(j)
        self._fresh = True

    def _try_job(self, j: JobRun) -> bool:
        lease = j.lease
        assert lease is not None
        if not self._grant(lease, j.share.request):
            return False
        del self._starting[j]
        j.started = self.now
        self.result.job_waits.append(self.now - j.spec.arrival)
        j.left, j.speed, j.since = j.spec.duration, 0.0, self.now
        self._busy[j] = None
        self._dirty = True
        return True

    def _job_end(self, j: JobRun, token: int) -> None:
        if token != j.run_token or j.ended:
            return
        j.ended = True
        self._busy.pop(j, None)
        self._dirty = True
        if j.lease is not None:
            self._release(j.lease)

    # -- placement ---------------------------------------------------------------------------------

    def _place(self, request: SessionRun | JobRun) -> bool:
        """Put ``request`` on the fullest node that takes it (a cluster scheduler's binpack, on
        requests); within the node, the policy decides where it goes and what moves."""
        if isinstance(request, SessionRun):
            share = request.share
            assert share is not None
            kind = JOB if self.policy.reserve else NOTEBOOK
            if self.policy.reserve:
                share = Share(self.spec.largest, self.spec.largest, share.devices)
        else:
            share, kind = request.share, JOB
        nodes = sorted(self.nodes, key=lambda n: (-n.logical_share(), n.index))
        if isinstance(request, SessionRun) and request.home is not None:
            nodes = [request.home]  # a frozen process thaws on the node whose host memory holds it
        for node in nodes:
            # The same shape that did not fit an unchanged node does not fit it now.
            key = (node.index, node.version, kind, share)
            if key in self._no_room:
                continue
            planned = node.planned()
            logical = policy.plan_logical(node.devices, planned, share.request, share.devices, self.rules)
            if logical is None:
                self._no_room.add(key)
                continue
            physical = policy.plan_physical(node.devices, planned, kind, share.request, logical,
                                            share.limit, self.rules)
            moves = policy.plan_compaction(node.devices, planned, {u: share.request for u in physical},
                                           self.rules)
            if moves is None or (moves and self.policy.compaction == NO_COMPACTION):
                self._no_room.add(key)
                continue
            lease = Lease(f"L{next(self._ids)}", kind, share, node, logical, physical, self.now, request)
            node.leases[lease.id] = lease
            node.changed()
            request.lease = lease
            request.queued = False
            if isinstance(request, SessionRun) and request.parked_frozen:
                assert request.parked_usage is not None
                lease.frozen_bytes = request.parked_usage
                request.parked_usage, request.parked_frozen, request.home = None, False, None
            elif isinstance(request, SessionRun) and request.parked_usage is not None:
                lease.reattach, lease.restore_to = True, request.parked_usage
                request.parked_usage = None
            for move in moves:
                self._compact(node.leases[move.lease_id], move.to_gpus)
            self._activate(node)
            return True
        if isinstance(request, SessionRun) and not request.waited:
            request.waited = True
            self.result.sessions_queued += 1
        return False

    def _activate(self, node: Node) -> None:
        pending = {lease.id for lease in node.leases.values() if lease.state == PENDING}
        if not pending:
            return
        for lease_id in policy.plan_activation(node.devices, node.running(), pending, self.rules):
            lease = node.leases[lease_id]
            if isinstance(lease.owner, JobRun):
                lease.state = ACTIVE  # starts once its memory is there (_try_job)
                self._starting[lease.owner] = None
                continue
            if lease.frozen_bytes:
                # Moved or re-leased while frozen: it thaws here once its memory fits.
                lease.state, lease.usage = FROZEN, 0
                self._thawing[lease] = None
                continue
            lease.state = RESTARTING if lease.reattach or lease.restore_to else ACTIVE
            # The new process's CUDA context, where there is memory for it.
            lease.usage = 0
            lease.usage = min(self.context, self._free(lease))
            if lease.usage < self.context:
                self.result.short_of_memory += 1
            if lease.state == RESTARTING:
                # Re-attach after a park, or the kernel restoring after a move: its state comes back.
                delay = self.timing.reattach if lease.reattach else 0.0
                lease.token += 1
                self._at(self.now + delay, partial(self._restored, lease, lease.token), first=True)

    def _restored(self, lease: Lease, token: int) -> None:
        if token != lease.token or lease.node.leases.get(lease.id) is not lease:
            return
        lease.state = ACTIVE
        lease.reattach = False
        lease.restore_until = self.now + self.timing.restore_grace
        # It loads what fits without setting off a reclaim; the rest waits on disk.
        lease.usage = max(lease.usage, min(lease.restore_to, lease.usage + self._fit(lease)))
        lease.restore_to = 0

    def _release(self, lease: Lease) -> None:
        node = lease.node
        if node.leases.pop(lease.id, None) is None:
            return
        node.changed()
        lease.token += 1
        self._waiting.discard(lease.id)
        self._thawing.pop(lease, None)
        self._freed = True
        self._activate(node)

    # -- compaction ------------------------------------------------------------------------------

    def _compact(self, lease: Lease, to: tuple[str, ...]) -> None:
        s = lease.owner
        assert isinstance(s, SessionRun)
        if self.policy.freeze:
            self._move_frozen(lease, to)
            return
        if self.policy.compaction == COMPACT_BY_KILL:
            # Run:ai: the GPU process is killed and the kernel starts again, empty, where it belongs.
            self.result.kills += 1
            self.result.lost_sessions.add(s.session.id)
            self._cut_off(s)
            lease.physical, lease.usage, lease.state = to, 0, PENDING
            lease.node.changed()
            lease.shrinking, lease.deadline = False, None
            return
        assert self.policy.compaction == COMPACT_BY_MOVE
        lease.move_to = to
        lease.node.changed()
        lease.state = LEAVING
        if s.cell is None:
            self._begin_move(lease)
        else:
            # A running cell may finish within the grace; then it is cut off.
            lease.token += 1
            token = lease.token
            self._at(self.now + self.timing.migrate_grace,
                     lambda: self._begin_move(lease) if token == lease.token else None, first=True)

    def _begin_move(self, lease: Lease) -> None:
        if lease.state != LEAVING or lease.node.leases.get(lease.id) is not lease:
            return
        s = lease.owner
        assert isinstance(s, SessionRun)
        self._cut_off(s)
        self.result.restarts += 1  # checkpointed, killed here, restarted and restored there
        lease.state = IN_FLIGHT
        lease.token += 1
        token = lease.token
        self._at(self.now + self.timing.move, lambda: self._landed(lease, token), first=True)

    def _landed(self, lease: Lease, token: int) -> None:
        if token != lease.token or lease.node.leases.get(lease.id) is not lease:
            return
        assert lease.move_to is not None
        self.result.moves += 1
        lease.physical, lease.move_to = lease.move_to, None
        lease.node.changed()
        lease.restore_to = max(lease.restore_to, lease.usage)
        lease.usage = 0
        lease.shrinking, lease.deadline = False, None
        lease.state = PENDING
        self._freed = True
        self._activate(lease.node)

    # -- memory: bursting and reclaim -------------------------------------------------------------

    def _used(self, holding: Iterable[Placement], uuid: str) -> int:
        return sum(p.usage for p in holding if uuid in p.physical)

    def _free(self, lease: Lease) -> int:
        """Bytes free on the fullest of ``lease``'s GPUs."""
        holding = lease.node.holding()
        devices = [lease.node.by_uuid[u] for u in lease.physical]
        return max(0, min((d.total - self._used(holding, d.uuid) for d in devices), default=0))

    def _fit(self, lease: Lease) -> int:
        """Bytes per GPU ``lease`` may add now without anyone giving anything back."""
        holding = lease.node.holding()
        headroom = self._headroom
        grow = []
        for uuid in lease.physical:
            device = lease.node.by_uuid[uuid]
            used = self._used(holding, uuid)
            room = policy.room(device, holding, lease.id, used, headroom(device))
            grow.append(max(0, min(room, device.total - used)))
        return min(grow, default=0)

    def _headroom(self, device: Device) -> int:
        return int(self.timing.headroom * device.total)

    def _grant(self, lease: Lease, demand: int) -> bool:
        """Give ``lease`` ``demand`` bytes per GPU, taking loans back as the policy does. False
        when it must wait for a borrower (its cell or job starts later)."""
        if demand <= lease.usage:
            lease.usage = demand
            self._waiting.discard(lease.id)
            return True
        if self.policy.reclaim != NO_RECLAIM:
            for uuid in lease.physical:
                if not self._reclaim_for(lease, lease.node.by_uuid[uuid], min(demand, lease.share.request)):
                    self._waiting.add(lease.id)
                    return False
        self._waiting.discard(lease.id)
        granted = lease.usage + self._fit(lease)
        if granted < demand:
            self.result.short_of_memory += 1
        lease.usage = min(demand, granted)
        return True

    def _reclaim_for(self, owner: Lease, device: Device, want: int) -> bool:
        """Take loans back on ``device`` until ``owner`` can hold ``want`` (within its request).
        False while a borrower still has its grace."""
        for _ in range(len(owner.node.leases) + 1):
            holding = owner.node.holding()
            used = self._used(holding, device.uuid)
            free = device.total - used
            if owner.usage + free >= want:
                return True
            # The owner takes what is free; then it is owed the rest, which plan_reclaim finds.
            grown = owner.usage + free
            view = [
                Placement(p.id, p.kind, p.request, p.logical, p.physical, grown, p.created, p.limit)
                if p.id == owner.id else p for p in holding
            ]
            restoring = frozenset(
                lease.id for lease in owner.node.leases.values() if lease.restore_until > self.now)
            chosen = policy.plan_reclaim(device, view, device.total, self._headroom(device), restoring)
            if not chosen:
                return True  # nothing more to take back: the rest is not owed to it
            waiting = False
            for reclaim in chosen:
                borrower = owner.node.leases[reclaim.lease_id]
                waiting |= not self._take_back(borrower)
            if waiting:
                return False
        return True

    def _take_back(self, borrower: Lease) -> bool:
        """One rung of the policy's reclaim for a borrower; True when its loan is back now."""
        s = borrower.owner
        if borrower.state in FROZEN_STATES:
            return borrower.state == FROZEN  # freezing: its memory leaves when done
        if self.policy.reclaim == RECLAIM_BY_KILL:
            self.result.kills += 1
            if isinstance(s, SessionRun):
                self.result.lost_sessions.add(s.session.id)
                self._cut_off(s)
            borrower.usage = self.context
            return True
        standing = policy.Standing(borrower.usage, borrower.share.request, borrower.share.limit,
                                   borrower.shrinking, borrower.deadline)
        step = policy.reclaim_step(standing, self.now, owed=True, grace=self.timing.reclaim_grace,
                                   enforce_limit=False)
        idle = not isinstance(s, SessionRun) or s.cell is None
        if step.action == policy.SHRINK:
            if idle:
                self._shrink(borrower)
                return True
            borrower.shrinking, borrower.deadline = True, step.at
            assert step.at is not None
            token = borrower.token
            self._at(step.at, lambda: self._deadline(borrower, token), first=True)
            return False
        if step.action == policy.KILL:
            if self.policy.freeze:
                self._freeze(borrower)
                return False  # its memory is back once the freeze is done
            self._restart(borrower)
            return True
        return step.action != policy.WAIT

    def _shrink(self, lease: Lease) -> None:
        self.result.shrinks += 1
        lease.usage = min(lease.usage, lease.share.request)
        lease.shrinking, lease.deadline = False, None
        self._freed = True

    def _deadline(self, lease: Lease, token: int) -> None:
        if token != lease.token or not lease.shrinking or lease.node.leases.get(lease.id) is not lease:
            return
        standing = policy.Standing(lease.usage, lease.share.request, lease.share.limit, True, lease.deadline)
        # Still owed: someone on one of its GPUs waits for memory.
        owed = any(
            waiter in lease.node.leases and set(lease.node.leases[waiter].physical) & set(lease.physical)
            for waiter in self._waiting
        )
        step = policy.reclaim_step(standing, self.now, owed=owed, grace=self.timing.reclaim_grace,
                                   enforce_limit=False)
        if step.action == policy.KILL:
            if self.policy.freeze:
                self._freeze(lease)
            else:
                self._restart(lease)
        elif step.action == policy.CANCEL:
            lease.shrinking, lease.deadline = False, None

    def _restart(self, lease: Lease) -> None:
        """The ladder's last rung: kill, restart in place, restore the last good checkpoint."""
        self.result.reclaim_restarts += 1
        if lease.state == LEAVING:
            self._begin_move(lease)  # it was to move anyway: the kill is its checkpoint and restart
            return
        s = lease.owner
        if isinstance(s, SessionRun):
            self._cut_off(s)
        self.result.restarts += 1
        lease.restore_to = min(lease.usage, lease.share.request)
        lease.usage = self.context
        lease.shrinking, lease.deadline = False, None
        lease.state = RESTARTING
        lease.token += 1
        token = lease.token
        self._freed = True
        self._at(self.now + self.timing.move, lambda: self._restored(lease, token), first=True)

    # -- freezing: the driver's checkpoint into host memory (issue 9) ----------------------------

    def _freeze(self, lease: Lease) -> None:
        """Freeze ``lease``'s process: its running GPU cell waits inside its next CUDA call, its
        memory leaves the GPU once the driver has copied it (time by bytes), nothing restarts."""
        s = lease.owner
        assert isinstance(s, SessionRun)
        self.result.freezes += 1
        lease.state = FREEZING
        lease.shrinking, lease.deadline = False, None
        self._pause(s)
        lease.token += 1
        token = lease.token
        seconds = self.timing.freeze(lease.usage * lease.share.devices)
        self._at(self.now + seconds, partial(self._frozen, lease, token), first=True)

    def _frozen(self, lease: Lease, token: int) -> None:
        if token != lease.token or lease.node.leases.get(lease.id) is not lease:
            return
        s = lease.owner
        assert isinstance(s, SessionRun)
        lease.frozen_bytes, lease.usage = max(lease.usage, 1), 0
        lease.state = FROZEN
        self._set_frozen(s, lease.frozen_bytes * lease.share.devices)
        self._freed = True
        if lease.parking:
            # Parked frozen: the lease goes; its next cell leases again on this node and thaws.
            s.parked_usage, s.parked_frozen, s.home = lease.frozen_bytes, True, lease.node
            self._release(lease)
            s.lease = None
            if s.due is not None:
                self._ask_lease(s)
        elif lease.move_to is not None:
            self._move_frozen(lease, lease.move_to)
        else:
            self._thawing[lease] = None  # frozen for a reclaim: it thaws when room returns

    def _move_frozen(self, lease: Lease, to: tuple[str, ...]) -> None:
        """Migrate by freezing and a thaw remapped onto ``to`` (GPUs of one model on one node)."""
        lease.move_to = to
        lease.node.changed()
        if lease.state in (ACTIVE, LEAVING):
            self._freeze(lease)
        elif lease.state == FROZEN:
            self.result.moves += 1
            self._thawing.pop(lease, None)
            lease.physical, lease.move_to = to, None
            lease.state = PENDING
            self._freed = True
            self._activate(lease.node)
        # FREEZING moves when frozen (_frozen), THAWING freezes again when thawed (_thawed);
        # PENDING has nothing on its GPUs yet and simply goes.
        elif lease.state == PENDING:
            lease.physical, lease.move_to = to, None

    def _try_thaw(self, lease: Lease) -> bool:
        """Thaw ``lease`` if all it froze fits: what is within its request is owed to it (loans are
        taken back for it); beyond that, only what is free without setting off a reclaim."""
        if lease.state != FROZEN or lease.node.leases.get(lease.id) is not lease:
            self._thawing.pop(lease, None)
            return False
        need = lease.frozen_bytes
        if self.policy.reclaim != NO_RECLAIM:
            for uuid in lease.physical:
                if not self._reclaim_for(lease, lease.node.by_uuid[uuid], min(need, lease.share.request)):
                    self._waiting.add(lease.id)
                    return False
        if lease.state != FROZEN:
            return False
        if self._fit(lease) < need and not self._remap(lease, need):
            return False
        self._waiting.discard(lease.id)
        self._thawing.pop(lease, None)
        s = lease.owner
        assert isinstance(s, SessionRun)
        self.result.thaws += 1
        self._set_frozen(s, 0)
        lease.usage, lease.state = need, THAWING
        seconds = self.timing.thaw(need * lease.share.devices)
        # Not taken back while it thaws, nor within the restore grace after.
        lease.restore_until = self.now + seconds + self.timing.restore_grace
        lease.token += 1
        self._at(self.now + seconds, partial(self._thawed, lease, lease.token), first=True)
        return True

    def _remap(self, lease: Lease, need: int) -> bool:
        """Thaw onto other GPUs of the node (same model: the driver remaps) where the planner
        would put the lease and all it froze fits now; True if it was moved there."""
        if not self.rules.spread:
            return False
        node = lease.node
        others = [other.planned() for other in node.leases.values() if other is not lease]
        where = policy.plan_physical(node.devices, others, NOTEBOOK, lease.share.request, lease.logical,
                                     lease.share.limit, self.rules)
        if where == lease.physical:
            return False
        here = lease.physical
        lease.physical = where  # holds nothing while frozen: trying it there changes no one's memory
        if self._fit(lease) < need:
            lease.physical = here
            return False
        self.result.moves += 1
        node.changed()
        return True

    def _thawed(self, lease: Lease, token: int) -> None:
        if token != lease.token or lease.node.leases.get(lease.id) is not lease:
            return
        s = lease.owner
        assert isinstance(s, SessionRun)
        lease.state, lease.frozen_bytes = ACTIVE, 0
        if s.thaw_wait_from is not None:
            s.thaw_wait += self.now - s.thaw_wait_from
            s.thaw_wait_from = None
        if lease.move_to is not None:
            self._freeze(lease)  # compaction chose it while it thawed
            return
        self._resume(s)

    def _set_frozen(self, s: SessionRun, nbytes: int) -> None:
        """Keep the count of frozen kernels and the host memory they hold."""
        if bool(s.frozen_host) != bool(nbytes):
            self._frozen_kernels += 1 if nbytes else -1
        self._frozen_bytes += nbytes - s.frozen_host
        s.frozen_host = nbytes

    def _pause(self, s: SessionRun) -> None:
        if s.cell is None or s.cell.gpus == 0 or s.paused_at is not None:
            return  # a CPU cell runs on: Python keeps running while the GPU state is frozen
        self._set_speed(s, 0.0)
        s.paused_at = self.now
        self._dirty = True

    def _resume(self, s: SessionRun) -> None:
        if s.paused_at is None:
            return
        s.thaw_wait += self.now - s.paused_at
        s.paused_at = None
        self._dirty = True

    # -- compute contention -----------------------------------------------------------------------

    def _rebalance(self) -> None:
        """Give each running cell and job the speed its GPUs' other work leaves it, and move its
        end accordingly."""
        if not self._dirty:
            return
        self._dirty = False
        busy: dict[SessionRun | JobRun, tuple[tuple[str, ...], float]] = {}
        for run in self._busy:
            if run.paused_at is not None or run.lease is None:
                continue
            if isinstance(run, SessionRun):
                assert run.cell is not None
                if run.cell.gpus == 0:
                    busy[run] = ((), 0.0)
                    continue
                compute = run.cell.compute if self.traced_compute else 1.0
            else:
                compute = min(1.0, run.spec.fraction)
            busy[run] = (run.lease.physical, compute)
        for run, speed in speeds(busy, shared=self.contention).items():
            self._set_speed(run, speed)

    def _set_speed(self, run: SessionRun | JobRun, speed: float) -> None:
        if speed == run.speed:
            return
        run.left = max(0.0, run.left - (self.now - run.since) * run.speed)
        run.since, run.speed = self.now, speed
        run.run_token += 1
        if speed > 0:
            end = partial(self._cell_end, run) if isinstance(run, SessionRun) else partial(self._job_end, run)
            self._at(self.now + run.left / speed, partial(end, run.run_token), first=True)

    # -- what is held and used -------------------------------------------------------------------

    def _sample(self) -> Sample:
        held = held_nb = 0
        jobs_running = cells_running = shared = 0.0
        for node in self.nodes:
            occupied: set[str] = set()
            by_notebooks: set[str] = set()
            busy: dict[str, int] = {}
            cells: list[tuple[Lease, Cell]] = []
            for lease in node.leases.values():
                where = lease.physical
                occupied.update(where)
                owner = lease.owner
                if isinstance(owner, SessionRun):
                    by_notebooks.update(where)
                    if owner.cell is not None and owner.cell.gpus > 0 and owner.paused_at is None:
                        cells.append((lease, owner.cell))
                        for u in where:
                            busy[u] = busy.get(u, 0) + 1
                elif owner.started is not None:
                    jobs_running += owner.spec.in_use
                    for u in where:
                        busy[u] = busy.get(u, 0) + 1
            for lease, cell in cells:
                cells_running += cell.gpus
                if any(busy[u] > 1 for u in lease.physical):
                    shared += cell.gpus
            held += len(occupied)
            held_nb += len(by_notebooks)
        # Wall time against work done, weighted by the GPUs each keeps busy: the slowdown.
        wall = work = cell_wall = cell_work = 0.0
        for run in self._busy:
            if run.paused_at is not None:
                continue
            if isinstance(run, SessionRun):
                assert run.cell is not None
                weight = float(run.cell.gpus)
                cell_wall += weight
                cell_work += weight * run.speed
            else:
                weight = run.spec.in_use
            wall += weight
            work += weight * run.speed
        return Sample(held, held_nb, jobs_running + cells_running, cells_running, shared,
                      wall, work, cell_wall, cell_work, self._frozen_kernels, self._frozen_bytes)


def traced_use(sessions: Iterable[Session], jobs: Iterable[JobSpec], start: float,
               end: float) -> tuple[float, float]:
    """GPU-seconds within [start, end) that the workload uses as traced: (everything, cells alone)."""
    def within(t0: float, t1: float) -> float:
        return max(0.0, min(t1, end) - max(t0, start))

    cells = sum(c.gpus * within(c.start, c.start + c.duration) for s in sessions for c in s.cells)
    return cells + sum(j.in_use * within(j.arrival, j.arrival + j.duration) for j in jobs), cells


def nodes_needed(sessions: Sequence[Session], jobs: Sequence[JobSpec], spec: NodeSpec) -> int:
    """Nodes for the busiest moment of a site that reserves whole GPUs: each GPU session's peak
    GPUs for its whole life, plus every job's GPUs (a fraction counts whole) as it arrives."""
    changes: list[tuple[float, int]] = []
    for s in sessions:
        if s.peak_gpus:
            changes += [(s.start, s.peak_gpus), (s.stop, -s.peak_gpus)]
    for j in jobs:
        changes += [(j.arrival, j.gpus), (j.arrival + j.duration, -j.gpus)]
    peak = level = 0
    for _, delta in sorted(changes, key=lambda c: (c[0], c[1])):
        level += delta
        peak = max(peak, level)
    return max(1, -(-peak // spec.gpus))


def simulate(policy_: Policy, spec: NodeSpec, nodes: int, sessions: Sequence[Session],
             jobs: Sequence[JobSpec] = (), timing: Timing = Timing(), *, start: float | None = None,
             end: float | None = None, observer: Observer | None = None,
             progress: Callable[[float], None] | None = None, contention: bool = True,
             traced_compute: bool = False) -> Result:
    """Run one policy over the workload and return what it measured. ``contention``: workloads
    sharing a GPU's compute slow each other; ``traced_compute``: a cell asks for its traced
    utilisation of the GPU rather than all of it."""
    return Engine(policy_, spec, nodes, sessions, jobs, timing, start=start, end=end,
                  observer=observer, progress=progress, contention=contention,
                  traced_compute=traced_compute).run()
