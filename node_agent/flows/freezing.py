"""Freezing: the driver keeps a notebook's GPU state in host memory (freeze) and restores it (thaw)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any, TypeVar

from node_agent import memcg, policy, procs
from node_agent.caps import mps_running
from node_agent.devices.base import (
    CHECKPOINTED,
    FAILED,
    GONE,
    LOCKED,
    NO_CUDA,
    RUNNING,
    FreezeError,
    GpuInfo,
    full_permutation,
)
from node_agent.flows import common
from node_agent.flows.common import Caller, Conflict
from node_agent.flows.freeze_calls import NOT_YET, DriverCalls
from node_agent.flows.freeze_steps import FreezeSteps, Outcome
from node_agent.flows.parking import NOT_NOW, notebook_only
from node_agent.flows.room import Room
from node_agent.ledger import KUBELET, Lease
from node_agent.quantities import format_bytes, format_duration
from node_agent.stats import AT_ONCE, MIGRATED

if TYPE_CHECKING:
    from node_agent.flows.context import Context

log = logging.getLogger("gpufrac.agent")
T = TypeVar("T")

PROVING = ("the agent is still checking that freezing works on this node (it freezes and thaws "
           "a small CUDA process of its own first)")
# How often a driver that was not usable, or a canary that found no room, is tried again: ten
# polls, between a second and REPROBE_S.
REPROBE_S = 30.0
# A frozen lease whose state the driver would not say after an agent restart is asked again
# after a poll interval (a second at least), twice as long each time, up to ASK_AGAIN_MAX_S.
ASK_AGAIN_MAX_S = 600.0


class Freezing(Room):
    """The freezes and thaws under way (each runs the driver's calls off the loop, bounded), the
    frozen leases whose kernel asked for its GPU back, whether this node's driver has been seen
    to freeze and thaw (the canary), and what the driver could not say after a restart."""

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        self.freezer = ctx.freezer
        self.calls = DriverCalls(ctx.freezer, ctx.backend, ctx.config) if ctx.freezer else None
        self.steps = (FreezeSteps(self.calls, ctx.backend, ctx.config, ctx.stats)
                      if self.calls is not None else None)
        # Freezes and thaws under way, by lease, and when each began and may take till.
        self._acting: dict[str, asyncio.Future[Any]] = {}
        self._bounds: dict[str, tuple[float, float]] = {}
        # Frozen leases whose kernel asked for its GPU back (a cell waits): since when.
        self._thaw_asked: dict[str, float] = {}
        # Why freezing is not offered until the canary has shown it works (None: it has, or
        # this freezer needs no proof).
        self._proof: str | None = PROVING if ctx.freezer and ctx.freezer.needs_proof else None
        self._proving: asyncio.Task[None] | None = None
        # What the driver said of itself when last asked, off the loop (a failed cuInit is
        # asked again after REPROBE_S), and whether it remaps; never asked on the loop.
        self._driver_why: str | None = None
        self._can_remap = False
        if ctx.freezer is not None and ctx.freezer.needs_proof:
            self._driver_why = "the agent has not asked the CUDA driver yet"
        elif ctx.freezer is not None:  # the simulation answers at once
            self._driver_why, self._can_remap = ctx.freezer.unavailable(), ctx.freezer.can_remap()
        self._probed = -REPROBE_S
        self._probing: asyncio.Future[None] | None = None
        # Frozen leases whose process state the driver would not say: why, by lease.
        self._unknown: dict[str, str] = {}

    @property
    def _steps(self) -> FreezeSteps:
        assert self.steps is not None, "a freeze or thaw on an agent that cannot freeze"
        return self.steps

    # --- whether this node freezes ------------------------------------------------------
    async def probe(self) -> None:
        """At start: say whether this node can freeze. The driver's first look (cuInit) can
        take seconds: not on the loop, not unbounded."""
        if self.freezer is None or self.calls is None:
            return
        freezer = self.freezer
        self._probed = time.monotonic()
        try:
            why = await self.calls.run("cuInit", freezer.unavailable,
                                       self.config.freeze_call_timeout)
            remap = why is None and await self.calls.run(
                "cuDriverGetVersion", freezer.can_remap, self.config.freeze_call_timeout)
        except FreezeError as exc:
            why, remap = str(exc), False
        self._driver_why, self._can_remap = why, remap
        if why:
            log.info("freezing: not available: %s", why)
        else:
            log.info("freezing: by %s", freezer.name)

    def _probe_again(self) -> None:
        """Ask the driver again in the background, at most every REPROBE_S, where it was not
        usable (a cuInit that failed) or the canary found no room: it may be by now."""
        if (self.calls is None or not self.config.freeze
                or (self._probing is not None and not self._probing.done())
                or time.monotonic() - self._probed
                < min(REPROBE_S, max(1.0, 10 * self.config.poll_interval))
                or not (self._driver_why or (self._proof or "").startswith(NOT_YET))):
            return

        async def again() -> None:
            await self.probe()
            if self._driver_why is None and (self._proving is None or self._proving.done()):
                self.prove()

        with contextlib.suppress(RuntimeError):  # no running loop: asked again later
            self._probing = asyncio.ensure_future(again())

    def prove(self) -> None:
        """Freeze and thaw a CUDA process of the agent's own, in the background: until that
        worked, nothing else is frozen (a driver that cannot is found on a test process, not
        on a user's kernel)."""
        if self.calls is None or self._proof is None or not self.config.freeze:
            return
        if self._driver_why is not None:
            return
        calls = self.calls

        async def run() -> None:
            self._proof = PROVING
            why = await calls.prove(self.ctx.gpus)
            self._proof = why
            if why:
                log.warning("freezing: not offered on this node: %s", why)

        self._proving = asyncio.create_task(run(), name="gpufrac-canary")

    def node_blocker(self) -> str | None:
        """Why no lease can be frozen on this node now (None: leases may be)."""
        if not self.config.freeze:
            return "freezing is turned off on this node (--no-freeze)"
        if self.freezer is None or self.calls is None:
            return "this agent has no way to freeze processes"
        self._probe_again()
        return self._driver_why or self.calls.stalled() or self._proof

    def status(self) -> dict[str, Any]:
        """Whether this node freezes notebooks (and why not), whether a thaw can land on another
        GPU, the host memory frozen state takes against its budgets, how long a stop would wait
        for what is under way, and the frozen leases whose state the driver would not say."""
        why = self.node_blocker()
        return {"available": why is None, "why": why,
                "freezer": self.freezer.name if self.freezer is not None else None,
                "remap": why is None and self.config.freeze_remap and self._can_remap,
                "frozen_bytes": self.frozen_bytes(), "budget": self.freeze_budget(),
                "budget_per_user": self.user_budget(),
                "stop_grace": round(self.stop_grace(), 1),
                "unknown": sorted(self._unknown)}

    def freeze_blocker(self, lease: Lease) -> str | None:
        """Why ``lease``'s processes cannot be frozen now (None: they can), in words its user
        reads beside the fallback (a checkpoint on disk and a restart)."""
        why = self.node_blocker()
        if why:
            return why
        if lease.kind != policy.NOTEBOOK or lease.planned_by == KUBELET:
            return "only notebooks are frozen"
        if not lease.pids:
            return "its kernel has no registered process"
        if self.ctx.usage.children(lease.id):
            return ("a process its kernel started uses the GPU too (a DataLoader worker, a "
                    "subprocess), which the driver cannot freeze with it")
        if mps_running(lease.owner_uid):
            return "CUDA MPS serves its processes, and the driver cannot freeze MPS clients"
        ours = procs.pid_namespace("self")
        if any(procs.pid_namespace(pid) not in (None, ours) for pid, _ in lease.pids):
            return ("its kernel runs in another PID namespace than the agent (a container of its "
                    "own), and the driver acts only on processes of the caller's")
        return self.memory_blocker(lease, lease.usage, {})

    def memory_blocker(self, lease: Lease, holds: int, by_pid: Mapping[int, int]) -> str | None:
        """Why host memory cannot take the ``holds`` bytes ``lease`` would freeze (``by_pid``:
        what each process holds, where known): the node's budget, its user's share of it, what
        the host has available, and each process's memory cgroup, which the driver's copy
        into the process is charged to."""
        budget = self.freeze_budget()
        frozen = self.frozen_bytes(exclude=lease.id)
        if frozen + holds > budget:
            return (f"host memory for frozen kernels is used up ({format_bytes(frozen)} of "
                    f"{format_bytes(budget)} frozen; it holds {format_bytes(holds)})")
        mine = self.frozen_bytes(owner=lease.owner_uid, exclude=lease.id)
        share = self.user_budget()
        if mine + holds > share:
            return (f"its user's frozen kernels would take {format_bytes(mine + holds)} of host "
                    f"memory, more than the {format_bytes(share)} one user may have frozen on "
                    "this node")
        available = procs.memory_available()
        if available is not None and holds > available:
            return (f"the host has {format_bytes(available)} of memory available, less than "
                    f"the {format_bytes(holds)} it holds on the GPU")
        groups: dict[str, tuple[memcg.Headroom, int]] = {}
        for pid, _ in lease.pids:
            room = memcg.headroom(pid)
            if room is not None:
                _, counted = groups.get(room.cgroup, (room, 0))
                # Unmeasured, each process is taken to hold all of it.
                groups[room.cgroup] = (room, counted + by_pid.get(pid, 0) if by_pid else holds)
        for room, needs in groups.values():
            if needs > room.room:
                return (f"its memory limit of {format_bytes(room.limit)} leaves "
                        f"{format_bytes(room.room)}, less than the {format_bytes(needs)} it holds "
                        "on the GPU (the driver copies that into the process, and the limit's "
                        "OOM killer would end it)")
        return None

    def freeze_budget(self) -> int:
        """Bytes of host memory frozen GPU state may take on this node."""
        if self.config.freeze_budget is not None:
            return self.config.freeze_budget
        return int(procs.memory_total() * self.config.freeze_budget_share)

    def user_budget(self) -> int:
        """Bytes of host memory one user's frozen GPU state may take on this node."""
        if self.config.freeze_budget_per_user is not None:
            return min(self.config.freeze_budget_per_user, self.freeze_budget())
        return self.freeze_budget() // 2

    def frozen_bytes(self, owner: int | None = None, exclude: str | None = None) -> int:
        """Host memory taken by frozen GPU state and by the freezes under way (``owner``: of one
        user's leases only)."""
        return sum(lease.frozen_bytes if lease.frozen else lease.usage
                   for lease in self.ledger.leases.values()
                   if (lease.frozen or lease.state == "freezing") and lease.id != exclude
                   and (owner is None or lease.owner_uid == owner))

    def stop_grace(self) -> float:
        """Seconds the freezes and thaws under way may still take: a stop waits as long (the
        driver is said to lose track of a process whose caller dies mid-call)."""
        now = time.monotonic()
        return max((start + bound - now for start, bound in self._bounds.values()), default=0.0)

    # --- freezing ----------------------------------------------------------------------
    async def freeze(self, caller: Caller, lease_id: str, reason: str | None = None) -> Lease:
        """Park a notebook by freezing its processes (its client asks, e.g. for an idle
        kernel): the lease gives its GPU back and its kernel keeps everything; its next cell
        thaws it. Conflict says why freezing cannot be used, for the client's fallback."""
        self.ctx.polling.wake()
        lease = self.ctx.lease(caller, lease_id)
        notebook_only(lease)
        if lease.state == "parked":
            return lease
        if lease.state not in ("active", "shrinking"):
            raise Conflict("lease", f"lease is {lease.state}: "
                           + NOT_NOW.get(lease.state, "a freeze or thaw is under way"))
        if self._proving is not None and not self._proving.done():
            # The canary is seconds from its verdict: a park asked now waits for it.
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.shield(self._proving), self.config.freeze_call_timeout)
            lease = self.ctx.lease(caller, lease_id)
            if lease.state not in ("active", "shrinking"):
                raise Conflict("lease", f"lease is {lease.state}: "
                               + NOT_NOW.get(lease.state, "a freeze or thaw is under way"))
        blocker = self.freeze_blocker(lease)
        if blocker is not None:
            self.ledger.update(lease.id, fallback=blocker)
            self.stats.freeze_fell_back("park")
            raise Conflict("freeze", blocker)
        work = self._act(lease.id, self._freeze(
            lease.id, reason or "parked: its idle kernel was frozen; its next cell thaws it",
            then="parked", cause="park"))
        try:
            failed = await asyncio.wait_for(asyncio.shield(work), self._bound(lease.usage,
                                                                              len(lease.pids)))
        except asyncio.TimeoutError:
            raise Conflict("freeze", self.node_blocker() or "the freeze goes on longer than it "
                           "may; it finishes in the background") from None
        if failed:
            self.stats.freeze_fell_back("park")
            raise Conflict("freeze", failed)
        return self.ledger.leases[lease.id]

    def make_way(self, notebook: Lease, job: Lease) -> None:
        """Freeze ``notebook`` so that ``job`` can run where it runs; where freezing cannot be
        used, its client is asked to park it (a checkpoint, and a restart without a GPU)."""
        where = self.ctx.labels(g for g in notebook.physical if g in job.physical)
        whose = common.whose(job, notebook.owner_uid)
        whole = job.request >= min((g.memory_usable for g in self.ctx.gpus
                                    if g.uuid in job.physical), default=0)
        needs = f"{whose} needs {where} whole" if whole else f"{whose} needs room on {where}"
        blocker = self.freeze_blocker(notebook)

        def park_instead(current: Lease, why: str) -> None:
            if current.state not in ("active", "shrinking"):
                return
            self.ctx.directives.add(current, "park", f"{needs}, and freezing could not be used: {why}",
                                    gpu=current.physical[0] if current.physical else None,
                                    request=current.request, limit=current.limit)

        if blocker is not None:
            self.stats.freeze_fell_back("job")
            park_instead(notebook, blocker)
            return
        self.start_freeze(notebook, f"frozen because {needs}: its process and variables wait "
                          "in host memory (a running cell waits too), and it thaws when the "
                          "job ends", "pending", "job", park_instead)

    def start_freeze(self, lease: Lease, reason: str, then: str, cause: str,
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

    def _act(self, lease_id: str, work: Awaitable[T]) -> asyncio.Future[T]:
        """Run a freeze or thaw of ``lease_id`` as a task the agent waits for when it stops."""
        task = asyncio.ensure_future(work)
        self._acting[lease_id] = task

        def done(_: object) -> None:
            if self._acting.get(lease_id) is task:
                del self._acting[lease_id]
                self._bounds.pop(lease_id, None)
            if not task.cancelled() and task.exception() is not None:
                log.error("lease %s: freeze or thaw failed", lease_id,
                          exc_info=task.exception())

        task.add_done_callback(done)
        return task

    def _bound(self, nbytes: int, processes: int) -> float:
        """How long a freeze or thaw of ``processes`` processes holding ``nbytes`` may take,
        every call at its deadline."""
        assert self.calls is not None
        per_process = (self.config.freeze_attempts * self.calls.seconds("lock")
                       + 4 * self.calls.seconds("state") + 2 * self.calls.seconds("unlock"))
        return max(1, processes) * per_process + 2 * self.calls.seconds("checkpoint", nbytes)

    def _moving(self, lease_id: str, nbytes: int) -> None:
        """A freeze or thaw of ``nbytes`` starts now: a stop waits for its copy."""
        assert self.calls is not None
        self._bounds[lease_id] = (time.monotonic(), self.calls.seconds("checkpoint", nbytes)
                                  + self.calls.seconds("lock"))

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

    async def stop(self) -> None:
        """The agent stops: a freeze or thaw under way may finish within its bound (a caller
        killed mid-call is said to leave the driver out of step); then what is left stays as
        the ledger has it, for the next agent to finish."""
        grace = self.stop_grace()
        if self._acting:
            log.info("waiting up to %s for %d freeze(s) or thaw(s) under way",
                     format_duration(grace), len(self._acting))
            try:
                await asyncio.wait_for(self.settled(), grace)
            except asyncio.TimeoutError:
                log.warning("stopping with freezes or thaws under way for leases %s: the next "
                            "agent reads their state from the driver", sorted(self._acting))
        if self._proving is not None:
            self._proving.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._proving

    async def _freeze(self, lease_id: str, reason: str, then: str, cause: str) -> str | None:
        """Freeze the lease's processes; then it is ``then`` (``parked``: its next cell thaws it;
        ``pending``: it thaws once a GPU has room) with no GPU. Returns why it failed (None:
        frozen); a failure leaves it running as it was, or, where the driver lost a process,
        restarts its kernel from its last good checkpoint."""
        assert self.calls is not None
        lease = self.ledger.leases[lease_id]
        before = lease.state if lease.state in ("active", "shrinking") else "active"
        if lease.state != "freezing":
            lease = self.ledger.update(lease_id, state="freezing", reason=f"freezing: {reason}")
        started = time.monotonic()
        by_pid, held = await self._held_now(lease)
        self._moving(lease_id, held)
        blocker = self.memory_blocker(lease, held, by_pid)
        outcome = Outcome(failed=blocker) if blocker else await self._steps.freeze(lease, by_pid, held)
        current = self.ledger.leases.get(lease_id)
        if current is None:  # released meanwhile: its processes must not stay frozen
            if outcome.failed is None and outcome.lost is None:
                await self._steps.thaw_back(lease.pids)
            return "its lease was released during the freeze"
        lease = current
        if outcome.lost is not None:
            log.warning("lease %s: the driver lost a process while freezing it: %s", lease_id,
                        outcome.lost)
            lease = self.ledger.update(lease_id, state=before, fallback=outcome.lost)
            self.ctx.reclaim.kill(lease, "restarted from its last good checkpoint: "
                                  f"{outcome.lost}", "freeze_failed")
            return outcome.lost
        if outcome.failed is not None:
            log.warning("lease %s: freeze failed: %s", lease_id, outcome.failed)
            self.ledger.update(lease_id, state=before, fallback=outcome.failed,
                               reason=lease.reason.removeprefix("freezing: "))
            return outcome.failed
        seconds = time.monotonic() - started
        now = time.time()
        with self.ledger.transaction():
            lease = self.ledger.update(
                lease_id, state=then, frozen_at=now, frozen_bytes=held, frozen_on=lease.physical,
                physical=(), logical=lease.logical if lease.planned_by else (), target=(),
                deadline=None, parked_at=now, reason=reason, fallback="")
            self.ctx.directives.add(lease, "frozen", reason, gpu=lease.frozen_on[0], gpus=list(
                lease.frozen_on), frozen_bytes=held, seconds=round(seconds, 3),
                                    waiting=then == "pending", cause=cause, request=lease.request,
                                    limit=lease.limit)
        pids = {pid for pid, _ in lease.pids}
        for pid in pids:
            self.backend.untrack(pid)
        self.ctx.usage.gone(lease_id, pids)
        self.counters["freezes"] += 1
        self.stats.frozen(cause, seconds)
        self.stats.parked(lease_id)
        log.info("lease %s frozen in %.2fs (%s): %s", lease_id, seconds, format_bytes(held),
                 reason)
        self.ctx.placement.activate_pending()
        return None

    async def _held_now(self, lease: Lease) -> tuple[dict[int, int], int]:
        """What the lease's processes hold on its GPUs just before the lock, process by process,
        and what its freeze takes: the larger of that (read anew, the most on any one GPU) and
        the lease's usage, which its kernel's own report stands in for where the backend does
        not list its processes."""
        assert self.calls is not None
        pids = [pid for pid, _ in lease.pids]
        by_pid: dict[int, int] = {}
        most = 0
        try:
            listed = await self.calls.held(lease.physical, pids)
        except FreezeError:
            listed = {}
        for found in listed.values():
            most = max(most, sum(used or 0 for used in found.values()))
            for pid, used in found.items():
                by_pid[pid] = by_pid.get(pid, 0) + (used or 0)
        return by_pid, max(most, lease.usage)

    # --- thawing -----------------------------------------------------------------------
    def ask_to_thaw(self, lease_id: str) -> None:
        """The frozen lease's kernel asked for its GPU back (a cell waits), from now on."""
        self._thaw_asked.setdefault(lease_id, time.monotonic())

    def thaw_asked(self, lease_id: str) -> bool:
        return lease_id in self._thaw_asked

    def forget(self, lease_id: str) -> None:
        """The lease was released: nothing of it is kept."""
        self._thaw_asked.pop(lease_id, None)
        self._unknown.pop(lease_id, None)
        if self.steps is not None:
            self.steps.out_of_memory.discard(lease_id)

    def start_thaw(self, lease: Lease, logical: tuple[str, ...], physical: tuple[str, ...],
                   how: str) -> Lease:
        """A frozen lease was placed on ``physical``: thaw it there once the GPU has room for
        what it froze (it waits for that without a GPU); onto another GPU where the driver can
        remap, else its kernel restarts there from its last good checkpoint."""
        short = self._thaw_room(lease, physical)
        asked = self._thaw_asked.get(lease.id)
        if short is not None and asked is not None and (
                time.monotonic() - asked >= self.config.thaw_wait):
            # Its request has room (it was placed): a restart within it beats waiting on.
            self.forget(lease.id)
            lease = self.ledger.update(lease.id, logical=logical, physical=physical,
                                       fallback=f"no room to thaw within "
                                                f"{format_duration(self.config.thaw_wait)}")
            self.ctx.reclaim.kill(lease, f"restarted on {self.ctx.labels(physical)} from its last good "
                                  f"checkpoint: a cell waited {format_duration(self.config.thaw_wait)} for "
                                  f"room to thaw the {format_bytes(lease.frozen_bytes)} it froze ({short}); "
                                  "it comes back within its request, and what does not fit waits on disk "
                                  "(`%gpu restore`)", "thaw_elsewhere")
            return self.ledger.leases[lease.id]
        if short is None and lease.id in self._unknown:
            short = f"the driver has not said how its frozen process is ({self._unknown[lease.id]})"
        if short is not None:
            reason = (f"frozen in host memory: waiting until a GPU has room for the "
                      f"{format_bytes(lease.frozen_bytes)} it froze ({short})")
            if (lease.state, lease.reason, lease.physical) == ("pending", reason, ()):
                return lease
            return self.ledger.update(lease.id, state="pending", physical=(), reason=reason,
                                      logical=lease.logical if lease.planned_by else ())
        moves: dict[str, str] | None = None
        if set(physical) != set(lease.frozen_on):
            blocker = self.remap_blocker(lease, physical)
            if blocker is not None:
                lease = self.ledger.update(lease.id, logical=logical, physical=physical,
                                           fallback=blocker)
                self.ctx.reclaim.kill(lease, f"restarted on {self.ctx.labels(physical)} from its last good "
                                      f"checkpoint: it was frozen on {self.ctx.labels(lease.frozen_on)}, and "
                                      f"{blocker}", "thaw_elsewhere")
                return self.ledger.leases[lease.id]
            moves = dict(zip(lease.frozen_on, physical, strict=True))
        self.forget(lease.id)
        lease = self.ledger.update(lease.id, state="thawing", logical=logical, physical=physical,
                                   reason=f"thawing onto {self.ctx.labels(physical)}")
        self._act(lease.id, self._thaw(lease.id, moves, how))
        return lease

    def _thaw_room(self, lease: Lease, physical: tuple[str, ...],
                   measured: Sequence[GpuInfo] | None = None) -> str | None:
        """Why ``lease`` cannot thaw onto ``physical`` now (None: it can): each GPU must have
        what it froze and a CUDA context free, beside what other notebooks are owed there and
        what other thaws bring back (``measured``: the GPUs as read just now). A restore that
        runs out of memory can wedge the process for good (cuda-checkpoint#44)."""
        fresh = {g.uuid: g for g in measured or ()}
        for uuid in physical:
            known = self.ctx.gpu(uuid)
            gpu = fresh.get(uuid, known)
            if gpu is None or not gpu.healthy:
                return f"{self.ctx.gpu_label(uuid)} is not usable"
            context = known.context_size if known is not None else 0
            here = [other for other in self.ledger.leases.values()
                    if other.id != lease.id and uuid in other.physical]
            coming = sum(other.frozen_bytes for other in here if other.state == "thawing")
            owed = sum(max(0, o.request - o.usage) for o in here
                       if o.state in ("active", "shrinking"))
            headroom = int(self.config.headroom * gpu.memory_usable)
            free = gpu.memory_free - coming - min(owed, headroom)
            if free < lease.frozen_bytes + context:
                return (f"{self.ctx.gpu_label(uuid)} has {format_bytes(max(0, free))} free, "
                        f"and its thaw needs {format_bytes(lease.frozen_bytes + context)} with a "
                        "CUDA context")
        return None

    def remap_blocker(self, lease: Lease, physical: tuple[str, ...]) -> str | None:
        """Why the driver cannot thaw ``lease`` onto ``physical`` (None: it can)."""
        if self.freezer is None:
            return "this agent has no way to freeze processes"
        if not self.config.freeze_remap:
            return "thawing onto another GPU is off on this node (--freeze-remap turns it on)"
        if len(physical) != len(lease.frozen_on or lease.physical):
            return "it would run on another number of GPUs"
        if not self._can_remap:
            return "this driver thaws a process only onto the GPUs it was frozen on (r580 remaps)"
        names = {g.uuid: g.name for g in self.ctx.gpus}
        if any(names.get(old) != names.get(new)
               for old, new in zip(lease.frozen_on or lease.physical, physical, strict=True)):
            return "the driver thaws only onto a GPU of the same model"
        return None

    def _pairs(self, moves: Mapping[str, str] | None) -> dict[str, str] | None:
        """The GPU pairs a remapped restore needs: every GPU of the node, as NVML names them."""
        if not moves:
            return None
        return full_permutation(moves, [g.uuid for g in self.ctx.gpus])

    async def _thaw(self, lease_id: str, moves: Mapping[str, str] | None, how: str) -> None:
        """Thaw the lease's processes onto its GPUs; it runs there again, waits for room where
        the GPU has less than it froze (its restore is tried again), or restarts from its last
        good checkpoint where the driver cannot bring it back."""
        lease = self.ledger.leases[lease_id]
        started = time.monotonic()
        self._moving(lease_id, lease.frozen_bytes)
        outcome = await self._steps.thaw(lease, self._pairs(moves), functools.partial(
            self._thaw_room, lease, lease.physical))
        lease = self.ledger.leases.get(lease_id)  # type: ignore[assignment]
        if lease is None or lease.state != "thawing":
            return  # released (or stopped) meanwhile
        if outcome.wait is not None:
            log.info("lease %s: its thaw waits: %s", lease_id, outcome.wait)
            self.ledger.update(lease_id, state="pending", physical=(),
                               logical=lease.logical if lease.planned_by else (),
                               reason=f"frozen in host memory: waiting until a GPU has room for "
                                      f"the {format_bytes(lease.frozen_bytes)} it froze "
                                      f"({outcome.wait})")
            return
        if outcome.lost is not None or outcome.failed is not None:
            why = outcome.lost or outcome.failed
            log.warning("lease %s: thaw failed: %s", lease_id, why)
            lease = self.ledger.update(lease_id, fallback=why)
            self.ctx.reclaim.kill(lease, "restarted from its last good checkpoint (the variables "
                                  "of its last completed cell come back from disk; what was in "
                                  f"its frozen process is lost): {why}", "thaw_failed")
            return
        self._steps.out_of_memory.discard(lease_id)
        if outcome.note is not None:
            self.ledger.update(lease_id, fallback=outcome.note)
        seconds = time.monotonic() - started
        now = time.time()
        frozen_for = now - (lease.frozen_at or now)
        reason = (f"thawed on {self.ctx.labels(lease.physical)}, frozen in host memory for "
                  f"{format_duration(frozen_for)}")
        with self.ledger.transaction():
            lease = self.ledger.update(
                lease_id, state="active", parked_at=None, frozen_at=None, frozen_bytes=0,
                frozen_on=(), reason=reason, restore_until=now + self.config.restore_grace)
            self.ctx.directives.add(lease, "unparked", reason, gpu=lease.physical[0],
                                    gpus=list(lease.physical), request=lease.request, limit=lease.limit,
                                    thawed=True, frozen_s=round(frozen_for, 3),
                                    seconds=round(seconds, 3))
        for pid, _ in lease.pids:
            self.ctx.usage.track(lease, pid)
        self.ctx.usage.recount(lease_id)
        self.counters["thaws"] += 1
        self.stats.thawed(seconds)
        self.stats.unparked(how, lease_id)
        log.info("lease %s %s (thaw %.2fs)", lease_id, reason, seconds)

    # --- moves by freezing -------------------------------------------------------------
    def move_by_freezing(self, lease: Lease, reason: str, body: dict[str, Any]) -> None:
        """Move a ``migrating`` lease to its target by freezing it and thawing it there, in the
        background; where that fails, its client is asked to move it."""
        self._act(lease.id, self._frozen_move(lease.id, reason, body))

    async def _frozen_move(self, lease_id: str, reason: str, body: dict[str, Any]) -> None:
        """Move a running lease to its target by freezing it and thawing it there; where that
        fails, its client is asked to move it (a checkpoint and a restart)."""
        lease = self.ledger.leases[lease_id]
        moves = dict(zip(lease.physical, lease.target, strict=True))
        started = time.monotonic()
        by_pid, held = await self._held_now(lease)
        self._moving(lease_id, held)
        outcome = await self._steps.freeze(lease, by_pid, held)
        if outcome.failed is None and outcome.lost is None:
            moving = replace(lease, physical=lease.target, frozen_bytes=held)
            outcome = await self._steps.thaw(moving, self._pairs(moves), functools.partial(
                self._thaw_room, moving, moving.physical))
            why = outcome.failed or outcome.lost or outcome.wait
            if why is not None:
                # Thawed where it was, it can still be moved the old way; if not, it restarts.
                undone = await self._steps.thaw_back(lease.pids)
                if undone is not None:
                    current = self.ledger.leases.get(lease_id)
                    if current is not None and current.state == "migrating":
                        self.ctx.reclaim.kill(current, f"restarted on {self.ctx.labels(current.target)} "
                                              f"from its last good checkpoint: {why}; {undone}",
                                              "thaw_failed")
                    return
                outcome = Outcome(failed=why)
        lease = self.ledger.leases.get(lease_id)  # type: ignore[assignment]
        if lease is None or lease.state != "migrating":
            return  # released, or stopped by its deadline, meanwhile
        if outcome.lost is not None:
            self.ctx.reclaim.kill(lease, f"restarted on {self.ctx.labels(lease.target)} from its last "
                                  f"good checkpoint: {outcome.lost}", "thaw_failed")
            return
        if outcome.failed is not None:
            log.warning("lease %s: moving by freezing failed (%s); asking its client", lease_id,
                        outcome.failed)
            self.stats.freeze_fell_back("move")
            self.ledger.update(lease_id, fallback=outcome.failed)
            self.ctx.directives.add(lease, "migrate", reason, from_gpu=lease.physical[0],
                                    to_gpu=lease.target[0], deadline=lease.deadline, **body)
            return
        seconds = time.monotonic() - started
        source = lease.physical
        with self.ledger.transaction():
            lease = self.ledger.update(
                lease_id, state="active", physical=lease.target, target=(), deadline=None,
                fallback="", restore_until=time.time() + self.config.restore_grace)
            self.ctx.directives.add(lease, "moved", f"{reason}: frozen and thawed there in "
                                    f"{format_duration(seconds)}, nothing restarted", from_gpu=source[0],
                                    to_gpu=lease.physical[0], gpus=list(lease.physical),
                                    seconds=round(seconds, 3), request=lease.request, limit=lease.limit)
        for pid, _ in lease.pids:
            self.backend.untrack(pid)
            self.ctx.usage.track(lease, pid)
        self.ctx.usage.recount(lease_id)
        self.stats.frozen("move", seconds)
        self.stats.move_ended(lease_id, MIGRATED)
        log.info("lease %s moved %s -> %s by freezing in %.2fs", lease_id, source,
                 lease.physical, seconds)
        self.ctx.placement.activate_pending()

    # --- faults --------------------------------------------------------------------------
    def frozen_process_ended(self, lease: Lease) -> Lease:
        """A frozen process ended (the host's OOM killer, a crash): its GPU state went with it.
        The lease waits parked, so that its kernel, restarted from its last good checkpoint,
        starts without a GPU and its next cell gets one."""
        log.warning("lease %s: a frozen process ended; its kernel restarts from its checkpoint",
                    lease.id)
        self._unknown.pop(lease.id, None)
        return self.ledger.update(
            lease.id, state="parked", frozen_at=None, frozen_bytes=0, frozen_on=(),
            fallback="its frozen process ended, and with it what the freeze kept",
            reason="parked: its frozen process ended; its kernel restarts from its last good "
                   "checkpoint and its next cell gets a GPU")

    def resume_freezes(self) -> None:
        """At start: finish what a previous agent left under way, by what the driver says of
        each process, in the background. A freeze cut short is undone; a thaw is done again; a
        frozen lease whose process the driver says FAILED restarts from its checkpoint; one
        whose state it will not say stays frozen and is asked again."""
        if self.calls is None:
            return
        for lease in list(self.ledger.leases.values()):
            if lease.state in ("freezing", "thawing") or lease.frozen:
                self._act(lease.id, self._resume(lease.id, max(1.0, self.config.poll_interval)))

    async def _resume(self, lease_id: str, again: float) -> None:
        assert self.calls is not None
        lease = self.ledger.leases.get(lease_id)
        if lease is None:
            return
        states: set[str] = set()
        unknown: str | None = None
        for pid, start in lease.pids:
            try:
                states.add(await self.calls.call("state", pid, start))
            except FreezeError as exc:
                if exc.kind == NO_CUDA:
                    states.add(RUNNING)  # none of it is on a GPU
                elif exc.kind != GONE:  # an ended process is the poll's to let go
                    unknown = str(exc)
        current = self.ledger.leases.get(lease_id)
        if current is None:
            return
        lease = current
        if unknown is not None:
            # An error says nothing of the frozen state (a cuInit that failed, a container's
            # 304): it stays as it is, and the driver is asked again.
            self._unknown[lease_id] = unknown
            log.warning("lease %s: the driver would not say how its frozen process is (%s); "
                        "asked again in %s", lease_id, unknown, format_duration(again))
            asyncio.get_running_loop().call_later(again, self._ask_again, lease_id,
                                                  min(again * 2, ASK_AGAIN_MAX_S))
            return
        self._unknown.pop(lease_id, None)
        if FAILED in states:
            self.ctx.reclaim.kill(lease, "restarted from its last good checkpoint: the driver lost "
                                  "its frozen state while the agent was down", "thaw_failed")
        elif lease.state == "freezing":
            log.info("lease %s: a freeze was cut short by an agent restart; undoing it", lease_id)
            if states & {LOCKED, CHECKPOINTED}:
                await self._steps.thaw_back(lease.pids)
            if lease_id in self.ledger.leases:
                # Then at once, so no reader sees it running where a job waits to run.
                self.ledger.update(lease_id, state="active", reason="running: a freeze was cut "
                                   "short by an agent restart")
                self._make_way_again(lease_id)
        elif lease.state == "thawing":
            moved = set(lease.physical) != set(lease.frozen_on)
            await self._thaw(lease_id, dict(zip(lease.frozen_on, lease.physical, strict=True))
                             if moved else None, AT_ONCE)
        elif lease.state == "pending":
            self.ctx.placement.activate_pending()

    def _make_way_again(self, notebook_id: str) -> None:
        """A job still waits for the notebook whose freeze was undone (the ledger keeps what
        each pending lease waits for): it is frozen for the job again, or asked to park."""
        notebook = self.ledger.leases.get(notebook_id)
        if notebook is None or notebook.state not in ("active", "shrinking"):
            return
        for job in list(self.ledger.leases.values()):
            if (job.state == "pending" and notebook_id in job.waits_for
                    and set(job.physical) & set(notebook.physical)):
                log.info("lease %s: freezing it again for lease %s, which waits for it",
                         notebook_id, job.id)
                self.make_way(notebook, job)
                return

    def _ask_again(self, lease_id: str, again: float) -> None:
        if lease_id in self._unknown and lease_id not in self._acting:
            self._act(lease_id, self._resume(lease_id, again))
