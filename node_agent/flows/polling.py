"""The poll: when the next tick is due (a quiet node is polled less), and what one tick does."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import TYPE_CHECKING

from node_agent.flows.room import Room

if TYPE_CHECKING:
    from node_agent.flows.context import Context

log = logging.getLogger("gpufrac.agent")

# After this many polls in a row that saw nothing change, the interval doubles, up to
# POLL_STRETCH times --poll-interval. Measuring is all an idle agent does; but an owner
# growing into loaned memory is seen only by measuring, so the stretch stays short.
QUIET_TICKS = 3
POLL_STRETCH = 4


class Polling(Room):
    """The poll's task and its pace: the quiet ticks since the last change, the stretch of the
    interval, when the last tick ended (monotonic), the time it judged deadlines by, and the
    event a call that changes something sets to end a stretched wait."""

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        self._task: asyncio.Task[None] | None = None
        self.tick_seconds = 0.0
        self._quiet = 0
        self._stretch = 1
        self._ticked = 0.0
        self._judged = 0.0
        self._woken = asyncio.Event()

    def run(self) -> None:
        """Poll from now on, in a task of the running loop."""
        self._task = asyncio.create_task(self._poll(), name="gpufrac-poll")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _poll(self) -> None:
        while True:
            await self._until_due()
            try:
                await self.tick()
            except Exception:
                log.exception("poll failed; will try again in %.1fs", self.config.poll_interval)

    def wake(self) -> None:
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
        the same object, compared at no cost), and a directive replaces the directives' token."""
        return (*self.ledger.leases.values(), self.ctx.directives.last(),
                *self.ctx.usage.reported())

    async def tick(self) -> None:
        """One poll: measure, forget dead processes, release orphans, reclaim, enforce deadlines."""
        started = time.perf_counter()
        before = self._state()
        loop = asyncio.get_running_loop()
        try:
            # All blocking backend calls of one tick, in one sweep, in a worker thread.
            m = await loop.run_in_executor(None, self.backend.sweep)
            measured_anew = self.ctx.usage.measured(m)
            now = time.time()
            self.ctx.usage.update_usage(m)
            self.ctx.usage.forget_dead(now)
            self.ctx.moves.enforce_deadlines(now)
            self.ctx.reclaim.reclaim(now)
            self.ctx.placement.activate_pending()
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
