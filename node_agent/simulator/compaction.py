"""Compaction: a lease moved to make room, by a kill or by checkpoint and restart."""

from __future__ import annotations

from node_agent.simulator.core import Core
from node_agent.simulator.policies import COMPACT_BY_KILL, COMPACT_BY_MOVE
from node_agent.simulator.records import IN_FLIGHT, LEAVING, PENDING, Lease, SessionRun


class Compaction(Core):
    """The engine's moves for compaction."""

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
