"""Jobs: queued as they arrive, started once their memory is there, ended."""

from __future__ import annotations

from node_agent.simulator.core import Core
from node_agent.simulator.records import JobRun


class Jobs(Core):
    """The engine's handling of jobs."""

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
