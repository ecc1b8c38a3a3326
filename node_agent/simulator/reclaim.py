"""Memory: what a lease may take, and loans taken back by the ladder (shrink, then kill or freeze)."""

from __future__ import annotations

from collections.abc import Iterable

from node_agent import policy
from node_agent.policy import Device, Placement
from node_agent.simulator.core import Core
from node_agent.simulator.policies import NO_RECLAIM, RECLAIM_BY_KILL
from node_agent.simulator.records import FROZEN, FROZEN_STATES, LEAVING, RESTARTING, Lease, SessionRun


class Reclaim(Core):
    """The engine's grants of memory and its reclaim."""

    def _used(self, holding: Iterable[Placement], uuid: str) -> int:
        return sum(p.usage for p in holding if uuid in p.physical)

    def _free(self, lease: Lease) -> int:
        """Bytes free on the fullest of ``lease``'s GPUs."""
        holding = lease.node.holding()
        devices = [lease.node.by_uuid[u] for u in lease.physical]
        return max(0, min((d.total - self._used(holding, d.uuid) for d in devices), default=0))

    def _fit(self, lease: Lease) -> int:
        """Bytes per GPU ``lease`` may add now without anyone giving anything back."""
        holding = lease.node.holding()
        headroom = self._headroom
        grow = []
        for uuid in lease.physical:
            device = lease.node.by_uuid[uuid]
            used = self._used(holding, uuid)
            room = policy.room(device, holding, lease.id, used, headroom(device))
            grow.append(max(0, min(room, device.total - used)))
        return min(grow, default=0)

    def _headroom(self, device: Device) -> int:
        return int(self.timing.headroom * device.total)

    def _grant(self, lease: Lease, demand: int) -> bool:
        """Give ``lease`` ``demand`` bytes per GPU, taking loans back as the policy does. False
        when it must wait for a borrower (its cell or job starts later)."""
        if demand <= lease.usage:
            lease.usage = demand
            self._waiting.discard(lease.id)
            return True
        if self.policy.reclaim != NO_RECLAIM:
            for uuid in lease.physical:
                if not self._reclaim_for(lease, lease.node.by_uuid[uuid], min(demand, lease.share.request)):
                    self._waiting.add(lease.id)
                    return False
        self._waiting.discard(lease.id)
        granted = lease.usage + self._fit(lease)
        if granted < demand:
            self.result.short_of_memory += 1
        lease.usage = min(demand, granted)
        return True

    def _reclaim_for(self, owner: Lease, device: Device, want: int) -> bool:
        """Take loans back on ``device`` until ``owner`` can hold ``want`` (within its request).
        False while a borrower still has its grace."""
        for _ in range(len(owner.node.leases) + 1):
            holding = owner.node.holding()
            used = self._used(holding, device.uuid)
            free = device.total - used
            if owner.usage + free >= want:
                return True
            # The owner takes what is free; then it is owed the rest, which plan_reclaim finds.
            grown = owner.usage + free
            view = [
                Placement(p.id, p.kind, p.request, p.logical, p.physical, grown, p.created, p.limit)
                if p.id == owner.id else p for p in holding
            ]
            restoring = frozenset(
                lease.id for lease in owner.node.leases.values() if lease.restore_until > self.now)
            chosen = policy.plan_reclaim(device, view, device.total, self._headroom(device), restoring)
            if not chosen:
                return True  # nothing more to take back: the rest is not owed to it
            waiting = False
            for reclaim in chosen:
                borrower = owner.node.leases[reclaim.lease_id]
                waiting |= not self._take_back(borrower)
            if waiting:
                return False
        return True

    def _take_back(self, borrower: Lease) -> bool:
        """One rung of the policy's reclaim for a borrower; True when its loan is back now."""
        s = borrower.owner
        if borrower.state in FROZEN_STATES:
            return borrower.state == FROZEN  # freezing: its memory leaves when done
        if self.policy.reclaim == RECLAIM_BY_KILL:
            self.result.kills += 1
            if isinstance(s, SessionRun):
                self.result.lost_sessions.add(s.session.id)
                self._cut_off(s)
            borrower.usage = self.context
            return True
        standing = policy.Standing(borrower.usage, borrower.share.request, borrower.share.limit,
                                   borrower.shrinking, borrower.deadline)
        step = policy.reclaim_step(standing, self.now, owed=True, grace=self.timing.reclaim_grace,
                                   enforce_limit=False)
        idle = not isinstance(s, SessionRun) or s.cell is None
        if step.action == policy.SHRINK:
            if idle:
                self._shrink(borrower)
                return True
            borrower.shrinking, borrower.deadline = True, step.at
            assert step.at is not None
            token = borrower.token
            self._at(step.at, lambda: self._deadline(borrower, token), first=True)
            return False
        if step.action == policy.KILL:
            if self.policy.freeze:
                self._freeze(borrower)
                return False  # its memory is back once the freeze is done
            self._restart(borrower)
            return True
        return step.action != policy.WAIT

    def _shrink(self, lease: Lease) -> None:
        self.result.shrinks += 1
        lease.usage = min(lease.usage, lease.share.request)
        lease.shrinking, lease.deadline = False, None
        self._freed = True

    def _deadline(self, lease: Lease, token: int) -> None:
        if token != lease.token or not lease.shrinking or lease.node.leases.get(lease.id) is not lease:
            return
        standing = policy.Standing(lease.usage, lease.share.request, lease.share.limit, True, lease.deadline)
        # Still owed: someone on one of its GPUs waits for memory.
        owed = any(
            waiter in lease.node.leases and set(lease.node.leases[waiter].physical) & set(lease.physical)
            for waiter in self._waiting
        )
        step = policy.reclaim_step(standing, self.now, owed=owed, grace=self.timing.reclaim_grace,
                                   enforce_limit=False)
        if step.action == policy.KILL:
            if self.policy.freeze:
                self._freeze(lease)
            else:
                self._restart(lease)
        elif step.action == policy.CANCEL:
            lease.shrinking, lease.deadline = False, None

    def _restart(self, lease: Lease) -> None:
        """The ladder's last rung: kill, restart in place, restore the last good checkpoint."""
        self.result.reclaim_restarts += 1
        if lease.state == LEAVING:
            self._begin_move(lease)  # it was to move anyway: the kill is its checkpoint and restart
            return
        s = lease.owner
        if isinstance(s, SessionRun):
            self._cut_off(s)
        self.result.restarts += 1
        lease.restore_to = min(lease.usage, lease.share.request)
        lease.usage = self.context
        lease.shrinking, lease.deadline = False, None
        lease.state = RESTARTING
        lease.token += 1
        token = lease.token
        self._freed = True
        self._at(self.now + self.timing.move, lambda: self._restored(lease, token), first=True)
