"""The discrete-event simulation: sessions, cells and jobs over time, every decision by node_agent.policy."""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from functools import partial

from node_agent.simulator.compaction import Compaction
from node_agent.simulator.core import Observer, Timing, traced_use
from node_agent.simulator.freezing import Freezing
from node_agent.simulator.jobs import Jobs
from node_agent.simulator.metrics import Result
from node_agent.simulator.node_spec import NodeSpec
from node_agent.simulator.placement import Placing
from node_agent.simulator.policies import Policy
from node_agent.simulator.reclaim import Reclaim
from node_agent.simulator.records import ACTIVE, FROZEN, PENDING
from node_agent.simulator.running import Running
from node_agent.simulator.sampling import Sampling
from node_agent.simulator.sessions import Sessions
from node_agent.simulator.traces import JobSpec, Session

__all__ = ["FROZEN", "PENDING", "Engine", "Observer", "Timing", "nodes_needed", "simulate", "traced_use"]


class Engine(Sessions, Jobs, Placing, Compaction, Reclaim, Freezing, Running, Sampling):
    """One policy over one workload on ``nodes`` nodes of ``spec``.

    Placement (``plan_logical``, ``plan_physical``), room for an arrival (``plan_compaction``), when
    a placed lease may start (``plan_activation``), memory a lease may take (``room``) and taking it
    back (``plan_reclaim``, ``reclaim_step``) are the agent's policy functions, called as the agent
    calls them; the engine decides only time, and which node (a cluster scheduler's binpack).
    """

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
             jobs: Sequence[JobSpec] = (), timing: Timing = Timing(),  # noqa: B008 (a frozen dataclass)
             *, start: float | None = None, end: float | None = None, observer: Observer | None = None,
             progress: Callable[[float], None] | None = None, contention: bool = True,
             traced_compute: bool = False) -> Result:
    """Run one policy over the workload and return what it measured. ``contention``: workloads
    sharing a GPU's compute slow each other; ``traced_compute``: a cell asks for its traced
    utilisation of the GPU rather than all of it."""
    return Engine(policy_, spec, nodes, sessions, jobs, timing, start=start, end=end,
                  observer=observer, progress=progress, contention=contention,
                  traced_compute=traced_compute).run()
