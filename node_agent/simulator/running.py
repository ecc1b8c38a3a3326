"""What runs: each running cell's and job's speed under compute contention, and its end."""

from __future__ import annotations

from functools import partial

from node_agent.simulator.contention import speeds
from node_agent.simulator.core import Core
from node_agent.simulator.records import JobRun, SessionRun


class Running(Core):
    """The engine's pace of running cells and jobs."""

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
