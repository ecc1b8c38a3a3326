"""Sessions and their cells: a kernel's lease, cells due, run and ended, an idle kernel parked."""

from __future__ import annotations

from functools import partial

from node_agent.simulator.core import Core
from node_agent.simulator.records import ACTIVE, FROZEN_STATES, LEAVING, SessionRun
from node_agent.simulator.shares import cell_demand


class Sessions(Core):
    """The engine's handling of notebook sessions and their cells."""

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
