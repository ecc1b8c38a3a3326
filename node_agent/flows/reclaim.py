"""Reclaim: the ladder that takes loaned memory back (shrink, then freeze, else stop), and its stops."""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import Any

from node_agent import policy, procs
from node_agent.flows.room import Room
from node_agent.ledger import KUBELET, Lease
from node_agent.quantities import format_bytes

log = logging.getLogger("gpufrac.agent")


def _ordinal(n: int) -> str:
    """3rd, 4th, 11th, 21st."""
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


class Reclaim(Room):
    """The ladder's steps under way (the ledger keeps them: ``shrinking`` leases and their
    deadlines) and the stops of each lease within --kill-window."""

    def reclaim(self, now: float) -> None:
        """One climb of the reclaim ladder: borrowers an owner is owed by first, GPU by GPU,
        then leases above their limit; a shrink asked of any other lease is called off."""
        leases = self.ledger.leases
        owed: set[str] = set()
        pods = self.ctx.kubelet_sync.pods_gpus()
        restoring = frozenset(
            lease.id for lease in leases.values()
            if lease.restore_until is not None and lease.restore_until > now
        )
        for uuid in [g.uuid for g in self.ctx.gpus]:
            # Read per GPU: a lease killed for one GPU no longer lends, nor holds memory, on
            # the next.
            gpu = self.ctx.gpu(uuid)
            if gpu is None or not gpu.healthy:
                continue
            pod = pods.get(gpu.uuid)
            on_gpu = [
                self._guaranteed_here(lease, pod) for lease in leases.values()
                if gpu.uuid in lease.physical and lease.state in ("active", "shrinking")
            ]
            device = policy.Device(gpu.uuid, gpu.index, gpu.memory_usable)
            headroom = int(self.config.headroom * gpu.memory_usable)
            # Policy takes a restoring kernel only when the others' loans cannot cover the
            # deficit: the owner's guarantee comes first.
            for r in policy.plan_reclaim(device, on_gpu, gpu.memory_used, headroom, restoring):
                owed.add(r.lease_id)
                self._climb(leases[r.lease_id], now, r, pod)
        for lease in list(leases.values()):
            # A pod's whole GPUs are its own: nothing of them is a loan, nor its to give back.
            if (lease.id not in owed and lease.state in ("active", "shrinking")
                    and lease.planned_by != KUBELET):
                self._climb(lease, now, None)

    @staticmethod
    def _guaranteed_here(lease: Lease, pod: Lease | None) -> policy.Placement:
        """``lease`` as reclaim sees it on a GPU: on one the cluster gave a pod whole (``pod``),
        nothing another lease holds there is guaranteed, and the pod never borrows."""
        placement = lease.placement()
        if pod is None:
            return placement
        if lease.id == pod.id:
            return replace(placement, usage=min(placement.usage, placement.request))
        return replace(placement, request=0)

    def _climb(self, lease: Lease, now: float, owed: policy.Reclaim | None,
               pod: Lease | None = None) -> None:
        """Takes the ladder's next step for ``lease`` (``owed``: what reclaim wants of it here,
        on a GPU given to ``pod`` whole, if any)."""
        enforce = self.config.enforce_limits
        request = self._guaranteed_here(lease, pod).request if owed is not None else lease.request
        standing = policy.Standing(lease.usage, request, lease.limit,
                                   lease.state == "shrinking", lease.deadline)
        step = policy.reclaim_step(
            standing, now, owed=owed is not None, grace=self.config.reclaim_grace,
            enforce_limit=enforce if enforce is not None else not self.backend.simulated)
        grace = f"{self.config.reclaim_grace:g}s"
        if step.action == policy.CANCEL:
            why = ("gave its loan back" if lease.usage <= lease.request
                   else "the owner no longer needs the memory")
            self.ledger.update(lease.id, state="active", deadline=None, reason=why)
        elif step.cause == policy.RECLAIM and owed is not None and pod is not None:
            where = (f"{self.ctx.gpu_label(owed.gpu)}, which the cluster gave pod container "
                     f"{pod.name} whole: none of it is guaranteed there, and the pod needs "
                     f"{format_bytes(owed.deficit)} more")
            if step.action == policy.SHRINK:
                self._ask_to_shrink(lease, f"using {format_bytes(lease.usage)} on {where}", step,
                                    gpu=owed.gpu)
            elif step.action == policy.KILL:
                self._take_back(lease, f"it still held {format_bytes(lease.usage)} {grace} after "
                                f"being asked to give it back, on {where}", "reclaim",
                                stopped="stopped and parked")
        elif step.cause == policy.RECLAIM and owed is not None:
            wanted = (f"{format_bytes(owed.deficit)} owed to other notebooks on "
                      f"{self.ctx.gpu_label(owed.gpu)}")
            if step.action == policy.SHRINK:
                stops = self._reclaim_stops(lease, now)
                reason = (f"using {format_bytes(lease.usage)}, {format_bytes(owed.loan)} above its "
                          f"request of {format_bytes(lease.request)}, while {wanted}"
                          + self._repeat_note(lease, stops + 1, coming=True))
                self._ask_to_shrink(lease, reason, step, gpu=owed.gpu, stops_in_window=stops,
                                    kill_window=self.config.kill_window)
            elif step.action == policy.KILL:
                self._take_back(lease, f"it stayed {format_bytes(owed.loan)} above its request "
                                f"of {format_bytes(lease.request)} for {grace} after being asked "
                                f"to shrink, while {wanted}", "reclaim",
                                stopped=f"stopped to return {format_bytes(owed.loan)} of loaned "
                                        "memory", frozen=f"frozen to return "
                                        f"{format_bytes(owed.loan)} of loaned memory")
        elif step.cause == policy.LIMIT:
            over, limit = format_bytes(lease.usage - lease.limit), format_bytes(lease.limit)
            if step.action == policy.SHRINK:
                reason = (f"using {format_bytes(lease.usage)}, {over} above its limit of {limit}: "
                          "something the allocator cap does not hold (another framework, a child "
                          "process) has the memory")
                self._ask_to_shrink(lease, reason, step,
                                    gpu=lease.physical[0] if lease.physical else None,
                                    cause="limit")
            elif step.action == policy.KILL:
                self._take_back(lease, f"it stayed {over} above its limit of {limit} for {grace} "
                                "after being asked to shrink", "limit",
                                stopped="stopped because", frozen="frozen because")

    def _ask_to_shrink(self, lease: Lease, reason: str, step: policy.Step, **body: Any) -> None:
        """The first rung: a ``shrink`` directive and the deadline of --reclaim-grace."""
        with self.ledger.transaction():
            lease = self.ledger.update(lease.id, state="shrinking", deadline=step.at,
                                       reason=reason)
            # What follows the grace, so that the user is told the truth beforehand.
            then = "freeze" if self.ctx.freezing.freeze_blocker(lease) is None else "stop"
            self.ctx.directives.add(lease, "shrink", reason, request=lease.request, limit=lease.limit,
                                    usage=lease.usage, deadline=step.at, then=then, **body)
        self.counters["shrinks"] += 1
        self.stats.shrink_asked(step.cause or policy.RECLAIM)

    def _take_back(self, lease: Lease, why: str, cause: str, *, stopped: str,
                   frozen: str = "frozen") -> None:
        """The last rung of the ladder: freeze the lease (its kernel keeps everything in host
        memory and thaws when room returns; above its limit, at its next cell), else stop it
        (it restarts from its last good checkpoint), saying which and why."""
        joiner = " " if stopped.endswith("because") else ": "
        blocker = self.ctx.freezing.freeze_blocker(lease)
        if blocker is not None:
            self.stats.freeze_fell_back(cause)
            self.kill(lease, f"{stopped}{joiner}{why}. Freezing could not be used: {blocker}",
                      cause)
            return
        then = "parked" if cause == "limit" else "pending"
        after = ("its next cell thaws it" if then == "parked"
                 else "it thaws by itself once its GPU has room for what it holds")
        reason = (f"{frozen}{' ' if frozen.endswith('because') else ': '}{why}. Its process and "
                  f"variables wait in host memory (a running cell waits too); {after}")

        def fall_back(current: Lease, failed: str) -> None:
            if current.state in ("active", "shrinking"):
                self.kill(current, f"{stopped}{joiner}{why}. Freezing failed: {failed}", cause)

        self.ctx.freezing.start_freeze(lease, reason, then, cause, fall_back)

    def kill(self, lease: Lease, reason: str, cause: str) -> None:
        """Stop the lease's processes (``cause``: reclaim, limit, migrate_timeout, a failed
        thaw): its kernel restarts from its last good checkpoint, told why."""
        if lease.planned_by == KUBELET:
            return  # a pod's processes are the kubelet's, never the agent's to stop
        now = time.time()
        stops = self._reclaim_stops(lease, now) + (cause == "reclaim")
        if cause == "reclaim":
            reason += self._repeat_note(lease, stops, coming=False)
        # What the kernel started on the GPU goes with it: it would keep the memory otherwise.
        children = self.ctx.usage.children(lease.id)
        ended = {pid for pid, _ in (*lease.pids, *children)}
        killed = [pid for pid, start in (*lease.pids, *children) if procs.kill(pid, start)]
        self.counters["kills"] += 1
        self.stats.killed(cause)
        if lease.state == "migrating":
            self.stats.move_ended(lease.id, cause)  # migrate_timeout: the move ends here
        where = (lease.target if lease.state == "migrating" and lease.target
                 else lease.physical or lease.frozen_on)
        # Stopped on a GPU the cluster gave a pod: coming back there would be stopped again, so
        # it comes back parked, and its next cell waits for a GPU with room.
        pods = self.ctx.kubelet_sync.pods_gpus()
        state = ("parked" if lease.kind == policy.NOTEBOOK and set(where) & set(pods)
                 else "killed")
        parked: dict[str, Any] = (
            {"logical": lease.logical if lease.planned_by else (), "physical": (),
             "parked_at": now} if state == "parked" else {"physical": where, "parked_at": None})
        # A frozen process dies with its GPU state: the restart restores the durable checkpoint.
        parked.update(frozen_at=None, frozen_bytes=0, frozen_on=())
        with self.ledger.transaction():
            self.ledger.add_kill(lease.id, now, cause)
            self.ledger.set_pids(lease.id, ())
            lease = self.ledger.update(lease.id, state=state, target=(), deadline=None,
                                       reason=reason, **parked)
            if state == "parked":
                self.stats.parked(lease.id)
            self.ctx.directives.add(lease, "killed", reason, cause=cause, pids=killed,
                                    request=lease.request, limit=lease.limit, usage=lease.usage,
                                    gpu=where[0], stops_in_window=stops,
                                    kill_window=self.config.kill_window)
        # SIGKILL is final: what they held is free before the restarted kernel asks for room.
        self.ctx.usage.gone(lease.id, ended)
        log.warning("lease %s: killed pids %s (%s): %s", lease.id, killed, cause, reason)

    def _reclaim_stops(self, lease: Lease, now: float) -> int:
        """How often reclaim stopped this lease within --kill-window (the ledger keeps them)."""
        return policy.kills_in_window(self.ledger.kill_times(lease.id, "reclaim"), now,
                                      self.config.kill_window)

    def _repeat_note(self, lease: Lease, stop: int, *, coming: bool) -> str:
        """What its user must hear when reclaim stops a lease for the ``stop``-th time within the
        window: a kernel that restores more than its request is stopped again and again."""
        if stop < 3:
            return ""
        minutes = self.config.kill_window / 60
        which = f"{_ordinal(stop)} stop of this kernel within {minutes:g} minutes"
        head = (f" If it does not shrink, this will be the {which}" if coming
                else f" This is the {which}")
        return (f"{head}: the state it restores needs more than its request of "
                f"{format_bytes(lease.request)} (it held {format_bytes(lease.usage)}). Ask for "
                f"more with `%gpu request {self._suggest_request(lease)}`, or free memory "
                "(`del` large tensors, `%gpu release`) before it is restored again.")

    def _suggest_request(self, lease: Lease) -> str:
        """A request that covers what the lease held: rounded up, a whole GPU at most."""
        step = 256 * 2**20 if lease.usage < 4 * 2**30 else 2**30
        want = -(-max(lease.usage, lease.request + 1) // step) * step
        totals = [self.ctx.gpu(u) for u in lease.physical]
        if any(g is not None and want >= g.memory_usable for g in totals):
            return "1"
        return f"{want // 2**30}Gi" if want % 2**30 == 0 else f"{want // 2**20}Mi"

    def room(self, lease: Lease) -> int | None:
        """Bytes ``lease`` can add on its GPU now without a reclaim (None: not running on one)."""
        gpu = self.ctx.gpu(lease.physical[0]) if lease.physical else None
        if gpu is None or not gpu.healthy or lease.state not in ("active", "shrinking"):
            return None
        on_gpu = [other.placement() for other in self.ledger.leases.values()
                  if gpu.uuid in other.physical and other.state in ("active", "shrinking")]
        device = policy.Device(gpu.uuid, gpu.index, gpu.memory_usable)
        return policy.room(device, on_gpu, lease.id, gpu.memory_used,
                           int(self.config.headroom * gpu.memory_usable))
