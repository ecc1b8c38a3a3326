"""Placement: which node takes a lease and where on it, when it starts, and its release."""

from __future__ import annotations

from functools import partial

from node_agent import policy
from node_agent.policy import JOB, NOTEBOOK
from node_agent.simulator.core import Core
from node_agent.simulator.policies import NO_COMPACTION
from node_agent.simulator.records import ACTIVE, FROZEN, PENDING, RESTARTING, JobRun, Lease, Node, SessionRun
from node_agent.simulator.shares import Share


class Placing(Core):
    """The engine's placing, activating and releasing of leases."""

    def _place(self, request: SessionRun | JobRun) -> bool:
        """Put ``request`` on the fullest node that takes it (a cluster scheduler's binpack, on
        requests); within the node, the policy decides where it goes and what moves."""
        if isinstance(request, SessionRun):
            share = request.share
            assert share is not None
            kind = JOB if self.policy.reserve else NOTEBOOK
            if self.policy.reserve:
                share = Share(self.spec.largest, self.spec.largest, share.devices)
        else:
            share, kind = request.share, JOB
        nodes = sorted(self.nodes, key=lambda n: (-n.logical_share(), n.index))
        if isinstance(request, SessionRun) and request.home is not None:
            nodes = [request.home]  # a frozen process thaws on the node whose host memory holds it
        for node in nodes:
            # The same shape that did not fit an unchanged node does not fit it now.
            key = (node.index, node.version, kind, share)
            if key in self._no_room:
                continue
            planned = node.planned()
            logical = policy.plan_logical(node.devices, planned, share.request, share.devices, self.rules)
            if logical is None:
                self._no_room.add(key)
                continue
            physical = policy.plan_physical(node.devices, planned, kind, share.request, logical,
                                            share.limit, self.rules)
            moves = policy.plan_compaction(node.devices, planned, {u: share.request for u in physical},
                                           self.rules)
            if moves is None or (moves and self.policy.compaction == NO_COMPACTION):
                self._no_room.add(key)
                continue
            lease = Lease(f"L{next(self._ids)}", kind, share, node, logical, physical, self.now, request)
            node.leases[lease.id] = lease
            node.changed()
            request.lease = lease
            request.queued = False
            if isinstance(request, SessionRun) and request.parked_frozen:
                assert request.parked_usage is not None
                lease.frozen_bytes = request.parked_usage
                request.parked_usage, request.parked_frozen, request.home = None, False, None
            elif isinstance(request, SessionRun) and request.parked_usage is not None:
                lease.reattach, lease.restore_to = True, request.parked_usage
                request.parked_usage = None
            for move in moves:
                self._compact(node.leases[move.lease_id], move.to_gpus)
            self._activate(node)
            return True
        if isinstance(request, SessionRun) and not request.waited:
            request.waited = True
            self.result.sessions_queued += 1
        return False

    def _activate(self, node: Node) -> None:
        pending = {lease.id for lease in node.leases.values() if lease.state == PENDING}
        if not pending:
            return
        for lease_id in policy.plan_activation(node.devices, node.running(), pending, self.rules):
            lease = node.leases[lease_id]
            if isinstance(lease.owner, JobRun):
                lease.state = ACTIVE  # starts once its memory is there (_try_job)
                self._starting[lease.owner] = None
                continue
            if lease.frozen_bytes:
                # Moved or re-leased while frozen: it thaws here once its memory fits.
                lease.state, lease.usage = FROZEN, 0
                self._thawing[lease] = None
                continue
            lease.state = RESTARTING if lease.reattach or lease.restore_to else ACTIVE
            # The new process's CUDA context, where there is memory for it.
            lease.usage = 0
            lease.usage = min(self.context, self._free(lease))
            if lease.usage < self.context:
                self.result.short_of_memory += 1
            if lease.state == RESTARTING:
                # Re-attach after a park, or the kernel restoring after a move: its state comes back.
                delay = self.timing.reattach if lease.reattach else 0.0
                lease.token += 1
                self._at(self.now + delay, partial(self._restored, lease, lease.token), first=True)

    def _restored(self, lease: Lease, token: int) -> None:
        if token != lease.token or lease.node.leases.get(lease.id) is not lease:
            return
        lease.state = ACTIVE
        lease.reattach = False
        lease.restore_until = self.now + self.timing.restore_grace
        # It loads what fits without setting off a reclaim; the rest waits on disk.
        lease.usage = max(lease.usage, min(lease.restore_to, lease.usage + self._fit(lease)))
        lease.restore_to = 0

    def _release(self, lease: Lease) -> None:
        node = lease.node
        if node.leases.pop(lease.id, None) is None:
            return
        node.changed()
        lease.token += 1
        self._waiting.discard(lease.id)
        self._thawing.pop(lease, None)
        self._freed = True
        self._activate(node)
