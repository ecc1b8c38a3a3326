"""Freezing: the driver's checkpoint into host memory, thaws (or remapped), and the cells that wait."""

from __future__ import annotations

from functools import partial

from node_agent import policy
from node_agent.policy import NOTEBOOK
from node_agent.simulator.core import Core
from node_agent.simulator.policies import NO_RECLAIM
from node_agent.simulator.records import (
    ACTIVE,
    FREEZING,
    FROZEN,
    LEAVING,
    PENDING,
    THAWING,
    Lease,
    SessionRun,
)


class Freezing(Core):
    """The engine's freezes and thaws (issue 9)."""

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
