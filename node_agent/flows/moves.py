"""Moves: notebooks sent to another GPU, until their client says they are done or a deadline stops them."""

from __future__ import annotations

import time
from typing import Any

from node_agent import policy
from node_agent.flows.common import Caller, Conflict, whose
from node_agent.flows.room import Room
from node_agent.ledger import Lease
from node_agent.stats import MIGRATED
from node_agent.words import LEASE_STATE_WORDS


class Moves(Room):
    """The moves under way (the ledger keeps them: ``migrating`` leases, their targets and
    deadlines)."""

    def start_moves(self, moves: list[policy.Move], why: str, cause: Lease | None = None
                     ) -> None:
        """Move each of ``moves`` to ``why`` (``for`` ``cause``, named as its user may read)."""
        deadline = time.time() + self.config.migrate_grace
        for move in moves:
            lease = self.ledger.leases[move.lease_id]
            whom = "" if cause is None else f" for {whose(cause, lease.owner_uid)}"
            reason = (f"moved from {self.ctx.labels(move.from_gpus)} to {self.ctx.labels(move.to_gpus)} "
                      f"to {why}{whom}")
            lease = self.ledger.update(
                lease.id, state="migrating", target=move.to_gpus, deadline=deadline, reason=reason
            )
            self.move(lease, reason, moved_bytes=move.moved_bytes)
            self.counters["migrations"] += 1
            self.stats.move_started(lease.id, "compaction")

    def move(self, lease: Lease, reason: str, **body: Any) -> None:
        """Carry out the move of a ``migrating`` lease to its target: freeze and thaw it there
        where the driver can remap (nothing restarts), else ask its client to (``migrate``:
        a checkpoint and a restart on the target)."""
        freezing = self.ctx.freezing
        blocker = freezing.freeze_blocker(lease) or freezing.remap_blocker(lease, lease.target)
        if blocker is None:
            freezing.move_by_freezing(lease, reason, body)
            return
        self.ctx.directives.add(lease, "migrate", reason, from_gpu=lease.physical[0],
                                to_gpu=lease.target[0], deadline=lease.deadline, **body)

    def migrated(self, caller: Caller, lease_id: str) -> Lease:
        """The lease's client says its move is done: it runs on its target from now on."""
        self.ctx.polling.wake()
        lease = self.ctx.lease(caller, lease_id)
        if lease.state != "migrating":
            raise Conflict("lease", f"the lease is {LEASE_STATE_WORDS.get(lease.state, lease.state)}, "
                                    "not moving")
        with self.ledger.transaction():
            lease = self.ledger.update(
                lease.id, state="active", physical=lease.target, target=(), deadline=None,
                reason=lease.reason, restore_until=time.time() + self.config.restore_grace,
            )
            for pid, _ in lease.pids:
                self.ctx.usage.track(lease, pid)
        # Its usage is what it holds on the GPU it runs on now: what it held on the one it
        # left (an old process still ending there) is not its to count here.
        self.ctx.usage.recount(lease.id)
        self.stats.move_ended(lease.id, MIGRATED)
        self.ctx.placement.activate_pending()
        return self.ledger.leases[lease.id]

    def enforce_deadlines(self, now: float) -> None:
        """Stop each move still under way at its deadline: it restarts on its target."""
        for lease in list(self.ledger.leases.values()):
            if lease.state == "migrating" and lease.deadline and now >= lease.deadline:
                src, dst = self.ctx.labels(lease.physical), self.ctx.labels(lease.target)
                self.ctx.reclaim.kill(lease, f"stopped because its move from {src} to {dst} did not finish "
                                      f"within {self.config.migrate_grace:g}s (a move that timed out, not a "
                                      f"memory problem): it restarts on {dst} from its last good checkpoint. "
                                      f"Why it moved: {lease.reason}", "migrate_timeout")
