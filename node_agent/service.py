"""The agent's core: turns requests and measurements into ledger changes and directives."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from node_agent import policy, procs
from node_agent.caps import mps_running
from node_agent.devices import DeviceError, GpuBackend, GpuInfo, Sweep
from node_agent.devices.base import CHECKPOINTED, FAILED, LOCKED, RUNNING, FreezeError, Freezer
from node_agent.kubelet import cgroups
from node_agent.kubelet.claims import WholeGpus
from node_agent.ledger import CLUSTER, KUBELET, Directive, Lease, Ledger
from node_agent.quantities import (
    MAX_COUNT,
    MiB,
    Quantity,
    QuantityError,
    check_share,
    format_bytes,
    format_duration,
    parse_quantity,
)
from node_agent.stats import AFTER_WAIT, AT_ONCE, MIGRATED, RELEASED, AgentStats, Observation

log = logging.getLogger("gpufrac.agent")
T = TypeVar("T")

MAX_WAIT = 60.0
# What a client is asked to do, and what it is only told (heard of when asked for by kind).
ACTIONS = ("migrate", "shrink", "killed")
NOTICES = ("resized", "bursting", "unparked", "frozen", "moved")
# Asked of a client only when it names them: a server that cannot park never hears of it.
ASKED_BY_NAME = ("park",)
KINDS = (*ACTIONS, *ASKED_BY_NAME, *NOTICES)
# What a notebook lease may be parked from: a move under way must end first, and a killed
# lease is restarting already.
PARKABLE = ("active", "shrinking", "pending", "parked")
# Why a lease in one of these states is not parked (or asked to park) now: a 409's words.
_NOT_NOW = {
    "migrating": "a move is under way; park it once the move is done",
    "killed": "its kernel is restarting after it was stopped; park it once it runs again",
    "parked": "it is parked already",
    "pending": "it has no GPU to give back yet",
}
# A lease said to burst is not said to again for this long (seconds).
BURSTING_QUIET_S = 60.0
# After this many polls in a row that saw nothing change, the interval doubles, up to
# POLL_STRETCH times --poll-interval. Measuring is all an idle agent does; but an owner
# growing into loaned memory is seen only by measuring, so the stretch stays short.
QUIET_TICKS = 3
POLL_STRETCH = 4


def _less_used(gpu: GpuInfo, freed: int) -> GpuInfo:
    """``gpu`` with ``freed`` bytes of its use given back."""
    freed = min(freed, gpu.memory_used)
    return replace(gpu, memory_used=gpu.memory_used - freed,
                   memory_free=gpu.memory_free + freed) if freed else gpu


def _ordinal(n: int) -> str:
    """3rd, 4th, 11th, 21st."""
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


class Refused(Exception):
    """A request the agent does not carry out as asked: the field at fault (or None) and why.
    Raised as such, the value asked for cannot be granted; the subclasses say more."""

    def __init__(self, field: str | None, message: str) -> None:
        super().__init__(message)
        self.field = field
        self.message = message


class NotYours(Refused):
    """What the request names belongs to another user (a process)."""


class NotFound(Refused):
    """No such lease among the caller's: another user's is not theirs to know of."""


class Conflict(Refused):
    """Not possible in the state the lease or the node is in now."""


class OverQuota(Refused):
    """The caller holds as many leases as one user may."""


@dataclass(frozen=True)
class Caller:
    """Who is asking, from the socket (SO_PEERCRED) or a TCP token — never from a body."""

    uid: int
    pid: int | None = None
    admin: bool = False


# The smallest share: below it a fraction such as 1e-300 would make a lease of no bytes.
MIN_SHARE = MiB


@dataclass
class AgentConfig:
    poll_interval: float = 1.0
    # Leases one (non-admin) user may hold at once.
    max_leases_per_user: int = 64
    # Memory (bytes, requests summed over devices) and GPUs (requests as shares of a GPU, as
    # Run:ai and KAI count a project's quota) one (non-admin) user's leases may reserve at
    # once, parked ones included (None: no cap).
    max_bytes_per_user: int | None = None
    max_gpus_per_user: int | None = None
    # The node scheduler (Run:ai's): spread burstable notebooks and move them back for room.
    node_scheduler: bool = True
    # How many leases one GPU may run at once (None: not enforced).
    max_workloads_per_gpu: int | None = None
    # How long a borrower has to give its loan back after `shrink` before it is killed.
    reclaim_grace: float = 30.0
    # How long a client has to report a move done before the agent kills the process.
    migrate_grace: float = 120.0
    # How long a lease may have no live process (a kernel restarting) before it is released.
    orphan_grace: float = 60.0
    # How long a kernel that came back (new pid, or a move done) is reclaimed from last only.
    restore_grace: float = 60.0
    # Kills of one lease within this window are counted, and the count is told to its user.
    kill_window: float = 600.0
    # Reclaim starts when free memory falls below this share of the GPU while an owner is owed.
    headroom: float = 0.05
    # One process's CUDA context, where the backend does not know it (None: the estimate).
    context_size: int | None = None
    # Stop leases that stay above their limit. None: with NVML only; a simulated node counts
    # resident memory, which an `import torch` alone takes past a tight limit.
    enforce_limits: bool | None = None
    # Where the kubelet links containers' logs, which name the pod container of a process.
    container_logs: str = cgroups.CONTAINER_LOGS
    # Freeze a notebook's processes (the driver keeps their GPU state in their host memory)
    # wherever it can, before restarting or stopping them.
    freeze: bool = True
    # How long a freeze waits for the kernel's submitted GPU work, and how often it is tried
    # when that wait times out (a long kernel runs), before the fallback.
    freeze_lock_timeout: float = 10.0
    freeze_attempts: int = 3
    # Host memory that frozen GPU state may take on this node (None: freeze_budget_share of
    # its RAM). Frozen memory lives in the kernels' own processes: the host must hold it.
    freeze_budget: int | None = None
    freeze_budget_share: float = 0.5
    # Move a notebook by freezing it and thawing it on the other GPU (driver r580+, the same
    # model). Off by default: a process that CUDA_VISIBLE_DEVICES restricts, as every kernel
    # is, has been reported to fail even a remap onto its own GPU; no hardware here showed
    # otherwise. Off, a move restarts the kernel from its checkpoint, as before.
    freeze_remap: bool = False
    # How long a cell may wait for a frozen kernel's GPU to have room for all it froze before
    # the kernel restarts from its checkpoint within its request instead (what does not fit
    # then waits on disk): a borrower frozen by reclaim may otherwise wait for hours.
    thaw_wait: float = 300.0

    @property
    def rules(self) -> policy.Rules:
        return policy.Rules(spread=self.node_scheduler, max_per_gpu=self.max_workloads_per_gpu)


# A CUDA 12 context on a recent data-centre GPU; NVML does not report it on its own.
CONTEXT_ESTIMATE = 500 * 2**20


@dataclass(frozen=True)
class CreateLease:
    """A new lease as asked for; ``limit`` is the request's when none was named."""

    kind: str
    client: str
    request: Quantity
    limit: Quantity
    devices: int = 1
    kernel_id: str | None = None
    name: str = ""
    compute_request: float | None = None
    compute_limit: float | None = None
    # The cluster's plan (KAI's): its logical GPUs, taken as they are where they have room.
    logical: tuple[str, ...] | None = None
    # The GPUs its processes can see (empty: all of the node's).
    reach: tuple[str, ...] = ()


@dataclass(frozen=True)
class Resize:
    """A new share for a lease; None keeps what it has (a kept limit below a new request
    rises to it)."""

    request: Quantity | None = None
    limit: Quantity | None = None
    compute_request: float | None = None
    compute_limit: float | None = None


def _compute_share(current: tuple[float | None, float | None], request: float | None,
                   limit: float | None) -> tuple[float | None, float | None]:
    """Compute fractions after a change: the limit defaults to the request, and must not be
    below it."""
    req = request if request is not None else current[0]
    lim = limit if limit is not None else request if request is not None else current[1]
    if lim is not None and req is None:
        raise Refused("compute_limit", "needs compute_request beside it")
    if req is not None and lim is not None and lim < req:
        raise Refused("compute_limit", f"must be at least compute_request ({req:g}), got {lim:g}")
    return req, lim


class Agent:
    """Leases, placement and reclaim for one node. Runs on one asyncio loop."""

    def __init__(self, backend: GpuBackend, ledger: Ledger, config: AgentConfig | None = None,
                 freezer: Freezer | None = None) -> None:
        self.backend = backend
        self.ledger = ledger
        self.config = config or AgentConfig()
        self.freezer = freezer
        # Freezes and thaws under way, by lease: each runs the driver's calls in a thread.
        self._acting: dict[str, asyncio.Future[Any]] = {}
        # Frozen leases whose kernel asked for its GPU back (a cell waits): since when.
        self._thaw_asked: dict[str, float] = {}
        self.gpus: list[GpuInfo] = []
        self._reported: dict[str, int] = {}
        # When each lease was last said to burst: a usage that hovers at the request must
        # not flood its follower with notices.
        self._bursting_said: dict[str, float] = {}
        # lease id -> (pid, start time) of what its processes started that uses a GPU
        self._children: dict[str, list[tuple[int, int]]] = {}
        # Replaced by each directive, so that a tick sees one was made (see _state).
        self._directive_added = object()
        # Long-polls waiting, by what they wait for: ("lease", id, kind) or ("client", owner
        # uid, name, kind). A directive wakes only those it concerns.
        self._listeners: dict[tuple[object, ...], set[asyncio.Event]] = {}
        self._task: asyncio.Task[None] | None = None
        self.counters: dict[str, int] = {"kills": 0, "shrinks": 0, "migrations": 0, "ticks": 0,
                                         "freezes": 0, "thaws": 0}
        # Moves, shrinks and kills by cause, and move durations, for /metrics.
        self.stats = AgentStats()
        self.tick_seconds = 0.0
        # The processes polls look at, each read once while it lives.
        self._procs = procs.ProcessWatch()
        # Polling: the last sweep, the quiet ticks since the last change, the stretch of the
        # interval, when the last tick ended (monotonic) and the time it judged deadlines by;
        # set by a call that changes something, to end a stretched wait.
        self._swept: Sweep | None = None
        self._quiet = 0
        self._stretch = 1
        self._ticked = 0.0
        self._judged = 0.0
        self._woken = asyncio.Event()
        # (pod container, GPU) the kubelet lists that this agent does not see (said once each),
        # and notebooks on pods' GPUs asked to park, once each.
        self._unseen_pods: set[tuple[str, str]] = set()
        self._parks_asked: set[str] = set()

    # --- life cycle ------------------------------------------------------------------
    async def start(self) -> None:
        """Measure the node, re-adopt live processes from the ledger, then poll."""
        if self.freezer is not None:
            # The driver's first look (cuInit) can take seconds: not on the loop, not later.
            why = await asyncio.get_running_loop().run_in_executor(None, self.freezer.unavailable)
            if why:
                log.info("freezing: not available: %s", why)
            else:
                log.info("freezing: by %s", self.freezer.name)
        await self.tick()
        for lease in self.ledger.leases.values():
            for pid, _start in lease.pids:
                self._track(lease, pid)
        self._resume_freezes()
        self._task = asyncio.create_task(self._poll(), name="gpufrac-poll")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        # A freeze or thaw is left to finish: stopping the caller mid-call desyncs the driver.
        await self.settled()
        self._procs.close()

    async def acted(self, lease_id: str, timeout: float) -> Lease | None:
        """The lease once its freeze or thaw under way has ended, or as it is after
        ``timeout`` seconds (None: released)."""
        work = self._acting.get(lease_id)
        if work is not None:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.shield(work), timeout)
        return self.ledger.leases.get(lease_id)

    async def settled(self) -> None:
        """Wait for the freezes and thaws under way (and any they lead to) to end."""
        while self._acting:
            await asyncio.gather(*self._acting.values(), return_exceptions=True)

    async def _poll(self) -> None:
        while True:
            await self._until_due()
            try:
                await self.tick()
            except Exception:
                log.exception("poll failed; will try again in %.1fs", self.config.poll_interval)

    def _wake(self) -> None:
        """A call changes a lease or what is known of it: poll at the configured interval
        again, from now on. Reads do not: every Jupyter server checks on the agent each
        second, and followers long-poll, so they would keep the interval from ever growing."""
        self._quiet, self._stretch = 0, 1
        self._woken.set()

    async def _until_due(self) -> None:
        """Sleeps until the next tick: ``_stretch`` intervals after the last one (one, once a
        call wakes it), or at the next deadline if that is sooner, so a grace ends when it
        says, however stretched the interval."""
        while True:
            self._woken.clear()
            now = time.monotonic()
            due = self._ticked + self.config.poll_interval * self._stretch
            deadline = self._next_deadline()
            if deadline is not None:
                due = min(due, now + deadline - time.time())
            if due <= now:
                return
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._woken.wait(), due - now)

    def _next_deadline(self) -> float | None:
        """The earliest deadline (wall clock) the last tick did not yet see pass."""
        return min((at for lease in self.ledger.leases.values()
                    for at in (lease.deadline, lease.orphan_deadline, lease.restore_until)
                    if at is not None and at > self._judged), default=None)

    def _state(self) -> tuple[object, ...]:
        """What a tick may change: the ledger replaces a lease it changes (one it does not is
        the same object, compared at no cost), and a directive replaces ``_directive_added``."""
        return (*self.ledger.leases.values(), self._directive_added,
                *self._reported.items())

    # --- measuring -------------------------------------------------------------------
    async def tick(self) -> None:
        """One poll: measure, forget dead processes, release orphans, reclaim, enforce deadlines."""
        started = time.perf_counter()
        before = self._state()
        loop = asyncio.get_running_loop()
        try:
            # All blocking backend calls of one tick, in one sweep, in a worker thread.
            m = await loop.run_in_executor(None, self.backend.sweep)
            measured_anew = m != self._swept
            self._measured(m)
            now = time.time()
            self._procs.sweep()
            self._update_usage(m)
            self._forget_dead(now)
            self._enforce_deadlines(now)
            self._reclaim(now)
            self._activate_pending()
            self._judged = now
            self._settle(measured_anew, before)
        finally:
            self._ticked = time.monotonic()
        self.counters["ticks"] += 1
        self.tick_seconds = time.perf_counter() - started

    def _settle(self, measured_anew: bool, before: tuple[object, ...]) -> None:
        """Count the tick quiet (the interval stretches) unless it measured or did anything new."""
        if measured_anew or self._state() != before:
            self._quiet, self._stretch = 0, 1
        else:
            self._quiet += 1
            if self._quiet >= QUIET_TICKS:
                self._stretch = min(POLL_STRETCH, self._stretch * 2)

    def _measured(self, m: Sweep) -> None:
        """What the agent knows of the node from now on: a sweep, or the last one less what
        has ended since."""
        self._swept = m
        self.gpus = [replace(g, context_size=self._context(g)) for g in m.gpus]

    def _members(self, m: Sweep) -> dict[str, dict[str, list[int]]]:
        """lease id -> GPU -> the processes using it there: the registered ones, and those
        they started (a DataLoader worker, a subprocess), which use the same share."""
        owner = {pid: lease.id for lease in self.ledger.leases.values() for pid, _ in lease.pids}
        members: dict[str, dict[str, list[int]]] = {}
        for uuid, listed in m.processes.items():
            for pid in listed:
                lease_id = owner.get(pid) or next(
                    (owner[p] for p in self._procs.ancestors(pid) if p in owner), None)
                if lease_id is not None:
                    members.setdefault(lease_id, {}).setdefault(uuid, []).append(pid)
        # A pod's whole GPU: whatever no lease holds there is the pod's (the device plugin gave
        # the GPU to it alone); its processes register nowhere.
        for lease in self.ledger.leases.values():
            if lease.planned_by == KUBELET:
                for uuid in lease.physical:
                    theirs = {p for found in members.values() for p in found.get(uuid, [])}
                    members.setdefault(lease.id, {})[uuid] = [
                        pid for pid in m.processes.get(uuid, {}) if pid not in theirs]
        return members

    def _update_usage(self, m: Sweep) -> None:
        now = time.monotonic()
        self._children = {}
        members = self._members(m)
        for lease in list(self.ledger.leases.values()):
            found = members.get(lease.id, {})
            registered = {pid for pid, _ in lease.pids}
            started = {p for pids in found.values() for p in pids} - registered
            # Pinned by start time when seen: a kill later never hits a reused pid. A pod's
            # processes are never the agent's to stop.
            self._children[lease.id] = [] if lease.planned_by == KUBELET else [
                (ident.pid, ident.start_time) for pid in sorted(started)
                if (ident := self._procs.identify(pid)) is not None
                and ident.uid == lease.owner_uid]
            usage, compute = self._held_by(lease, m, found)
            was_bursting = lease.usage > lease.request
            self.ledger.set_usage(lease.id, usage, compute)
            if (usage > lease.request and not was_bursting and lease.state == "active"
                    and now - self._bursting_said.get(lease.id, -BURSTING_QUIET_S)
                    >= BURSTING_QUIET_S):
                self._bursting_said[lease.id] = now
                self._directive(
                    lease, "bursting",
                    f"using {format_bytes(usage)}, above its {format_bytes(lease.request)} "
                    "guarantee: the memory above it is loaned and may be asked back",
                    usage=usage, request=lease.request, limit=lease.limit,
                    gpu=lease.physical[0] if lease.physical else None)

    def _held_by(self, lease: Lease, m: Sweep, found: dict[str, list[int]]
                 ) -> tuple[int, int | None]:
        """The lease's usage and compute use in ``m``: what its processes (``found``: GPU ->
        pids) hold on the GPUs it runs on, the most on any one; where the backend does not
        say, what its client reported."""
        usage = 0
        seen = False
        compute: int | None = None
        for uuid in lease.physical:
            listed = m.processes.get(uuid)
            if listed is None:
                continue
            mine = found.get(uuid, [])
            held = [listed[pid] for pid in mine]
            if held and all(h is not None for h in held):
                seen = True
                usage = max(usage, sum(h or 0 for h in held))
            sampled = m.utilization.get(uuid)
            if sampled is not None:
                busy = min(100, sum(sampled.get(pid, 0) for pid in mine))
                compute = busy if compute is None else max(compute, busy)
        if not seen and lease.id in self._reported:
            usage = self._reported[lease.id]
        return usage, compute

    def _recount(self, lease_id: str) -> None:
        """The lease's usage as the last sweep, less what ended since, shows it on the GPUs
        it runs on now: a call that changes its processes or GPUs need not wait for a sweep."""
        lease = self.ledger.leases.get(lease_id)
        if lease is None or self._swept is None:
            return
        found = self._members(self._swept).get(lease.id, {})
        self.ledger.set_usage(lease.id, *self._held_by(lease, self._swept, found))

    def _gone(self, lease_id: str, ended: Collection[int]) -> None:
        """The lease's processes ``ended`` (killed, exited, replaced by a restart) hold nothing
        from now on: what the last sweep saw them hold leaves their GPUs' use and the lease's
        usage now, not at the next sweep. A kernel restarted in a spare asks for room to
        restore into within a tenth of a second; with the dead process counted it gets too
        little, and a reclaim may act on memory nobody holds."""
        self._reported.pop(lease_id, None)  # the client's figure was for the processes it had
        m = self._swept
        if m is not None and ended:
            freed = {uuid: sum(listed.get(pid) or 0 for pid in ended)
                     for uuid, listed in m.processes.items()}
            self._measured(Sweep(
                [_less_used(g, freed.get(g.uuid, 0)) for g in m.gpus],
                {uuid: {pid: held for pid, held in listed.items() if pid not in ended}
                 for uuid, listed in m.processes.items()},
                m.utilization))
        self._recount(lease_id)

    def _forget_dead(self, now: float) -> None:
        for lease in list(self.ledger.leases.values()):
            if lease.planned_by == KUBELET:
                continue  # it lives as long as its pod does (sync_cluster)
            alive = tuple((pid, start) for pid, start in lease.pids
                          if self._procs.is_alive(pid, start))
            if alive != lease.pids:
                ended = {pid for pid, _ in lease.pids} - {pid for pid, _ in alive}
                lease = self.ledger.set_pids(lease.id, alive)
                self._gone(lease.id, ended)
                if lease.frozen:
                    lease = self._frozen_process_ended(lease)
            if alive:
                if lease.orphan_deadline is not None:
                    self.ledger.update(lease.id, orphan_deadline=None)
                continue
            # The deadline is stored: an agent that keeps restarting still releases orphans
            # (and one restarted with a shorter --orphan-grace honours it).
            deadline = lease.orphan_deadline
            if deadline is None or deadline > now + self.config.orphan_grace:
                deadline = now + self.config.orphan_grace
                lease = self.ledger.update(lease.id, orphan_deadline=deadline)
            if now >= deadline:
                log.info("lease %s: no live process by its orphan deadline, released", lease.id)
                self._release(lease)

    # --- the cluster's pods (Kubernetes) ---------------------------------------------------
    def sync_cluster(self, claims: Mapping[str, WholeGpus]) -> None:
        """A job lease for every GPU a container was given whole (``claims`` by ``namespace/
        pod/container``, from the kubelet), pinned there while the container holds it and
        released when it no longer does; then the notebooks running on those GPUs are moved
        off, or asked to park where no GPU they can reach has room."""
        wanted = {(key, uuid): claim for key, claim in claims.items() for uuid in claim.gpus}
        held = {(lease.name, lease.logical[0]): lease for lease in self.ledger.leases.values()
                if lease.planned_by == KUBELET}
        for (key, uuid), lease in held.items():
            if (key, uuid) not in wanted:
                log.info("lease %s: pod container %s no longer holds %s, released", lease.id, key,
                         self.gpu_label(uuid))
                self._wake()
                self._release(lease)
        new = [(uuid, claim) for (key, uuid), claim in wanted.items() if (key, uuid) not in held]
        unseen = {(claim.key, uuid) for uuid, claim in new if self.gpu(uuid) is None}
        for key, uuid in sorted(unseen - self._unseen_pods):  # said once, not at every look
            log.warning("pod container %s holds %s, which is no GPU this agent sees (%s)", key,
                        uuid, ", ".join(g.uuid for g in self.gpus))
        self._unseen_pods = unseen
        pinned = [(uuid, claim) for uuid, claim in new if (claim.key, uuid) not in unseen]
        if pinned:
            self._wake()
            now = time.time()
            with self.ledger.transaction():
                for uuid, claim in pinned:
                    size = self.gpu(uuid).memory_usable  # type: ignore[union-attr]
                    self.ledger.insert(Lease(
                        id="l-" + secrets.token_hex(6), kind=policy.JOB, owner_uid=0,
                        client=KUBELET, name=claim.key, request=size, limit=size,
                        request_spec="1", limit_spec="1", logical=(uuid,), physical=(uuid,),
                        state="active", created=now, updated=now, planned_by=KUBELET,
                        reason=f"pod container {claim.key} holds {self.gpu_label(uuid)} whole "
                               "(from the kubelet)",
                        pod=(claim.namespace, claim.pod, claim.container)))
                    log.info("pod container %s holds %s whole: a job lease pinned there",
                             claim.key, self.gpu_label(uuid))
        self._evacuate()

    def _pods_gpus(self) -> dict[str, Lease]:
        """GPU -> the lease of the pod container the cluster gave it whole."""
        return {uuid: lease for lease in self.ledger.leases.values()
                if lease.planned_by == KUBELET for uuid in lease.physical}

    def _evacuate(self) -> None:
        """Move notebooks off the GPUs pods hold, re-place what waits for one of them, and ask
        a notebook with nowhere to go to park (once): its guarantee is void there, and reclaim
        takes what it holds as the pod needs it."""
        pods = self._pods_gpus()
        leases = self.ledger.leases
        if not pods:
            self._parks_asked.clear()
            return
        for lease in list(leases.values()):
            if (lease.state == "pending" and not lease.planned_by
                    and set(lease.physical) & set(pods)):
                self._place_again(lease, pods)
        running = [lease for lease in leases.values() if lease.planned_by != KUBELET
                   and lease.state in ("active", "shrinking") and set(lease.physical) & set(pods)]
        self._parks_asked &= {lease.id for lease in running}
        if not running:
            return
        # Only what runs may move: a lease on its way, waiting or stopped stays put here.
        others = [p if leases[p.id].state in ("active", "shrinking")
                  else replace(p, logical=p.physical, fixed=True)
                  for p in self.planning_view() if leases[p.id].planned_by != KUBELET]
        plan = policy.plan_evacuation(self.devices(), others,
                                      {uuid: pod.request for uuid, pod in pods.items()},
                                      self.config.rules)
        to_park = [leases[i] for i in plan.stranded if i not in self._parks_asked
                   and leases[i].state in ("active", "shrinking")]
        if not plan.moves and not to_park:
            return
        self._wake()
        with self.ledger.transaction():
            for lease_id, logical in plan.relocated.items():
                self.ledger.update(lease_id, logical=logical)
            for move in plan.moves:
                pod = pods[next(u for u in move.from_gpus if u in pods)]
                self._start_moves([move], f"make room for pod container {pod.name}, which the "
                                          f"cluster gave {self.gpu_label(pod.physical[0])}")
            for stuck in to_park:
                self._parks_asked.add(stuck.id)
                pod = pods[next(u for u in stuck.physical if u in pods)]
                self._directive(
                    stuck, "park", f"pod container {pod.name} was given "
                    f"{self.gpu_label(pod.physical[0])}, where it runs, and no other GPU it can "
                    "reach has room for it", gpu=stuck.physical[0], request=stuck.request,
                    limit=stuck.limit)
        log.info("pods' GPUs: %d move(s) off, %d notebook(s) asked to park", len(plan.moves),
                 len(to_park))

    def _place_again(self, lease: Lease, pods: Mapping[str, Lease]) -> None:
        """A lease waiting on a GPU a pod was then given: placed anew, or waiting, saying why."""
        try:
            logical, physical, moves = self._place(lease.kind, lease.request, lease.limit,
                                                   lease.devices, self.planning_view(lease.id),
                                                   **self._kept_plan(lease))
        except Conflict as exc:
            pod = pods[next(u for u in lease.physical if u in pods)]
            reason = f"waiting: pod container {pod.name} was given its GPU; {exc.message}"
            if lease.reason != reason:
                self.ledger.update(lease.id, reason=reason)
            return
        self._wake()
        with self.ledger.transaction():
            self.ledger.update(lease.id, logical=logical, physical=physical,
                               reason=self._waiting_reason(moves, lease.owner_uid) if moves else "placed",
                               waits_for=tuple(m.lease_id for m in moves))
            self._start_moves(moves, f"free {self._labels(physical)}", lease)

    # --- views -----------------------------------------------------------------------
    def _context(self, gpu: GpuInfo) -> int:
        """What one process's CUDA context takes on ``gpu``: told, known, or estimated."""
        if self.config.context_size is not None:
            return self.config.context_size
        if gpu.context_size or self.backend.simulated:
            return gpu.context_size
        return CONTEXT_ESTIMATE

    def devices(self) -> list[policy.Device]:
        """GPUs as policy sees them: what processes can hold, less the driver's reserve."""
        return [policy.Device(g.uuid, g.index, g.memory_usable, g.healthy) for g in self.gpus]

    def gpu(self, uuid: str) -> GpuInfo | None:
        return next((g for g in self.gpus if g.uuid == uuid), None)

    def gpu_label(self, uuid: str) -> str:
        gpu = self.gpu(uuid)
        return f"GPU {gpu.index}" if gpu else uuid

    def node(self, caller: Caller | None = None) -> dict[str, Any]:
        """The GPUs, each with the shares running on it: the caller's own (admins: all) by
        lease id, the others without id or owner, so that a user can see why a GPU is full."""
        def share(lease: Lease) -> dict[str, Any]:
            mine = caller is not None and (caller.admin or lease.owner_uid == caller.uid)
            return {"lease": lease.id if mine else None, "kind": lease.kind,
                    "request": lease.request, "usage": lease.usage, "state": lease.state}

        return {
            "backend": self.backend.name,
            "simulated": self.backend.simulated,
            "gpus": [{**g.to_json(), "shares": [share(lease) for lease in self.ledger.leases.values()
                                                if g.uuid in lease.physical]}
                     for g in self.gpus],
            # Compute shares hold only where CUDA MPS runs; elsewhere they are recorded.
            "mps": mps_running(),
            "freezing": self.freezing(),
        }

    def freezing(self) -> dict[str, Any]:
        """Whether this node freezes notebooks (and why not), whether a thaw can land on another
        GPU, and the host memory frozen state takes against its budget."""
        why = ("freezing is turned off on this node (--no-freeze)" if not self.config.freeze
               else "this agent has no way to freeze processes" if self.freezer is None
               else self.freezer.unavailable())
        return {"available": why is None, "why": why,
                "freezer": self.freezer.name if self.freezer is not None else None,
                "remap": why is None and self.config.freeze_remap and self.freezer is not None
                and self.freezer.can_remap(),
                "frozen_bytes": self.frozen_bytes(), "budget": self.freeze_budget()}

    def visible(self, caller: Caller) -> list[Lease]:
        return [
            lease for lease in self.ledger.leases.values()
            if caller.admin or lease.owner_uid == caller.uid
        ]

    def lease(self, caller: Caller, lease_id: str) -> Lease:
        lease = self.ledger.leases.get(lease_id)
        # Someone else's lease is reported as missing: its existence is not theirs to know.
        if lease is None or not (caller.admin or lease.owner_uid == caller.uid):
            raise NotFound("lease", f"no lease {lease_id!r} of yours")
        return lease

    def room(self, lease: Lease) -> int | None:
        """Bytes ``lease`` can add on its GPU now without a reclaim (None: not running on one)."""
        gpu = self.gpu(lease.physical[0]) if lease.physical else None
        if gpu is None or not gpu.healthy or lease.state not in ("active", "shrinking"):
            return None
        on_gpu = [other.placement() for other in self.ledger.leases.values()
                  if gpu.uuid in other.physical and other.state in ("active", "shrinking")]
        device = policy.Device(gpu.uuid, gpu.index, gpu.memory_usable)
        return policy.room(device, on_gpu, lease.id, gpu.memory_used,
                           int(self.config.headroom * gpu.memory_usable))

    def planning_view(self, exclude: str | None = None) -> list[policy.Placement]:
        """Leases as policy should see them: a lease on its way somewhere counts as there."""
        out = []
        for lease in self.ledger.leases.values():
            if lease.id == exclude:
                continue
            p = lease.placement()
            if lease.state == "migrating" and lease.target:
                p = replace(p, physical=lease.target)
            out.append(p)
        return out

    # --- leases ----------------------------------------------------------------------
    def create_lease(self, caller: Caller, ask: CreateLease) -> Lease:
        self._wake()
        held = sum(1 for lease in self.ledger.leases.values() if lease.owner_uid == caller.uid)
        if not caller.admin and held >= self.config.max_leases_per_user:
            raise OverQuota(None, f"you hold {held} leases, the most one user may hold on "
                            "this node; release some (`gpufrac-agent status`)")
        healthy = [g for g in self.gpus if g.healthy]
        if not 1 <= ask.devices <= max(1, len(healthy)):
            raise Refused("devices", f"expected 1 to {len(healthy)} GPUs, got {ask.devices}")
        req, lim = self._resolve_share(ask.request, ask.limit)
        self._check_quota(caller, req, ask.devices)
        compute_request, compute_limit = _compute_share(
            (None, None), ask.compute_request, ask.compute_limit)
        self._check_gpus(ask)

        frozen: tuple[str, ...] = ()
        try:
            logical, physical, moves = self._place(ask.kind, req, lim, ask.devices,
                                                   self.planning_view(), reach=ask.reach,
                                                   logical=ask.logical)
        except Conflict as exc:
            plan = self._room_by_freezing(ask, req) if exc.field == "request" else None
            if plan is None:
                if ask.kind == policy.JOB and exc.field == "request":
                    raise Conflict("request", self._no_way(ask, req, caller.uid)) from exc
                raise
            logical = physical = plan.gpus
            moves, frozen = [], plan.frozen
        # Room the plan counts as made may still be held by leases on their way out.
        leaving = () if moves or frozen else self._leaving(physical, req)
        now = time.time()
        lease = Lease(
            id="l-" + secrets.token_hex(6), kind=ask.kind, owner_uid=caller.uid, client=ask.client,
            kernel_id=ask.kernel_id, name=ask.name, request=req, limit=lim,
            request_spec=str(ask.request), limit_spec=str(ask.limit), logical=logical,
            physical=physical, state="pending" if moves or frozen or leaving else "active",
            created=now, updated=now, reason=self._waiting_reason(moves, caller.uid) if moves else (
                f"waiting for {len(frozen)} notebook(s) on {self._labels(physical)} to be frozen "
                "(their kernels keep everything in host memory and thaw when this job ends)"
                if frozen else f"waiting for {len(leaving)} lease(s) still on "
                f"{self._labels(physical)} to finish leaving it" if leaving else "placed"),
            compute_request=compute_request, compute_limit=compute_limit, devices=ask.devices,
            reach=ask.reach, planned_by=CLUSTER if ask.logical is not None else "",
            waits_for=tuple(m.lease_id for m in moves) + frozen + leaving,
        )
        with self.ledger.transaction():
            self.ledger.insert(lease)
            self._start_moves(moves, f"free {self._labels(physical)}", lease)
            for notebook_id in frozen:
                self._make_way(self.ledger.leases[notebook_id], lease)
        log.info("lease %s (%s, uid %d): request %s on %s, physical %s, %d move(s), %d freeze(s)",
                 lease.id, ask.kind, caller.uid, format_bytes(req), logical, physical, len(moves),
                 len(frozen))
        return self.ledger.leases[lease.id]

    def _leaving(self, physical: tuple[str, ...], req: int) -> tuple[str, ...]:
        """The leases moving or freezing off ``physical`` that a new lease of ``req`` bytes
        there waits for: none where it fits beside everything that still runs there."""
        leases = self.ledger.leases.values()
        capacity = {d.uuid: d.total for d in self.devices()}
        running = policy.physical_load(lease.placement() for lease in leases)
        if all(running.get(u, 0) + req <= capacity.get(u, 0) for u in physical):
            return ()
        return tuple(lease.id for lease in leases if lease.state in ("migrating", "freezing")
                     and set(lease.physical) & set(physical))

    def _check_quota(self, caller: Caller, req: int, devices: int, owner: int | None = None,
                     exclude: str | None = None) -> None:
        """Refuse (OverQuota) a share of ``req`` bytes on each of ``devices`` GPUs that would
        take ``owner``'s leases (the caller's; ``exclude`` not counted: it is being resized)
        past --max-bytes-per-user or --max-gpus-per-user. Admins are not capped."""
        cfg = self.config
        if caller.admin or (cfg.max_bytes_per_user is None and cfg.max_gpus_per_user is None):
            return
        uid = caller.uid if owner is None else owner
        mine = [lease for lease in self.ledger.leases.values()
                if lease.owner_uid == uid and lease.id != exclude]
        held = sum(lease.request * lease.devices for lease in mine)
        asked = req * devices
        if cfg.max_bytes_per_user is not None and held + asked > cfg.max_bytes_per_user:
            raise OverQuota("request", (
                f"max_bytes_per_user: you reserve {format_bytes(held)} in {len(mine)} other "
                f"lease(s); {format_bytes(asked)} more would pass the "
                f"{format_bytes(cfg.max_bytes_per_user)} one user may reserve on this node "
                "(--max-bytes-per-user); ask for less or release some (`gpufrac-agent status`)"))
        if cfg.max_gpus_per_user is not None:
            # A share counts as its part of a GPU (the smallest, as fractions resolve).
            usable = self._smallest_usable()
            gpus = sum(lease.request * lease.devices / usable for lease in mine)
            more = asked / usable
            if gpus + more > cfg.max_gpus_per_user + 1e-9:
                raise OverQuota("devices" if devices > 1 else "request", (
                    f"max_gpus_per_user: you reserve {gpus:.2f} GPU(s) in {len(mine)} other "
                    f"lease(s); {more:.2f} more would pass the {cfg.max_gpus_per_user} one user "
                    "may reserve on this node (--max-gpus-per-user); ask for less or release "
                    "some (`gpufrac-agent status`)"))

    def _room_by_freezing(self, ask: CreateLease, req: int) -> policy.FreezePlan | None:
        """Where a job that finds no room (and no moves that make it) runs once the notebooks
        in its way are frozen: on a one-GPU node, or with every GPU busy, they wait in host
        memory rather than stop it. None for notebooks, the cluster's plans, or no such room."""
        if ask.kind != policy.JOB or ask.logical is not None:
            return None
        devices = [d for d in self.devices() if not ask.reach or d.uuid in ask.reach]
        return policy.plan_freezes(devices, self.planning_view(), req, ask.devices,
                                   self._freezable(), self.config.rules)

    def _freezable(self) -> set[str]:
        """The leases a job may freeze: running notebooks the agent planned (a cluster's plan
        would still count them)."""
        return {lease.id for lease in self.ledger.leases.values() if lease.kind == policy.NOTEBOOK
                and lease.state in ("active", "shrinking") and not lease.planned_by}

    def _make_way(self, notebook: Lease, job: Lease) -> None:
        """Freeze ``notebook`` so that ``job`` can run where it runs; where freezing cannot be
        used, its client is asked to park it (a checkpoint, and a restart without a GPU)."""
        where = self._labels(g for g in notebook.physical if g in job.physical)
        whose = self._whose(job, notebook.owner_uid)
        whole = job.request >= min((g.memory_usable for g in self.gpus
                                    if g.uuid in job.physical), default=0)
        needs = f"{whose} needs {where} whole" if whole else f"{whose} needs room on {where}"
        blocker = self.freeze_blocker(notebook)

        def park_instead(current: Lease, why: str) -> None:
            if current.state not in ("active", "shrinking"):
                return
            self._directive(current, "park", f"{needs}, and freezing could not be used: {why}",
                            gpu=current.physical[0] if current.physical else None,
                            request=current.request, limit=current.limit)

        if blocker is not None:
            self.stats.freeze_fell_back("job")
            park_instead(notebook, blocker)
            return
        self._start_freeze(notebook, f"frozen because {needs}: its process and variables wait "
                           "in host memory (a running cell waits too), and it thaws when the "
                           "job ends", "pending", "job", park_instead)

    def _smallest_usable(self) -> int:
        """What fractions resolve against: the smallest healthy GPU's usable memory."""
        healthy = [g.memory_usable for g in self.gpus if g.healthy]
        if not healthy:
            raise Conflict(None, "this node has no healthy GPU to place a lease on")
        return min(healthy)

    def _resolve_share(self, request: Quantity, limit: Quantity) -> tuple[int, int]:
        """Request and limit in bytes; fractions resolve against the smallest healthy GPU's
        usable memory, so a lease fits wherever it lands. A share counts its process's CUDA
        context, as NVML does: a request smaller than a context could never be kept."""
        healthy = [g for g in self.gpus if g.healthy]
        try:
            req, lim = check_share(request, limit, self._smallest_usable())
        except QuantityError as exc:
            raise Refused(exc.field, exc.message) from exc
        if req < MIN_SHARE:
            raise Refused("request", f"{format_bytes(req)} is too small to hold anything; "
                          f"ask for at least {format_bytes(MIN_SHARE)}")
        context = max(g.context_size for g in healthy)
        if req < context:
            raise Refused("request", f"{format_bytes(req)} is less than the "
                          f"{format_bytes(context)} a CUDA context takes on this node's GPUs; "
                          f"ask for at least {format_bytes(context)} (a share counts its context)")
        return req, lim

    def _check_gpus(self, ask: CreateLease) -> None:
        """The GPUs a lease names are this node's, its logical ones healthy and reachable."""
        for name, uuids in (("reachable_gpus", ask.reach), ("logical_gpus", ask.logical or ())):
            for uuid in uuids:
                gpu = self.gpu(uuid)
                if gpu is None:
                    known = ", ".join(g.uuid for g in self.gpus)
                    raise Refused(name, f"{uuid} is not a GPU of this node; it has {known}")
                if name == "logical_gpus" and not gpu.healthy:
                    # Not the caller's mistake: the lease waits, as for room.
                    raise Conflict(name, f"the cluster's plan puts it on {self.gpu_label(uuid)}, "
                                         f"which is not usable now: {gpu.error}")
        if ask.reach and len(ask.reach) < ask.devices:
            raise Refused("reachable_gpus", f"names {len(ask.reach)} GPU(s), fewer than the "
                                            f"{ask.devices} asked for")
        if ask.logical is not None:
            if len(ask.logical) != ask.devices:
                raise Refused("logical_gpus", f"expected {ask.devices} GPU(s), one per device, "
                                              f"got {len(ask.logical)}")
            unreachable = set(ask.logical) - set(ask.reach) if ask.reach else set()
            if unreachable:
                raise Refused("reachable_gpus", "must include the logical GPUs, where the lease "
                                                f"moves back to; {sorted(unreachable)} are not")

    def _place(self, kind: str, req: int, lim: int, count: int, others: list[policy.Placement],
               *, reach: tuple[str, ...] = (), logical: tuple[str, ...] | None = None
               ) -> tuple[tuple[str, ...], tuple[str, ...], list[policy.Move]]:
        """Where a lease of ``req`` bytes on ``count`` GPUs goes: its logical GPUs (planned, or
        the cluster's ``logical`` where they have room), the ones it runs on among those it can
        ``reach``, and the moves that make room there."""
        devices = self.devices()
        rules = self.config.rules
        if logical is not None:
            planned = [d for d in devices if d.uuid in logical]
            if policy.plan_logical(planned, others, req, count, rules) is None:
                raise Conflict(
                    "logical_gpus",
                    f"the cluster's plan puts it on {self._labels(logical)}, which has no room for "
                    f"{format_bytes(req)} more in this node's plan (leases the cluster does not "
                    "know of hold it: gpufrac-agent status shows them)")
            return self._run_where(kind, req, lim, logical, others, reach)
        # Planned only where its processes can run: it moves back there when room is needed.
        devices = [d for d in devices if not reach or d.uuid in reach]
        logical = policy.plan_logical(devices, others, req, count, rules)
        if logical is None:
            if policy.plan_logical(devices, others, req, count) is not None:
                raise Conflict(
                    "request",
                    f"every GPU with room already runs {rules.max_per_gpu} lease(s), the most "
                    "this node allows (--max-workloads-per-gpu); wait for leases to end "
                    "(gpufrac-agent status shows them)")
            load = policy.logical_load(others)
            best = max((d.total - load.get(d.uuid, 0) for d in devices if d.healthy), default=0)
            raise Conflict(
                "request",
                f"no GPU has room for {format_bytes(req)} more; the most any GPU can still "
                f"guarantee is {format_bytes(best)}. Ask for less, or wait for leases to end "
                "(gpufrac-agent status shows them)",
            )
        return self._run_where(kind, req, lim, logical, others, reach)

    def _run_where(self, kind: str, req: int, lim: int, logical: tuple[str, ...],
                   others: list[policy.Placement], reach: tuple[str, ...]
                   ) -> tuple[tuple[str, ...], tuple[str, ...], list[policy.Move]]:
        devices = self.devices()
        rules = self.config.rules
        reachable = [d for d in devices if not reach or d.uuid in reach]
        physical = policy.plan_physical(reachable, others, kind, req, logical, lim, rules)
        moves = policy.plan_compaction(devices, others, {u: req for u in physical}, rules)
        if moves is None:
            raise Conflict("request", "no set of moves makes room; try again shortly")
        return logical, physical, moves

    @staticmethod
    def _describe(lease: Lease) -> str:
        """``job "python train.py" (l-…)``: what a person recognises, and the id to look up.
        For the lease's own user only: to another it is ``another user's job`` (`_whose`)."""
        name = lease.name
        if len(name) > 40:
            # A notebook's name is its path: its end says which notebook; a job's command
            # line says what it is at its start.
            name = "…" + name[-39:] if lease.kind == policy.NOTEBOOK else name[:39] + "…"
        # Quoted as JSON: a quote or a newline in a name cannot end the sentence around it.
        quoted = json.dumps(name, ensure_ascii=False)
        return f"{lease.kind} {quoted} ({lease.id})" if name else f"{lease.kind} {lease.id}"

    def _whose(self, lease: Lease, reader_uid: int) -> str:
        """``lease`` as the user ``reader_uid`` may read of it: their own by name and id,
        another user's without either (text one user chose is never prose to another)."""
        if lease.owner_uid == reader_uid:
            return self._describe(lease)
        return f"another user's {lease.kind}"

    def _labels(self, uuids: Iterable[str]) -> str:
        return ", ".join(self.gpu_label(u) for u in uuids)

    def _waiting_reason(self, moves: list[policy.Move], owner_uid: int) -> str:
        """What a lease of ``owner_uid`` waits for, for its user: their own notebooks by name and id, other
        users' counted per GPU (neither ids nor names of theirs)."""
        parts: list[str] = []
        others: Counter[str] = Counter()
        for move in moves:
            moved = self.ledger.leases.get(move.lease_id)
            where = self._labels(move.from_gpus)
            if moved is not None and moved.owner_uid == owner_uid:
                parts.append(f"{self._describe(moved)} from {where}")
            else:
                others[where] += 1
        parts += [f"another user's notebook from {where}" if n == 1
                  else f"{n} other users' notebooks from {where}" for where, n in others.items()]
        return f"waiting for {len(moves)} notebook(s) to move: " + ", ".join(parts)

    def waiting_for(self, lease: Lease, reader_uid: int) -> list[dict[str, Any]]:
        """What a pending ``lease`` waits for, for the user ``reader_uid``: each lease its plan
        moves, freezes or parks that still runs on its GPUs — who (`_whose`), where, what is
        done to it (``moving``, ``freezing`` or ``parking``: its client was asked to, once its
        kernel is idle) and ``deadline``, when a move is cut off at the latest (None: nothing
        is timed). Empty for a lease that waits for nothing in particular."""
        if lease.state != "pending":
            return []
        out = []
        for other_id in lease.waits_for:
            other = self.ledger.leases.get(other_id)
            here = [g for g in other.physical if g in lease.physical] if other else []
            if other is None or not here:
                continue  # released, moved, frozen or parked: its room is made
            action = {"migrating": "moving", "freezing": "freezing"}.get(other.state, "parking")
            out.append({
                "who": self._whose(other, reader_uid), "kind": other.kind,
                "gpu": self._labels(here), "action": action,
                "to": self._labels(other.target) if action == "moving" else None,
                "deadline": other.deadline if action == "moving" else None,
            })
        return out

    def _start_moves(self, moves: list[policy.Move], why: str, cause: Lease | None = None
                     ) -> None:
        """Move each of ``moves`` to ``why`` (``for`` ``cause``, named as its user may read)."""
        deadline = time.time() + self.config.migrate_grace
        for move in moves:
            lease = self.ledger.leases[move.lease_id]
            whom = "" if cause is None else f" for {self._whose(cause, lease.owner_uid)}"
            reason = (f"moved from {self._labels(move.from_gpus)} to {self._labels(move.to_gpus)} "
                      f"to {why}{whom}")
            lease = self.ledger.update(
                lease.id, state="migrating", target=move.to_gpus, deadline=deadline, reason=reason
            )
            self._move(lease, reason, moved_bytes=move.moved_bytes)
            self.counters["migrations"] += 1
            self.stats.move_started(lease.id, "compaction")

    def resize(self, caller: Caller, lease_id: str, change: Resize) -> Lease:
        self._wake()
        lease = self.lease(caller, lease_id)
        if lease.state not in ("active", "shrinking"):
            raise Conflict("lease", f"lease is {lease.state}; change it once it is active")
        request = change.request or parse_quantity(lease.request_spec, "request")
        limit = change.limit or parse_quantity(lease.limit_spec, "limit")
        if change.limit is None:
            # The limit stays as it was, unless the new request is above it: then it rises
            # to the request (a limit below the request would be refused).
            usable = self._smallest_usable()
            if limit.bytes_of(usable) < request.bytes_of(usable):
                limit = request
        req, lim = self._resolve_share(request, limit)
        self._check_quota(caller, req, lease.devices, lease.owner_uid, exclude=lease.id)
        others = self.planning_view(exclude=lease.id)
        compute_request, compute_limit = _compute_share(
            (lease.compute_request, lease.compute_limit), change.compute_request,
            change.compute_limit)
        changes = {"request": req, "limit": lim, "request_spec": str(request),
                   "limit_spec": str(limit), "compute_request": compute_request,
                   "compute_limit": compute_limit}
        # Whoever follows the lease (the Jupyter server) hears of the change as it happens.
        notice = {"request_spec": changes["request_spec"], "limit_spec": changes["limit_spec"],
                  "request": req, "limit": lim}
        said = f"request {format_bytes(req)}, limit {format_bytes(lim)}"
        if policy.fits_in_place(self.devices(), others,
                                replace(lease.placement(), request=req, limit=lim)):
            with self.ledger.transaction():
                lease = self.ledger.update(lease.id, **changes, reason="request changed in place")
                self._directive(lease, "resized", said, **notice)
            return lease
        logical, physical, moves = self._place(lease.kind, req, lim, len(lease.logical), others,
                                               **self._kept_plan(lease))
        if physical == lease.physical:
            # It stays; whatever must make room moves, and it is told nothing (there is
            # nothing for it to do).
            with self.ledger.transaction():
                self._start_moves(moves, "make room", lease)
                lease = self.ledger.update(
                    lease.id, **changes, logical=logical,
                    reason="request changed; it stays where it runs"
                    + (f" and {len(moves)} other lease(s) move to make room" if moves else ""))
                self._directive(lease, "resized", said, **notice)
            return lease
        reason = (f"moved from {self._labels(lease.physical)} to {self._labels(physical)} "
                  f"because its request changed to {format_bytes(req)}")
        with self.ledger.transaction():
            self._start_moves(moves, "make room", lease)
            deadline = time.time() + self.config.migrate_grace
            lease = self.ledger.update(lease.id, **changes, logical=logical, target=physical,
                                       state="migrating", deadline=deadline, reason=reason)
            self.stats.move_started(lease.id, "request_changed")
            self._directive(lease, "resized", said, **notice)
            self._move(lease, reason, cause="request_changed")
        return lease

    def _move(self, lease: Lease, reason: str, **body: Any) -> None:
        """Carry out the move of a ``migrating`` lease to its target: freeze and thaw it there
        where the driver can remap (nothing restarts), else ask its client to (``migrate``:
        a checkpoint and a restart on the target)."""
        blocker = self.freeze_blocker(lease) or self._remap_blocker(lease, lease.target)
        if blocker is None:
            self._act(lease.id, self._frozen_move(lease.id, reason, body))
            return
        self._directive(lease, "migrate", reason, from_gpu=lease.physical[0],
                        to_gpu=lease.target[0], deadline=lease.deadline, **body)

    def release(self, caller: Caller, lease_id: str) -> None:
        self._wake()
        self._release(self.lease(caller, lease_id))

    def _release(self, lease: Lease) -> None:
        self.ledger.delete(lease.id)
        self._thaw_asked.pop(lease.id, None)
        self.stats.move_ended(lease.id, RELEASED)  # a no-op unless it was on its way
        self._reported.pop(lease.id, None)
        self._bursting_said.pop(lease.id, None)
        self._activate_pending()

    def register_pid(self, caller: Caller, lease_id: str, pid: int) -> Lease:
        self._wake()
        lease = self.lease(caller, lease_id)
        asked = pid
        if caller.pid is not None:
            # The caller's number for it: a kernel in a container has another here.
            found = procs.as_seen_here(caller.pid, pid)
            if found is None:
                raise Refused("pid", f"no process {pid} in your PID namespace is visible to the "
                                     "agent (on Kubernetes it needs hostPID: true)")
            pid = found
        ident = procs.identify(pid)
        if ident is None:
            raise Refused("pid", f"no running process {asked}")
        if caller.uid != 0 and ident.uid != caller.uid:
            # Only your own processes: the agent may kill what is registered.
            raise NotYours("pid", f"process {asked} is not yours")
        for other in self.ledger.leases.values():
            if other.id != lease.id and any(p == (pid, ident.start_time) for p in other.pids):
                # One process, one lease: otherwise its memory counts twice.
                held = other.id if caller.admin or other.owner_uid == caller.uid else (
                    "of another user")
                raise Conflict("pid", f"process {asked} is already registered to lease {held}")
        pids = tuple(p for p in lease.pids if p[0] != pid and procs.is_alive(*p))
        ended = {p for p, _ in lease.pids} - {p for p, _ in pids} - {pid}
        now = time.time()
        changes: dict[str, Any] = {"orphan_deadline": None, "registered": lease.registered or now}
        # Metrics and status name the pod container it runs in (on Kubernetes).
        container = cgroups.container_of(pid, self.config.container_logs)
        if container is not None:
            changes["pod"] = (container.namespace, container.pod, container.container)
        if lease.kind == policy.NOTEBOOK and (
            lease.registered is not None or lease.state in ("killed", "migrating")
        ):
            # A kernel that comes back (a restart, a move) restores what it held: a grace.
            changes["restore_until"] = now + self.config.restore_grace
        if lease.state == "killed":
            changes.update(state="active", reason="restarted after it was killed")
        with self.ledger.transaction():
            lease = self.ledger.set_pids(lease.id, (*pids, (pid, ident.start_time)))
            lease = self.ledger.update(lease.id, **changes)
        if ended:
            # A restart: the new process starts from what it holds, not what the old one held.
            self._gone(lease.id, ended)
        self._track(lease, pid)
        return self.ledger.leases[lease.id]

    def _track(self, lease: Lease, pid: int) -> None:
        where = lease.target if lease.state == "migrating" and lease.target else lease.physical
        if not where:
            return  # parked, or waiting for a GPU: its process uses none
        try:
            self.backend.track(pid, where[0])
        except DeviceError as exc:
            log.warning("lease %s: cannot follow pid %d on %s: %s", lease.id, pid, where[0], exc)

    def report_usage(self, caller: Caller, lease_id: str, used: int) -> None:
        """What a client says its processes hold, where the backend cannot see them."""
        self._wake()
        lease = self.lease(caller, lease_id)
        if lease.physical:  # a lease with no GPU (parked) holds no device memory
            # Bounded here too (the API refuses more): the ledger and /metrics store it.
            self._reported[lease.id] = max(0, min(used, MAX_COUNT))

    def observe(self, caller: Caller, lease_id: str, seen: Observation) -> None:
        """A checkpoint or an offload a lease's kernel made, counted for /metrics."""
        self.lease(caller, lease_id)  # the caller's own lease (or an admin's): else 403/404
        self.stats.observed(seen)

    def migrated(self, caller: Caller, lease_id: str) -> Lease:
        self._wake()
        lease = self.lease(caller, lease_id)
        if lease.state != "migrating":
            raise Conflict("lease", f"lease is {lease.state}, not migrating")
        with self.ledger.transaction():
            lease = self.ledger.update(
                lease.id, state="active", physical=lease.target, target=(), deadline=None,
                reason=lease.reason, restore_until=time.time() + self.config.restore_grace,
            )
            for pid, _ in lease.pids:
                self._track(lease, pid)
        # Its usage is what it holds on the GPU it runs on now: what it held on the one it
        # left (an old process still ending there) is not its to count here.
        self._recount(lease.id)
        self.stats.move_ended(lease.id, MIGRATED)
        self._activate_pending()
        return self.ledger.leases[lease.id]

    # --- parking -----------------------------------------------------------------------
    def park(self, caller: Caller, lease_id: str, reason: str | None = None) -> Lease:
        """The client restarts the lease's kernel with no GPU (an idle kernel, or a wait for
        one cancelled): the lease gives its memory back at once, and what waited for it may run."""
        self._wake()
        lease = self.lease(caller, lease_id)
        self._notebook_only(lease)
        if lease.state == "parked":
            return lease
        if lease.state not in PARKABLE:
            raise Conflict("lease", f"lease is {lease.state}: {_NOT_NOW[lease.state]}")
        # The cluster's plan holds while it is parked (the cluster still counts it there).
        lease = self.ledger.update(
            lease.id, state="parked", logical=lease.logical if lease.planned_by else (),
            physical=(), target=(), deadline=None,
            parked_at=time.time(),
            reason=reason or "parked: its idle kernel gave the GPU back; its next cell gets one "
                             "first")
        # Its process keeps its variables in host memory from now on: none of it is device
        # memory, and what its processes held leaves the GPU's use now, not at the next sweep.
        for pid, _ in lease.pids:
            self.backend.untrack(pid)
        self._gone(lease.id, {pid for pid, _ in lease.pids})
        self.stats.parked(lease.id)
        log.info("lease %s parked: %s", lease.id, lease.reason)
        self._activate_pending()
        return self.ledger.leases[lease.id]

    def park_request(self, caller: Caller, lease_id: str) -> Lease:
        """The kernel asks to be parked (``%gpu park``): its client, who restarts kernels, is
        asked to with a ``park`` directive, and parks it with :meth:`park`."""
        self._wake()
        lease = self.lease(caller, lease_id)
        self._notebook_only(lease)
        if lease.state not in ("active", "shrinking"):
            raise Conflict("lease", f"lease is {lease.state}: {_NOT_NOW[lease.state]}")
        self._directive(lease, "park", "parked at its user's request (`%gpu park`)",
                        gpu=lease.physical[0], request=lease.request, limit=lease.limit)
        return lease

    def unpark(self, caller: Caller, lease_id: str) -> Lease:
        """A parked lease's kernel needs a GPU (its next cell): placed as a new notebook is, or
        left pending, saying why, until the agent can place it."""
        self._wake()
        lease = self.lease(caller, lease_id)
        if lease.frozen:
            self._thaw_asked.setdefault(lease.id, time.monotonic())
        if lease.state != "parked":
            return lease  # it has a GPU, or waits for one already
        self.stats.unpark_asked(lease.id)
        lease = self._place_waiting(lease, AT_ONCE)
        if lease.state == "pending":
            self.stats.unpark_waited()
        return lease

    @staticmethod
    def _kept_plan(lease: Lease) -> dict[str, Any]:
        """What placing ``lease`` again keeps: the GPUs it can reach, the cluster's plan."""
        return {"reach": lease.reach, "logical": lease.logical if lease.planned_by else None}

    @staticmethod
    def _notebook_only(lease: Lease) -> None:
        if lease.kind != policy.NOTEBOOK:
            raise Conflict("lease", f"lease is a {lease.kind}: only notebook leases park (a job "
                                    "holds its GPUs until it ends)")

    def _place_waiting(self, lease: Lease, how: str) -> Lease:
        """Places a lease that has no GPU (it was parked) as a new notebook is placed: active
        where a GPU has room, pending while notebooks move to make room, or pending with the
        reason in words while no GPU has room (``how``: AT_ONCE or AFTER_WAIT, for /metrics).

        A frozen lease that nobody waits for thaws where it was frozen (or where the driver can
        remap it): elsewhere it would restart. Once a cell waits, any GPU with room will do."""
        kept = self._kept_plan(lease)
        others = self.planning_view(lease.id)
        try:
            if lease.frozen and self._remap_blocker(lease, lease.frozen_on) is not None:
                try:
                    placed = self._place(lease.kind, lease.request, lease.limit, lease.devices,
                                         others, **{**kept, "reach": lease.frozen_on})
                except Conflict:
                    if lease.id not in self._thaw_asked:
                        raise
                    placed = self._place(lease.kind, lease.request, lease.limit,
                                         lease.devices, others, **kept)
            else:
                placed = self._place(lease.kind, lease.request, lease.limit, lease.devices,
                                     others, **kept)
            logical, physical, moves = placed
        except Conflict:
            reason = self._no_room_reason(lease)
            if lease.frozen:
                reason = f"frozen in host memory, {reason}"
            if (lease.state, lease.reason) == ("pending", reason):
                return lease  # nothing new to say: no write
            return self.ledger.update(lease.id, state="pending", reason=reason)
        if not moves:
            return self._unparked(lease, logical, physical, how)
        with self.ledger.transaction():
            lease = self.ledger.update(lease.id, state="pending", logical=logical,
                                       physical=physical, reason=self._waiting_reason(moves, lease.owner_uid),
                                       waits_for=tuple(m.lease_id for m in moves))
            self._start_moves(moves, f"free {self._labels(physical)}", lease)
        return lease

    def _unparked(self, lease: Lease, logical: tuple[str, ...], physical: tuple[str, ...],
                  how: str) -> Lease:
        """A lease that was parked runs on ``physical`` again: its processes are followed there
        and its client told, with what it may hold (a frozen one once it is thawed)."""
        if lease.frozen:
            return self._start_thaw(lease, logical, physical, how)
        reason = f"unparked: placed on {self._labels(physical)}" + (
            "" if how == AT_ONCE else " once room appeared")
        with self.ledger.transaction():
            # Its kernel brings back what it held in host memory: a grace, as after a move.
            lease = self.ledger.update(
                lease.id, state="active", logical=logical, physical=physical, parked_at=None,
                reason=reason, restore_until=time.time() + self.config.restore_grace)
            self._directive(lease, "unparked", reason, gpu=physical[0], gpus=list(physical),
                            request=lease.request, limit=lease.limit)
        for pid, _ in lease.pids:
            self._track(lease, pid)
        self.stats.unparked(how, lease.id)
        log.info("lease %s %s", lease.id, reason)
        return lease

    def _no_room_reason(self, lease: Lease) -> str:
        """Why no GPU takes ``lease`` now, GPU by GPU, in words its user understands."""
        need = format_bytes(lease.request)
        rules = self.config.rules
        short = policy.shortfalls(self.devices(), self.planning_view(), lease.request, rules)
        if len(self.gpus) - len(short) >= lease.devices:
            # The plan has room, but the notebooks spread over it cannot all move back yet.
            return f"waiting for a GPU: no set of moves makes room for its request of {need} yet"

        where = "no GPU has" if lease.devices == 1 else f"fewer than {lease.devices} GPUs have"
        return (f"waiting for a GPU: {where} {need} free for its request: "
                + (", ".join(self._shortfall(s, lease.owner_uid, "has") for s in short)
                   or "this node lists no GPU"))

    def _shortfall(self, s: policy.Shortfall, reader_uid: int, free: str) -> str:
        """Why GPU ``s`` cannot take a lease, for the user ``reader_uid``; ``free`` says how
        its free memory is meant (``has``, ``can free only``)."""
        label = f"GPU {s.index}"
        if not s.healthy:
            return f"{label} is unhealthy"
        if s.whole is not None:
            # Another user's job is named no more than `node` names it: not whose it is.
            return f"{label} is held whole by {self._whose(self.ledger.leases[s.whole], reader_uid)}"
        if s.full:
            return (f"{label} already runs {self.config.rules.max_per_gpu} lease(s), the most "
                    "this node allows")
        return f"{label} {free} {format_bytes(s.free)}"

    def _no_way(self, ask: CreateLease, req: int, owner_uid: int) -> str:
        """Why nothing the agent may do (move, freeze or park notebooks) makes room for a job
        now, GPU by GPU as if every notebook it may freeze were frozen, and what its user can
        do instead: never to wait, since nobody waits for it."""
        movable = self._freezable()
        fixed = [p for p in self.planning_view() if p.id not in movable]
        devices = [d for d in self.devices() if not ask.reach or d.uuid in ask.reach]
        short = policy.shortfalls(devices, fixed, req, self.config.rules)
        gpus = "a GPU" if ask.devices == 1 else f"{ask.devices} GPUs"
        why = ("; ".join(self._shortfall(s, owner_uid, "can free only") for s in short)
               or "leases it cannot touch now (moving, freezing or thawing) still run there")
        return (f"nothing this agent may move, freeze or park makes room for {format_bytes(req)} "
                f"on {gpus}: {why}. "
                "Jobs, and notebooks the cluster placed, are never moved or frozen. Run it again "
                "once they end (`gpufrac-agent status` shows them), or ask for less")

    # --- freezing ----------------------------------------------------------------------
    def freeze_blocker(self, lease: Lease) -> str | None:
        """Why ``lease``'s processes cannot be frozen now (None: they can), in words its user
        reads beside the fallback (a checkpoint on disk and a restart)."""
        if not self.config.freeze:
            return "freezing is turned off on this node (--no-freeze)"
        if self.freezer is None:
            return "this agent has no way to freeze processes"
        why = self.freezer.unavailable()
        if why:
            return why
        if lease.kind != policy.NOTEBOOK or lease.planned_by == KUBELET:
            return "only notebooks are frozen"
        if not lease.pids:
            return "its kernel has no registered process"
        if self._children.get(lease.id):
            return ("a process its kernel started uses the GPU too (a DataLoader worker, a "
                    "subprocess), which the driver cannot freeze with it")
        if mps_running():
            return "CUDA MPS runs on this node, and the driver cannot freeze its clients"
        budget = self.freeze_budget()
        frozen = self.frozen_bytes()
        if frozen + lease.usage > budget:
            return (f"host memory for frozen kernels is used up ({format_bytes(frozen)} of "
                    f"{format_bytes(budget)} frozen; it holds {format_bytes(lease.usage)})")
        available = procs.memory_available()
        if available is not None and lease.usage > available:
            return (f"the host has {format_bytes(available)} of memory available, less than "
                    f"the {format_bytes(lease.usage)} it holds on the GPU")
        return None

    def freeze_budget(self) -> int:
        """Bytes of host memory frozen GPU state may take on this node."""
        if self.config.freeze_budget is not None:
            return self.config.freeze_budget
        return int(procs.memory_total() * self.config.freeze_budget_share)

    def frozen_bytes(self) -> int:
        """Host memory taken by frozen GPU state, and by the freezes under way."""
        return sum(lease.frozen_bytes if lease.frozen else lease.usage
                   for lease in self.ledger.leases.values()
                   if lease.frozen or lease.state == "freezing")

    async def freeze(self, caller: Caller, lease_id: str, reason: str | None = None) -> Lease:
        """Park a notebook by freezing its processes (its client asks, e.g. for an idle
        kernel): the lease gives its GPU back and its kernel keeps everything; its next cell
        thaws it. Conflict says why freezing cannot be used, for the client's fallback."""
        self._wake()
        lease = self.lease(caller, lease_id)
        self._notebook_only(lease)
        if lease.state == "parked":
            return lease
        if lease.state not in ("active", "shrinking"):
            raise Conflict("lease", f"lease is {lease.state}: "
                           + _NOT_NOW.get(lease.state, "a freeze or thaw is under way"))
        blocker = self.freeze_blocker(lease)
        if blocker is not None:
            self.ledger.update(lease.id, fallback=blocker)
            self.stats.freeze_fell_back("park")
            raise Conflict("freeze", blocker)
        failed = await self._act(lease.id, self._freeze(
            lease.id, reason or "parked: its idle kernel was frozen; its next cell thaws it",
            then="parked", cause="park"))
        if failed:
            self.stats.freeze_fell_back("park")
            raise Conflict("freeze", failed)
        return self.ledger.leases[lease.id]

    def _act(self, lease_id: str, work: Awaitable[T]) -> asyncio.Future[T]:
        """Run a freeze or thaw of ``lease_id`` as a task the agent waits for when it stops."""
        task = asyncio.ensure_future(work)
        self._acting[lease_id] = task

        def done(_: object) -> None:
            if self._acting.get(lease_id) is task:
                del self._acting[lease_id]
            if not task.cancelled() and task.exception() is not None:
                log.error("lease %s: freeze or thaw failed", lease_id,
                          exc_info=task.exception())

        task.add_done_callback(done)
        return task

    def _start_freeze(self, lease: Lease, reason: str, then: str, cause: str,
                      fallback: Callable[[Lease, str], None]) -> None:
        """Freeze ``lease`` in the background; ``fallback(lease, why)`` where that fails."""
        async def work() -> None:
            failed = await self._freeze(lease.id, reason, then, cause)
            current = self.ledger.leases.get(lease.id)
            if failed and current is not None:
                self.stats.freeze_fell_back(cause)
                fallback(current, failed)
        self.ledger.update(lease.id, state="freezing", reason=f"freezing: {reason}")
        self._act(lease.id, work())

    async def _freeze(self, lease_id: str, reason: str, then: str, cause: str) -> str | None:
        """Freeze the lease's processes; then it is ``then`` (``parked``: its next cell thaws it;
        ``pending``: it thaws once a GPU has room) with no GPU. Returns why it failed (None:
        frozen); a failure leaves it running as it was."""
        lease = self.ledger.leases[lease_id]
        before = lease.state if lease.state in ("active", "shrinking") else "active"
        if lease.state != "freezing":
            lease = self.ledger.update(lease_id, state="freezing", reason=f"freezing: {reason}")
        pids = [pid for pid, _ in lease.pids]
        started = time.monotonic()
        loop = asyncio.get_running_loop()
        failed = await loop.run_in_executor(None, self._freeze_all, pids)
        lease = self.ledger.leases.get(lease_id)  # type: ignore[assignment]
        if lease is None:  # released meanwhile: its processes must not stay frozen
            if failed is None:
                await loop.run_in_executor(None, self._thaw_all, pids, None)
            return "its lease was released during the freeze"
        if failed is not None:
            log.warning("lease %s: freeze failed: %s", lease_id, failed)
            self.ledger.update(lease_id, state=before, fallback=failed,
                               reason=lease.reason.removeprefix("freezing: "))
            return failed
        seconds = time.monotonic() - started
        now = time.time()
        held = lease.usage
        with self.ledger.transaction():
            lease = self.ledger.update(
                lease_id, state=then, frozen_at=now, frozen_bytes=held, frozen_on=lease.physical,
                physical=(), logical=lease.logical if lease.planned_by else (), target=(),
                deadline=None, parked_at=now, reason=reason, fallback="")
            self._directive(lease, "frozen", reason, gpu=lease.frozen_on[0], gpus=list(
                lease.frozen_on), frozen_bytes=held, seconds=round(seconds, 3),
                waiting=then == "pending", cause=cause, request=lease.request,
                limit=lease.limit)
        for pid in pids:
            self.backend.untrack(pid)
        self._gone(lease_id, set(pids))
        self.counters["freezes"] += 1
        self.stats.frozen(cause, seconds)
        self.stats.parked(lease_id)
        log.info("lease %s frozen in %.2fs (%s): %s", lease_id, seconds, format_bytes(held),
                 reason)
        self._activate_pending()
        return None

    def _freeze_all(self, pids: Sequence[int]) -> str | None:
        """Freeze each process (retrying a lock that timed out); on a failure the ones frozen
        are thawed again, and the reason returned. Runs in a worker thread."""
        assert self.freezer is not None
        done: list[int] = []
        for pid in pids:
            for attempt in range(1, self.config.freeze_attempts + 1):
                try:
                    self.freezer.freeze(pid, lock_timeout=self.config.freeze_lock_timeout)
                    done.append(pid)
                    break
                except FreezeError as exc:
                    if exc.retry and attempt < self.config.freeze_attempts:
                        continue
                    self._thaw_all(done, None)
                    tries = f" after {attempt} tries" if attempt > 1 else ""
                    return f"the driver did not freeze process {pid}{tries}: {exc}"
        return None

    def _thaw_all(self, pids: Sequence[int], remap: Mapping[str, str] | None) -> str | None:
        """Thaw each process still frozen; returns why one could not be (None: all run).
        Runs in a worker thread."""
        assert self.freezer is not None
        for pid in pids:
            try:
                if self.freezer.state(pid) == RUNNING:
                    continue  # thawed already (a thaw that raced this one, or never frozen)
                self.freezer.thaw(pid, remap)
            except FreezeError as exc:
                return f"the driver did not thaw process {pid}: {exc}"
        return None

    def _thaw_room(self, lease: Lease, physical: tuple[str, ...]) -> str | None:
        """Why ``lease`` cannot thaw onto ``physical`` now (None: it can): each GPU must have
        what it froze free beside what other notebooks are owed there and what other thaws
        bring back. A restore that runs out of memory can wedge the process for good."""
        for uuid in physical:
            gpu = self.gpu(uuid)
            if gpu is None or not gpu.healthy:
                return f"{self.gpu_label(uuid)} is not usable"
            here = [other for other in self.ledger.leases.values()
                    if other.id != lease.id and uuid in other.physical]
            coming = sum(other.frozen_bytes for other in here if other.state == "thawing")
            owed = sum(max(0, o.request - o.usage) for o in here
                       if o.state in ("active", "shrinking"))
            headroom = int(self.config.headroom * gpu.memory_usable)
            free = gpu.memory_free - coming - min(owed, headroom)
            if free < lease.frozen_bytes:
                return f"{self.gpu_label(uuid)} has {format_bytes(max(0, free))} free"
        return None

    def _start_thaw(self, lease: Lease, logical: tuple[str, ...], physical: tuple[str, ...],
                    how: str) -> Lease:
        """A frozen lease was placed on ``physical``: thaw it there once the GPU has room for
        what it froze (it waits for that without a GPU); onto another GPU where the driver can
        remap, else its kernel restarts there from its last good checkpoint."""
        short = self._thaw_room(lease, physical)
        asked = self._thaw_asked.get(lease.id)
        if short is not None and asked is not None and (
                time.monotonic() - asked >= self.config.thaw_wait):
            # Its request has room (it was placed): a restart within it beats waiting on.
            self._thaw_asked.pop(lease.id, None)
            lease = self.ledger.update(lease.id, logical=logical, physical=physical,
                                       fallback=f"no room to thaw within "
                                                f"{format_duration(self.config.thaw_wait)}")
            self._kill(lease, f"restarted on {self._labels(physical)} from its last good "
                       f"checkpoint: a cell waited {format_duration(self.config.thaw_wait)} for "
                       f"room to thaw the {format_bytes(lease.frozen_bytes)} it froze ({short}); "
                       "it comes back within its request, and what does not fit waits on disk "
                       "(`%gpu restore`)", "thaw_elsewhere")
            return self.ledger.leases[lease.id]
        if short is not None:
            reason = (f"frozen in host memory: waiting until a GPU has room for the "
                      f"{format_bytes(lease.frozen_bytes)} it froze ({short})")
            if (lease.state, lease.reason, lease.physical) == ("pending", reason, ()):
                return lease
            return self.ledger.update(lease.id, state="pending", physical=(), reason=reason,
                                      logical=lease.logical if lease.planned_by else ())
        remap: dict[str, str] | None = None
        if set(physical) != set(lease.frozen_on):
            blocker = self._remap_blocker(lease, physical)
            if blocker is not None:
                lease = self.ledger.update(lease.id, logical=logical, physical=physical,
                                           fallback=blocker)
                self._kill(lease, f"restarted on {self._labels(physical)} from its last good "
                           f"checkpoint: it was frozen on {self._labels(lease.frozen_on)}, and "
                           f"{blocker}", "thaw_elsewhere")
                return self.ledger.leases[lease.id]
            remap = dict(zip(lease.frozen_on, physical, strict=True))
        self._thaw_asked.pop(lease.id, None)
        lease = self.ledger.update(lease.id, state="thawing", logical=logical, physical=physical,
                                   reason=f"thawing onto {self._labels(physical)}")
        self._act(lease.id, self._thaw(lease.id, remap, how))
        return lease

    def _remap_blocker(self, lease: Lease, physical: tuple[str, ...]) -> str | None:
        """Why the driver cannot thaw ``lease`` onto ``physical`` (None: it can)."""
        if self.freezer is None:
            return "this agent has no way to freeze processes"
        if not self.config.freeze_remap:
            return "thawing onto another GPU is off on this node (--freeze-remap turns it on)"
        if len(physical) != len(lease.frozen_on or lease.physical):
            return "it would run on another number of GPUs"
        if not self.freezer.can_remap():
            return "this driver thaws a process only onto the GPUs it was frozen on (r580 remaps)"
        names = {g.uuid: g.name for g in self.gpus}
        if any(names.get(old) != names.get(new)
               for old, new in zip(lease.frozen_on or lease.physical, physical, strict=True)):
            return "the driver thaws only onto a GPU of the same model"
        return None

    async def _thaw(self, lease_id: str, remap: Mapping[str, str] | None, how: str) -> None:
        """Thaw the lease's processes onto its GPUs; it runs there again, or, where the driver
        fails, restarts from its last good checkpoint."""
        lease = self.ledger.leases[lease_id]
        pids = [pid for pid, _ in lease.pids]
        started = time.monotonic()
        failed = await asyncio.get_running_loop().run_in_executor(
            None, self._thaw_all, pids, remap)
        lease = self.ledger.leases.get(lease_id)  # type: ignore[assignment]
        if lease is None or lease.state != "thawing":
            return  # released (or stopped) meanwhile
        if failed is not None:
            log.warning("lease %s: thaw failed: %s", lease_id, failed)
            lease = self.ledger.update(lease_id, fallback=failed)
            self._kill(lease, f"restarted from its last good checkpoint: {failed}",
                       "thaw_failed")
            return
        seconds = time.monotonic() - started
        now = time.time()
        frozen_for = now - (lease.frozen_at or now)
        reason = (f"thawed on {self._labels(lease.physical)} after "
                  f"{format_duration(frozen_for)} frozen in host memory")
        with self.ledger.transaction():
            lease = self.ledger.update(
                lease_id, state="active", parked_at=None, frozen_at=None, frozen_bytes=0,
                frozen_on=(), reason=reason, restore_until=now + self.config.restore_grace)
            self._directive(lease, "unparked", reason, gpu=lease.physical[0],
                            gpus=list(lease.physical), request=lease.request, limit=lease.limit,
                            thawed=True, frozen_s=round(frozen_for, 3),
                            seconds=round(seconds, 3))
        for pid in pids:
            self._track(lease, pid)
        self._recount(lease_id)
        self.counters["thaws"] += 1
        self.stats.thawed(seconds)
        self.stats.unparked(how, lease_id)
        log.info("lease %s %s (thaw %.2fs)", lease_id, reason, seconds)

    async def _frozen_move(self, lease_id: str, reason: str, body: dict[str, Any]) -> None:
        """Move a running lease to its target by freezing it and thawing it there; where that
        fails, its client is asked to move it (a checkpoint and a restart)."""
        lease = self.ledger.leases[lease_id]
        pids = [pid for pid, _ in lease.pids]
        remap = dict(zip(lease.physical, lease.target, strict=True))
        loop = asyncio.get_running_loop()
        started = time.monotonic()
        failed = await loop.run_in_executor(None, self._freeze_all, pids)
        if failed is None:
            failed = await loop.run_in_executor(None, self._thaw_all, pids, remap)
            if failed is not None:
                # Thawed where it was, it can still be moved the old way; if not, it restarts.
                undone = await loop.run_in_executor(None, self._thaw_all, pids, None)
                if undone is not None:
                    current = self.ledger.leases.get(lease_id)
                    if current is not None and current.state == "migrating":
                        self._kill(current, f"restarted on {self._labels(current.target)} from "
                                   f"its last good checkpoint: {failed}; {undone}", "thaw_failed")
                    return
        lease = self.ledger.leases.get(lease_id)  # type: ignore[assignment]
        if lease is None or lease.state != "migrating":
            return  # released, or stopped by its deadline, meanwhile
        if failed is not None:
            log.warning("lease %s: moving by freezing failed (%s); asking its client", lease_id,
                        failed)
            self.stats.freeze_fell_back("move")
            self.ledger.update(lease_id, fallback=failed)
            self._directive(lease, "migrate", reason, from_gpu=lease.physical[0],
                            to_gpu=lease.target[0], deadline=lease.deadline, **body)
            return
        seconds = time.monotonic() - started
        source = lease.physical
        with self.ledger.transaction():
            lease = self.ledger.update(
                lease_id, state="active", physical=lease.target, target=(), deadline=None,
                fallback="", restore_until=time.time() + self.config.restore_grace)
            self._directive(lease, "moved", f"{reason}: frozen and thawed there in "
                            f"{seconds:.1f} s, nothing restarted", from_gpu=source[0],
                            to_gpu=lease.physical[0], gpus=list(lease.physical),
                            seconds=round(seconds, 3), request=lease.request, limit=lease.limit)
        for pid in pids:
            self.backend.untrack(pid)
            self._track(lease, pid)
        self._recount(lease_id)
        self.stats.frozen("move", seconds)
        self.stats.move_ended(lease_id, MIGRATED)
        log.info("lease %s moved %s -> %s by freezing in %.2fs", lease_id, source,
                 lease.physical, seconds)
        self._activate_pending()

    def _frozen_process_ended(self, lease: Lease) -> Lease:
        """A frozen process ended (the host's OOM killer, a crash): its GPU state went with it.
        The lease waits parked, so that its kernel, restarted from its last good checkpoint,
        starts without a GPU and its next cell gets one."""
        log.warning("lease %s: a frozen process ended; its kernel restarts from its checkpoint",
                    lease.id)
        return self.ledger.update(
            lease.id, state="parked", frozen_at=None, frozen_bytes=0, frozen_on=(),
            fallback="its frozen process ended, and with it what the freeze kept",
            reason="parked: its frozen process ended; its kernel restarts from its last good "
                   "checkpoint and its next cell gets a GPU")

    def _resume_freezes(self) -> None:
        """At start: finish what a previous agent left under way, by what the driver says of
        each process. A freeze cut short is undone; a thaw is done again; a frozen lease whose
        process the driver no longer holds (it failed) restarts from its checkpoint."""
        if self.freezer is None:
            return
        for lease in list(self.ledger.leases.values()):
            if lease.state not in ("freezing", "thawing") and not lease.frozen:
                continue
            try:
                states = {self.freezer.state(pid) for pid, _ in lease.pids}
            except FreezeError as exc:
                states = {FAILED}
                log.warning("lease %s: driver state unknown: %s", lease.id, exc)
            if FAILED in states:
                self._kill(lease, "restarted from its last good checkpoint: the driver lost "
                           "its frozen state while the agent was down", "thaw_failed")
            elif lease.state == "freezing":
                log.info("lease %s: a freeze was cut short by an agent restart; undoing it",
                         lease.id)
                pids = [pid for pid, _ in lease.pids]
                self.ledger.update(lease.id, state="active", reason="running: a freeze was cut "
                                   "short by an agent restart")
                if states & {LOCKED, CHECKPOINTED}:
                    self._act(lease.id, asyncio.get_running_loop().run_in_executor(
                        None, self._thaw_all, pids, None))
            elif lease.state == "thawing":
                moved = set(lease.physical) != set(lease.frozen_on)
                self._act(lease.id, self._thaw(lease.id, dict(zip(
                    lease.frozen_on, lease.physical, strict=True)) if moved else None, AT_ONCE))
            # A frozen lease stays as the ledger says: parked, or pending until room returns.

    # --- reclaim and deadlines ---------------------------------------------------------
    def _reclaim_stops(self, lease: Lease, now: float) -> int:
        """How often reclaim stopped this lease within --kill-window (the ledger keeps them)."""
        return policy.kills_in_window(self.ledger.kill_times(lease.id, "reclaim"), now,
                                      self.config.kill_window)

    def _repeat_note(self, lease: Lease, stop: int, *, coming: bool) -> str:
        """What its user must hear when reclaim stops a lease for the ``stop``-th time within the
        window: a kernel that restores more than its request is stopped again and again."""
        if stop < 3:
            return ""
        minutes = self.config.kill_window / 60
        which = f"{_ordinal(stop)} stop of this kernel within {minutes:g} minutes"
        head = (f" If it does not shrink, this will be the {which}" if coming
                else f" This is the {which}")
        return (f"{head}: the state it restores needs more than its request of "
                f"{format_bytes(lease.request)} (it held {format_bytes(lease.usage)}). Ask for "
                f"more with `%gpu request {self._suggest_request(lease)}`, or free memory "
                "(`del` large tensors, `%gpu release`) before it is restored again.")

    def _suggest_request(self, lease: Lease) -> str:
        """A request that covers what the lease held: rounded up, a whole GPU at most."""
        step = 256 * 2**20 if lease.usage < 4 * 2**30 else 2**30
        want = -(-max(lease.usage, lease.request + 1) // step) * step
        totals = [self.gpu(u) for u in lease.physical]
        if any(g is not None and want >= g.memory_usable for g in totals):
            return "1"
        return f"{want // 2**30}Gi" if want % 2**30 == 0 else f"{want // 2**20}Mi"

    def _kill(self, lease: Lease, reason: str, cause: str) -> None:
        if lease.planned_by == KUBELET:
            return  # a pod's processes are the kubelet's, never the agent's to stop
        now = time.time()
        stops = self._reclaim_stops(lease, now) + (cause == "reclaim")
        if cause == "reclaim":
            reason += self._repeat_note(lease, stops, coming=False)
        # What the kernel started on the GPU goes with it: it would keep the memory otherwise.
        children = self._children.get(lease.id, [])
        ended = {pid for pid, _ in (*lease.pids, *children)}
        killed = [pid for pid, start in (*lease.pids, *children) if procs.kill(pid, start)]
        self.counters["kills"] += 1
        self.stats.killed(cause)
        if lease.state == "migrating":
            self.stats.move_ended(lease.id, cause)  # migrate_timeout: the move ends here
        where = (lease.target if lease.state == "migrating" and lease.target
                 else lease.physical or lease.frozen_on)
        # Stopped on a GPU the cluster gave a pod: coming back there would be stopped again, so
        # it comes back parked, and its next cell waits for a GPU with room.
        state = ("parked" if lease.kind == policy.NOTEBOOK and set(where) & set(self._pods_gpus())
                 else "killed")
        parked: dict[str, Any] = (
            {"logical": lease.logical if lease.planned_by else (), "physical": (),
             "parked_at": now} if state == "parked" else {"physical": where, "parked_at": None})
        # A frozen process dies with its GPU state: the restart restores the durable checkpoint.
        parked.update(frozen_at=None, frozen_bytes=0, frozen_on=())
        with self.ledger.transaction():
            self.ledger.add_kill(lease.id, now, cause)
            self.ledger.set_pids(lease.id, ())
            lease = self.ledger.update(lease.id, state=state, target=(), deadline=None,
                                       reason=reason, **parked)
            if state == "parked":
                self.stats.parked(lease.id)
            self._directive(lease, "killed", reason, cause=cause, pids=killed,
                            request=lease.request, limit=lease.limit, usage=lease.usage,
                            gpu=where[0], stops_in_window=stops,
                            kill_window=self.config.kill_window)
        # SIGKILL is final: what they held is free before the restarted kernel asks for room.
        self._gone(lease.id, ended)
        log.warning("lease %s: killed pids %s (%s): %s", lease.id, killed, cause, reason)

    def _enforce_deadlines(self, now: float) -> None:
        for lease in list(self.ledger.leases.values()):
            if lease.state == "migrating" and lease.deadline and now >= lease.deadline:
                src, dst = self._labels(lease.physical), self._labels(lease.target)
                self._kill(lease, f"stopped because its move from {src} to {dst} did not finish "
                           f"within {self.config.migrate_grace:g}s (a move that timed out, not a "
                           f"memory problem): it restarts on {dst} from its last good checkpoint. "
                           f"Why it moved: {lease.reason}", "migrate_timeout")

    def _reclaim(self, now: float) -> None:
        """One climb of the reclaim ladder: borrowers an owner is owed by first, GPU by GPU,
        then leases above their limit; a shrink asked of any other lease is called off."""
        leases = self.ledger.leases
        owed: set[str] = set()
        pods = self._pods_gpus()
        restoring = frozenset(
            lease.id for lease in leases.values()
            if lease.restore_until is not None and lease.restore_until > now
        )
        for uuid in [g.uuid for g in self.gpus]:
            # Read per GPU: a lease killed for one GPU no longer lends, nor holds memory, on
            # the next.
            gpu = self.gpu(uuid)
            if gpu is None or not gpu.healthy:
                continue
            pod = pods.get(gpu.uuid)
            on_gpu = [
                self._guaranteed_here(lease, pod) for lease in leases.values()
                if gpu.uuid in lease.physical and lease.state in ("active", "shrinking")
            ]
            device = policy.Device(gpu.uuid, gpu.index, gpu.memory_usable)
            headroom = int(self.config.headroom * gpu.memory_usable)
            # Policy takes a restoring kernel only when the others' loans cannot cover the
            # deficit: the owner's guarantee comes first.
            for r in policy.plan_reclaim(device, on_gpu, gpu.memory_used, headroom, restoring):
                owed.add(r.lease_id)
                self._climb(leases[r.lease_id], now, r, pod)
        for lease in list(leases.values()):
            # A pod's whole GPUs are its own: nothing of them is a loan, nor its to give back.
            if (lease.id not in owed and lease.state in ("active", "shrinking")
                    and lease.planned_by != KUBELET):
                self._climb(lease, now, None)

    @staticmethod
    def _guaranteed_here(lease: Lease, pod: Lease | None) -> policy.Placement:
        """``lease`` as reclaim sees it on a GPU: on one the cluster gave a pod whole (``pod``),
        nothing another lease holds there is guaranteed, and the pod never borrows."""
        placement = lease.placement()
        if pod is None:
            return placement
        if lease.id == pod.id:
            return replace(placement, usage=min(placement.usage, placement.request))
        return replace(placement, request=0)

    def _climb(self, lease: Lease, now: float, owed: policy.Reclaim | None,
               pod: Lease | None = None) -> None:
        """Takes the ladder's next step for ``lease`` (``owed``: what reclaim wants of it here,
        on a GPU given to ``pod`` whole, if any)."""
        enforce = self.config.enforce_limits
        request = self._guaranteed_here(lease, pod).request if owed is not None else lease.request
        standing = policy.Standing(lease.usage, request, lease.limit,
                                   lease.state == "shrinking", lease.deadline)
        step = policy.reclaim_step(
            standing, now, owed=owed is not None, grace=self.config.reclaim_grace,
            enforce_limit=enforce if enforce is not None else not self.backend.simulated)
        grace = f"{self.config.reclaim_grace:g}s"
        if step.action == policy.CANCEL:
            why = ("gave its loan back" if lease.usage <= lease.request
                   else "the owner no longer needs the memory")
            self.ledger.update(lease.id, state="active", deadline=None, reason=why)
        elif step.cause == policy.RECLAIM and owed is not None and pod is not None:
            where = (f"{self.gpu_label(owed.gpu)}, which the cluster gave pod container "
                     f"{pod.name} whole: none of it is guaranteed there, and the pod needs "
                     f"{format_bytes(owed.deficit)} more")
            if step.action == policy.SHRINK:
                self._ask_to_shrink(lease, f"using {format_bytes(lease.usage)} on {where}", step,
                                    gpu=owed.gpu)
            elif step.action == policy.KILL:
                self._take_back(lease, f"it still held {format_bytes(lease.usage)} {grace} after "
                                f"being asked to give it back, on {where}", "reclaim",
                                stopped="stopped and parked")
        elif step.cause == policy.RECLAIM and owed is not None:
            wanted = (f"{format_bytes(owed.deficit)} owed to other notebooks on "
                      f"{self.gpu_label(owed.gpu)}")
            if step.action == policy.SHRINK:
                stops = self._reclaim_stops(lease, now)
                reason = (f"using {format_bytes(lease.usage)}, {format_bytes(owed.loan)} above its "
                          f"request of {format_bytes(lease.request)}, while {wanted}"
                          + self._repeat_note(lease, stops + 1, coming=True))
                self._ask_to_shrink(lease, reason, step, gpu=owed.gpu, stops_in_window=stops,
                                    kill_window=self.config.kill_window)
            elif step.action == policy.KILL:
                self._take_back(lease, f"it stayed {format_bytes(owed.loan)} above its request "
                                f"of {format_bytes(lease.request)} for {grace} after being asked "
                                f"to shrink, while {wanted}", "reclaim",
                                stopped=f"stopped to return {format_bytes(owed.loan)} of loaned "
                                        "memory", frozen=f"frozen to return "
                                        f"{format_bytes(owed.loan)} of loaned memory")
        elif step.cause == policy.LIMIT:
            over, limit = format_bytes(lease.usage - lease.limit), format_bytes(lease.limit)
            if step.action == policy.SHRINK:
                reason = (f"using {format_bytes(lease.usage)}, {over} above its limit of {limit}: "
                          "something the allocator cap does not hold (another framework, a child "
                          "process) has the memory")
                self._ask_to_shrink(lease, reason, step,
                                    gpu=lease.physical[0] if lease.physical else None,
                                    cause="limit")
            elif step.action == policy.KILL:
                self._take_back(lease, f"it stayed {over} above its limit of {limit} for {grace} "
                                "after being asked to shrink", "limit",
                                stopped="stopped because", frozen="frozen because")

    def _take_back(self, lease: Lease, why: str, cause: str, *, stopped: str,
                   frozen: str = "frozen") -> None:
        """The last rung of the ladder: freeze the lease (its kernel keeps everything in host
        memory and thaws when room returns; above its limit, at its next cell), else stop it
        (it restarts from its last good checkpoint), saying which and why."""
        joiner = " " if stopped.endswith("because") else ": "
        blocker = self.freeze_blocker(lease)
        if blocker is not None:
            self.stats.freeze_fell_back(cause)
            self._kill(lease, f"{stopped}{joiner}{why}. Freezing could not be used: {blocker}",
                       cause)
            return
        then = "parked" if cause == "limit" else "pending"
        after = ("its next cell thaws it" if then == "parked"
                 else "it thaws by itself once its GPU has room for what it holds")
        reason = (f"{frozen}{' ' if frozen.endswith('because') else ': '}{why}. Its process and "
                  f"variables wait in host memory (a running cell waits too); {after}")

        def fall_back(current: Lease, failed: str) -> None:
            if current.state in ("active", "shrinking"):
                self._kill(current, f"{stopped}{joiner}{why}. Freezing failed: {failed}", cause)

        self._start_freeze(lease, reason, then, cause, fall_back)

    def _ask_to_shrink(self, lease: Lease, reason: str, step: policy.Step, **body: Any) -> None:
        """The first rung: a ``shrink`` directive and the deadline of --reclaim-grace."""
        with self.ledger.transaction():
            lease = self.ledger.update(lease.id, state="shrinking", deadline=step.at,
                                       reason=reason)
            # What follows the grace, so that the user is told the truth beforehand.
            then = "freeze" if self.freeze_blocker(lease) is None else "stop"
            self._directive(lease, "shrink", reason, request=lease.request, limit=lease.limit,
                            usage=lease.usage, deadline=step.at, then=then, **body)
        self.counters["shrinks"] += 1
        self.stats.shrink_asked(step.cause or policy.RECLAIM)

    def _activate_pending(self) -> None:
        leases = self.ledger.leases
        pending = [lease for lease in leases.values() if lease.state == "pending"]
        if not pending:  # as nearly every tick finds: no placement to build
            return
        # An unparked lease that found no room waits with no GPU, until one has room for it.
        for lease in pending:
            if not lease.physical:
                self._place_waiting(lease, AFTER_WAIT)
        placed = {lease.id for lease in leases.values()
                  if lease.state == "pending" and lease.physical}
        if not placed:
            return
        placements = [lease.placement() for lease in leases.values()]
        for lease_id in policy.plan_activation(self.devices(), placements, placed,
                                               self.config.rules):
            lease = leases[lease_id]
            if lease.parked_at is not None:
                self._unparked(lease, lease.logical, lease.physical, AFTER_WAIT)
            else:
                self.ledger.update(lease_id, state="active", reason="placed after compaction")

    # --- directives ------------------------------------------------------------------
    def _directive(self, lease: Lease, kind: str, reason: str, **body: Any) -> Directive:
        d = self.ledger.add_directive(
            lease, kind, {"reason": reason, "kernel_id": lease.kernel_id, **body}
        )
        self._directive_added = object()
        for key in (("lease", d.lease_id, kind), ("client", d.owner_uid, d.client, kind)):
            for event in self._listeners.get(key, ()):
                event.set()
        return d

    async def wait_directives(
        self, caller: Caller, *, client: str | None, lease_id: str | None, after: int,
        timeout: float, kinds: Sequence[str] = ACTIONS,
    ) -> tuple[list[Directive], int]:
        if lease_id is not None:
            self.lease(caller, lease_id)
        if after < 0:  # "from now on": a new listener need not replay history
            return [], self.ledger.last_seq()
        deadline = time.monotonic() + min(max(timeout, 0.0), MAX_WAIT)
        # A client name is anyone's to write on a lease, so by name a caller hears only of its
        # own leases (an admin too); an admin follows another user's lease by its id.
        scope: tuple[object, ...] = (("lease", lease_id) if lease_id is not None
                                     else ("client", caller.uid, client))
        keys = [(*scope, kind) for kind in dict.fromkeys(kinds)]
        event = asyncio.Event()
        for key in keys:
            self._listeners.setdefault(key, set()).add(event)
        try:
            while True:
                event.clear()
                own = self.ledger.directives_after(
                    after, client=client if lease_id is None else None, lease_id=lease_id,
                    owner_uid=None if lease_id is not None and caller.admin else caller.uid)
                # Past what the caller may see but did not ask for, so it is not read again,
                # by this wait nor by the next.
                after = max(own[-1].seq if own else after, 0)
                found = [d for d in own if d.kind in kinds]
                remaining = deadline - time.monotonic()
                if found or remaining <= 0:
                    return found, after
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(event.wait(), remaining)
        finally:
            for key in keys:
                waiting = self._listeners[key]
                waiting.discard(event)
                if not waiting:
                    del self._listeners[key]
