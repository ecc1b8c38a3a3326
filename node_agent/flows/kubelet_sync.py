"""The kubelet's sync: a job lease for each GPU a pod holds whole, and the notebooks moved off it."""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Mapping
from dataclasses import replace
from typing import TYPE_CHECKING

from node_agent import policy
from node_agent.flows.common import Conflict
from node_agent.flows.placement import kept_plan
from node_agent.flows.room import Room
from node_agent.kubelet.claims import WholeGpus
from node_agent.ledger import KUBELET, Lease

if TYPE_CHECKING:
    from node_agent.flows.context import Context

log = logging.getLogger("gpufrac.agent")


class KubeletSync(Room):
    """The pods' job leases (the ledger keeps them), and what was said of the pods once."""

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        # (pod container, GPU) the kubelet lists that this agent does not see (said once each),
        # and notebooks on pods' GPUs asked to park, once each.
        self._unseen_pods: set[tuple[str, str]] = set()
        self._parks_asked: set[str] = set()

    def sync_cluster(self, claims: Mapping[str, WholeGpus]) -> None:
        """A job lease for every GPU a container was given whole (``claims`` by ``namespace/
        pod/container``, from the kubelet), pinned there while the container holds it and
        released when it no longer does; then the notebooks running on those GPUs are moved
        off, or asked to park where no GPU they can reach has room."""
        wanted = {(key, uuid): claim for key, claim in claims.items() for uuid in claim.gpus}
        held = {(lease.name, lease.logical[0]): lease for lease in self.ledger.leases.values()
                if lease.planned_by == KUBELET}
        for (key, uuid), lease in held.items():
            if (key, uuid) not in wanted:
                log.info("lease %s: pod container %s no longer holds %s, released", lease.id, key,
                         self.ctx.gpu_label(uuid))
                self.ctx.polling.wake()
                self.ctx.placement.end(lease)
        new = [(uuid, claim) for (key, uuid), claim in wanted.items() if (key, uuid) not in held]
        unseen = {(claim.key, uuid) for uuid, claim in new if self.ctx.gpu(uuid) is None}
        for key, uuid in sorted(unseen - self._unseen_pods):  # said once, not at every look
            log.warning("pod container %s holds %s, which is no GPU this agent sees (%s)", key,
                        uuid, ", ".join(g.uuid for g in self.ctx.gpus))
        self._unseen_pods = unseen
        pinned = [(uuid, claim) for uuid, claim in new if (claim.key, uuid) not in unseen]
        if pinned:
            self.ctx.polling.wake()
            now = time.time()
            with self.ledger.transaction():
                for uuid, claim in pinned:
                    size = self.ctx.gpu(uuid).memory_usable  # type: ignore[union-attr]
                    self.ledger.insert(Lease(
                        id="l-" + secrets.token_hex(6), kind=policy.JOB, owner_uid=0,
                        client=KUBELET, name=claim.key, request=size, limit=size,
                        request_spec="1", limit_spec="1", logical=(uuid,), physical=(uuid,),
                        state="active", created=now, updated=now, planned_by=KUBELET,
                        reason=f"pod container {claim.key} holds {self.ctx.gpu_label(uuid)} whole "
                               "(from the kubelet)",
                        pod=(claim.namespace, claim.pod, claim.container)))
                    log.info("pod container %s holds %s whole: a job lease pinned there",
                             claim.key, self.ctx.gpu_label(uuid))
        self._evacuate()

    def pods_gpus(self) -> dict[str, Lease]:
        """GPU -> the lease of the pod container the cluster gave it whole."""
        return {uuid: lease for lease in self.ledger.leases.values()
                if lease.planned_by == KUBELET for uuid in lease.physical}

    def _evacuate(self) -> None:
        """Move notebooks off the GPUs pods hold, re-place what waits for one of them, and ask
        a notebook with nowhere to go to park (once): its guarantee is void there, and reclaim
        takes what it holds as the pod needs it."""
        pods = self.pods_gpus()
        leases = self.ledger.leases
        if not pods:
            self._parks_asked.clear()
            return
        for lease in list(leases.values()):
            if (lease.state == "pending" and not lease.planned_by
                    and set(lease.physical) & set(pods)):
                self._place_again(lease, pods)
        running = [lease for lease in leases.values() if lease.planned_by != KUBELET
                   and lease.state in ("active", "shrinking") and set(lease.physical) & set(pods)]
        self._parks_asked &= {lease.id for lease in running}
        if not running:
            return
        # Only what runs may move: a lease on its way, waiting or stopped stays put here.
        others = [p if leases[p.id].state in ("active", "shrinking")
                  else replace(p, logical=p.physical, fixed=True)
                  for p in self.ctx.planning_view() if leases[p.id].planned_by != KUBELET]
        plan = policy.plan_evacuation(self.ctx.devices(), others,
                                      {uuid: pod.request for uuid, pod in pods.items()},
                                      self.config.rules)
        to_park = [leases[i] for i in plan.stranded if i not in self._parks_asked
                   and leases[i].state in ("active", "shrinking")]
        if not plan.moves and not to_park:
            return
        self.ctx.polling.wake()
        with self.ledger.transaction():
            for lease_id, logical in plan.relocated.items():
                self.ledger.update(lease_id, logical=logical)
            for move in plan.moves:
                pod = pods[next(u for u in move.from_gpus if u in pods)]
                self.ctx.moves.start_moves([move], f"make room for pod container {pod.name}, which the "
                                           f"cluster gave {self.ctx.gpu_label(pod.physical[0])}")
            for stuck in to_park:
                self._parks_asked.add(stuck.id)
                pod = pods[next(u for u in stuck.physical if u in pods)]
                self.ctx.directives.add(
                    stuck, "park", f"pod container {pod.name} was given "
                    f"{self.ctx.gpu_label(pod.physical[0])}, where it runs, and no other GPU it can "
                    "reach has room for it", gpu=stuck.physical[0], request=stuck.request,
                    limit=stuck.limit)
        log.info("pods' GPUs: %d move(s) off, %d notebook(s) asked to park", len(plan.moves),
                 len(to_park))

    def _place_again(self, lease: Lease, pods: Mapping[str, Lease]) -> None:
        """A lease waiting on a GPU a pod was then given: placed anew, or waiting, saying why."""
        try:
            logical, physical, moves = self.ctx.placement.place(
                lease.kind, lease.request, lease.limit, lease.devices,
                self.ctx.planning_view(lease.id), **kept_plan(lease))
        except Conflict as exc:
            pod = pods[next(u for u in lease.physical if u in pods)]
            reason = f"waiting: pod container {pod.name} was given its GPU; {exc.message}"
            if lease.reason != reason:
                self.ledger.update(lease.id, reason=reason)
            return
        self.ctx.polling.wake()
        with self.ledger.transaction():
            reason = (self.ctx.placement.waiting_reason(moves, lease.owner_uid) if moves
                      else "placed")
            self.ledger.update(lease.id, logical=logical, physical=physical, reason=reason,
                               waits_for=tuple(m.lease_id for m in moves))
            self.ctx.moves.start_moves(moves, f"free {self.ctx.labels(physical)}", lease)
