"""Freezing: the driver keeps a notebook's GPU state in host memory (freeze) and restores it (thaw)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from node_agent import policy, procs
from node_agent.caps import mps_running
from node_agent.devices.base import CHECKPOINTED, FAILED, LOCKED, RUNNING, FreezeError
from node_agent.flows import common
from node_agent.flows.common import Caller, Conflict
from node_agent.flows.parking import NOT_NOW, notebook_only
from node_agent.flows.room import Room
from node_agent.ledger import KUBELET, Lease
from node_agent.quantities import format_bytes, format_duration
from node_agent.stats import AT_ONCE, MIGRATED

if TYPE_CHECKING:
    from node_agent.flows.context import Context

log = logging.getLogger("gpufrac.agent")
T = TypeVar("T")


class Freezing(Room):
    """The freezes and thaws under way (each runs the driver's calls in a thread), and the frozen
    leases whose kernel asked for its GPU back; the ledger keeps what each froze, and where."""

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        self.freezer = ctx.freezer
        # Freezes and thaws under way, by lease.
        self._acting: dict[str, asyncio.Future[Any]] = {}
        # Frozen leases whose kernel asked for its GPU back (a cell waits): since when.
        self._thaw_asked: dict[str, float] = {}

    async def probe(self) -> None:
        """At start: say whether this node can freeze. The driver's first look (cuInit) can
        take seconds: not on the loop, not later."""
        if self.freezer is None:
            return
        why = await asyncio.get_running_loop().run_in_executor(None, self.freezer.unavailable)
        if why:
            log.info("freezing: not available: %s", why)
        else:
            log.info("freezing: by %s", self.freezer.name)

    def status(self) -> dict[str, Any]:
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
        if self.ctx.usage.children(lease.id):
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
        self.ctx.polling.wake()
        lease = self.ctx.lease(caller, lease_id)
        notebook_only(lease)
        if lease.state == "parked":
            return lease
        if lease.state not in ("active", "shrinking"):
            raise Conflict("lease", f"lease is {lease.state}: "
                           + NOT_NOW.get(lease.state, "a freeze or thaw is under way"))
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
            if not task.cancelled() and task.exception() is not None:
                log.error("lease %s: freeze or thaw failed", lease_id,
                          exc_info=task.exception())

        task.add_done_callback(done)
        return task

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
            self.ctx.directives.add(lease, "frozen", reason, gpu=lease.frozen_on[0], gpus=list(
                lease.frozen_on), frozen_bytes=held, seconds=round(seconds, 3),
                                    waiting=then == "pending", cause=cause, request=lease.request,
                                    limit=lease.limit)
        for pid in pids:
            self.backend.untrack(pid)
        self.ctx.usage.gone(lease_id, set(pids))
        self.counters["freezes"] += 1
        self.stats.frozen(cause, seconds)
        self.stats.parked(lease_id)
        log.info("lease %s frozen in %.2fs (%s): %s", lease_id, seconds, format_bytes(held),
                 reason)
        self.ctx.placement.activate_pending()
        return None

    def ask_to_thaw(self, lease_id: str) -> None:
        """The frozen lease's kernel asked for its GPU back (a cell waits), from now on."""
        self._thaw_asked.setdefault(lease_id, time.monotonic())

    def thaw_asked(self, lease_id: str) -> bool:
        return lease_id in self._thaw_asked

    def forget(self, lease_id: str) -> None:
        """The lease was released: nothing of it is kept."""
        self._thaw_asked.pop(lease_id, None)

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
        if short is not None:
            reason = (f"frozen in host memory: waiting until a GPU has room for the "
                      f"{format_bytes(lease.frozen_bytes)} it froze ({short})")
            if (lease.state, lease.reason, lease.physical) == ("pending", reason, ()):
                return lease
            return self.ledger.update(lease.id, state="pending", physical=(), reason=reason,
                                      logical=lease.logical if lease.planned_by else ())
        remap: dict[str, str] | None = None
        if set(physical) != set(lease.frozen_on):
            blocker = self.remap_blocker(lease, physical)
            if blocker is not None:
                lease = self.ledger.update(lease.id, logical=logical, physical=physical,
                                           fallback=blocker)
                self.ctx.reclaim.kill(lease, f"restarted on {self.ctx.labels(physical)} from its last good "
                                      f"checkpoint: it was frozen on {self.ctx.labels(lease.frozen_on)}, and "
                                      f"{blocker}", "thaw_elsewhere")
                return self.ledger.leases[lease.id]
            remap = dict(zip(lease.frozen_on, physical, strict=True))
        self.forget(lease.id)
        lease = self.ledger.update(lease.id, state="thawing", logical=logical, physical=physical,
                                   reason=f"thawing onto {self.ctx.labels(physical)}")
        self._act(lease.id, self._thaw(lease.id, remap, how))
        return lease

    def _thaw_room(self, lease: Lease, physical: tuple[str, ...]) -> str | None:
        """Why ``lease`` cannot thaw onto ``physical`` now (None: it can): each GPU must have
        what it froze free beside what other notebooks are owed there and what other thaws
        bring back. A restore that runs out of memory can wedge the process for good."""
        for uuid in physical:
            gpu = self.ctx.gpu(uuid)
            if gpu is None or not gpu.healthy:
                return f"{self.ctx.gpu_label(uuid)} is not usable"
            here = [other for other in self.ledger.leases.values()
                    if other.id != lease.id and uuid in other.physical]
            coming = sum(other.frozen_bytes for other in here if other.state == "thawing")
            owed = sum(max(0, o.request - o.usage) for o in here
                       if o.state in ("active", "shrinking"))
            headroom = int(self.config.headroom * gpu.memory_usable)
            free = gpu.memory_free - coming - min(owed, headroom)
            if free < lease.frozen_bytes:
                return f"{self.ctx.gpu_label(uuid)} has {format_bytes(max(0, free))} free"
        return None

    def remap_blocker(self, lease: Lease, physical: tuple[str, ...]) -> str | None:
        """Why the driver cannot thaw ``lease`` onto ``physical`` (None: it can)."""
        if self.freezer is None:
            return "this agent has no way to freeze processes"
        if not self.config.freeze_remap:
            return "thawing onto another GPU is off on this node (--freeze-remap turns it on)"
        if len(physical) != len(lease.frozen_on or lease.physical):
            return "it would run on another number of GPUs"
        if not self.freezer.can_remap():
            return "this driver thaws a process only onto the GPUs it was frozen on (r580 remaps)"
        names = {g.uuid: g.name for g in self.ctx.gpus}
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
            self.ctx.reclaim.kill(lease, f"restarted from its last good checkpoint: {failed}",
                                  "thaw_failed")
            return
        seconds = time.monotonic() - started
        now = time.time()
        frozen_for = now - (lease.frozen_at or now)
        reason = (f"thawed on {self.ctx.labels(lease.physical)} after "
                  f"{format_duration(frozen_for)} frozen in host memory")
        with self.ledger.transaction():
            lease = self.ledger.update(
                lease_id, state="active", parked_at=None, frozen_at=None, frozen_bytes=0,
                frozen_on=(), reason=reason, restore_until=now + self.config.restore_grace)
            self.ctx.directives.add(lease, "unparked", reason, gpu=lease.physical[0],
                                    gpus=list(lease.physical), request=lease.request, limit=lease.limit,
                                    thawed=True, frozen_s=round(frozen_for, 3),
                                    seconds=round(seconds, 3))
        for pid in pids:
            self.ctx.usage.track(lease, pid)
        self.ctx.usage.recount(lease_id)
        self.counters["thaws"] += 1
        self.stats.thawed(seconds)
        self.stats.unparked(how, lease_id)
        log.info("lease %s %s (thaw %.2fs)", lease_id, reason, seconds)

    def move_by_freezing(self, lease: Lease, reason: str, body: dict[str, Any]) -> None:
        """Move a ``migrating`` lease to its target by freezing it and thawing it there, in the
        background; where that fails, its client is asked to move it."""
        self._act(lease.id, self._frozen_move(lease.id, reason, body))

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
                        self.ctx.reclaim.kill(current, f"restarted on {self.ctx.labels(current.target)} from "
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
                                    f"{seconds:.1f} s, nothing restarted", from_gpu=source[0],
                                    to_gpu=lease.physical[0], gpus=list(lease.physical),
                                    seconds=round(seconds, 3), request=lease.request, limit=lease.limit)
        for pid in pids:
            self.backend.untrack(pid)
            self.ctx.usage.track(lease, pid)
        self.ctx.usage.recount(lease_id)
        self.stats.frozen("move", seconds)
        self.stats.move_ended(lease_id, MIGRATED)
        log.info("lease %s moved %s -> %s by freezing in %.2fs", lease_id, source,
                 lease.physical, seconds)
        self.ctx.placement.activate_pending()

    def frozen_process_ended(self, lease: Lease) -> Lease:
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

    def resume_freezes(self) -> None:
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
                self.ctx.reclaim.kill(lease, "restarted from its last good checkpoint: the driver lost "
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
