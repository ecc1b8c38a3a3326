"""Parking: notebooks that give their GPU back while idle, and placing them again for their next cell."""

from __future__ import annotations

import logging
import time

from node_agent import policy
from node_agent.flows.common import Caller, Conflict
from node_agent.flows.placement import kept_plan
from node_agent.flows.room import Room
from node_agent.ledger import Lease
from node_agent.stats import AT_ONCE

log = logging.getLogger("gpufrac.agent")

# What a notebook lease may be parked from: a move under way must end first, and a killed
# lease is restarting already.
PARKABLE = ("active", "shrinking", "pending", "parked")
# Why a lease in one of these states is not parked (or asked to park) now: a 409's words.
NOT_NOW = {
    "migrating": "a move is under way; park it once the move is done",
    "killed": "its kernel is restarting after it was stopped; park it once it runs again",
    "parked": "it is parked already",
    "pending": "it has no GPU to give back yet",
}


def notebook_only(lease: Lease) -> None:
    """Refuse (Conflict) to park a lease that is not a notebook's."""
    if lease.kind != policy.NOTEBOOK:
        raise Conflict("lease", f"lease is a {lease.kind}: only notebook leases park (a job "
                                "holds its GPUs until it ends)")


class Parking(Room):
    """The parked leases (the ledger keeps them: ``parked``, or ``pending`` with no GPU)."""

    def park(self, caller: Caller, lease_id: str, reason: str | None = None) -> Lease:
        """The client restarts the lease's kernel with no GPU (an idle kernel, or a wait for
        one cancelled): the lease gives its memory back at once, and what waited for it may run."""
        self.ctx.polling.wake()
        lease = self.ctx.lease(caller, lease_id)
        notebook_only(lease)
        if lease.state == "parked":
            return lease
        if lease.state not in PARKABLE:
            raise Conflict("lease", f"lease is {lease.state}: {NOT_NOW[lease.state]}")
        # The cluster's plan holds while it is parked (the cluster still counts it there).
        lease = self.ledger.update(
            lease.id, state="parked", logical=lease.logical if lease.planned_by else (),
            physical=(), target=(), deadline=None,
            parked_at=time.time(),
            reason=reason or "parked: its idle kernel gave the GPU back; its next cell gets one "
                             "first")
        # Its process keeps its variables in host memory from now on: none of it is device
        # memory, and what its processes held leaves the GPU's use now, not at the next sweep.
        for pid, _ in lease.pids:
            self.backend.untrack(pid)
        self.ctx.usage.gone(lease.id, {pid for pid, _ in lease.pids})
        self.stats.parked(lease.id)
        log.info("lease %s parked: %s", lease.id, lease.reason)
        self.ctx.placement.activate_pending()
        return self.ledger.leases[lease.id]

    def park_request(self, caller: Caller, lease_id: str) -> Lease:
        """The kernel asks to be parked (``%gpu park``): its client, who restarts kernels, is
        asked to with a ``park`` directive, and parks it with :meth:`park`."""
        self.ctx.polling.wake()
        lease = self.ctx.lease(caller, lease_id)
        notebook_only(lease)
        if lease.state not in ("active", "shrinking"):
            raise Conflict("lease", f"lease is {lease.state}: {NOT_NOW[lease.state]}")
        self.ctx.directives.add(lease, "park", "parked at its user's request (`%gpu park`)",
                                gpu=lease.physical[0], request=lease.request, limit=lease.limit)
        return lease

    def unpark(self, caller: Caller, lease_id: str) -> Lease:
        """A parked lease's kernel needs a GPU (its next cell): placed as a new notebook is, or
        left pending, saying why, until the agent can place it."""
        self.ctx.polling.wake()
        lease = self.ctx.lease(caller, lease_id)
        if lease.frozen:
            self.ctx.freezing.ask_to_thaw(lease.id)
        if lease.state != "parked":
            return lease  # it has a GPU, or waits for one already
        self.stats.unpark_asked(lease.id)
        lease = self.place_waiting(lease, AT_ONCE)
        if lease.state == "pending":
            self.stats.unpark_waited()
        return lease

    def place_waiting(self, lease: Lease, how: str) -> Lease:
        """Places a lease that has no GPU (it was parked) as a new notebook is placed: active
        where a GPU has room, pending while notebooks move to make room, or pending with the
        reason in words while no GPU has room (``how``: AT_ONCE or AFTER_WAIT, for /metrics).

        A frozen lease that nobody waits for thaws where it was frozen (or where the driver can
        remap it): elsewhere it would restart. Once a cell waits, any GPU with room will do."""
        kept = kept_plan(lease)
        others = self.ctx.planning_view(lease.id)
        try:
            if lease.frozen and self.ctx.freezing.remap_blocker(lease, lease.frozen_on) is not None:
                try:
                    placed = self.ctx.placement.place(lease.kind, lease.request, lease.limit, lease.devices,
                                                      others, **{**kept, "reach": lease.frozen_on})
                except Conflict:
                    if not self.ctx.freezing.thaw_asked(lease.id):
                        raise
                    placed = self.ctx.placement.place(lease.kind, lease.request, lease.limit,
                                                      lease.devices, others, **kept)
            else:
                placed = self.ctx.placement.place(lease.kind, lease.request, lease.limit, lease.devices,
                                                  others, **kept)
            logical, physical, moves = placed
        except Conflict:
            reason = self.ctx.placement.no_room_reason(lease)
            if lease.frozen:
                reason = f"frozen in host memory, {reason}"
            if (lease.state, lease.reason) == ("pending", reason):
                return lease  # nothing new to say: no write
            return self.ledger.update(lease.id, state="pending", reason=reason)
        if not moves:
            return self.unparked(lease, logical, physical, how)
        with self.ledger.transaction():
            lease = self.ledger.update(
                lease.id, state="pending", logical=logical, physical=physical,
                reason=self.ctx.placement.waiting_reason(moves, lease.owner_uid),
                waits_for=tuple(m.lease_id for m in moves))
            self.ctx.moves.start_moves(moves, f"free {self.ctx.labels(physical)}", lease)
        return lease

    def unparked(self, lease: Lease, logical: tuple[str, ...], physical: tuple[str, ...],
                 how: str) -> Lease:
        """A lease that was parked runs on ``physical`` again: its processes are followed there
        and its client told, with what it may hold (a frozen one once it is thawed)."""
        if lease.frozen:
            return self.ctx.freezing.start_thaw(lease, logical, physical, how)
        reason = f"unparked: placed on {self.ctx.labels(physical)}" + (
            "" if how == AT_ONCE else " once room appeared")
        with self.ledger.transaction():
            # Its kernel brings back what it held in host memory: a grace, as after a move.
            lease = self.ledger.update(
                lease.id, state="active", logical=logical, physical=physical, parked_at=None,
                reason=reason, restore_until=time.time() + self.config.restore_grace)
            self.ctx.directives.add(lease, "unparked", reason, gpu=physical[0], gpus=list(physical),
                                    request=lease.request, limit=lease.limit)
        for pid, _ in lease.pids:
            self.ctx.usage.track(lease, pid)
        self.stats.unparked(how, lease.id)
        log.info("lease %s %s", lease.id, reason)
        return lease
