"""Usage: which processes are each lease's, what they hold on its GPUs, and what frees when they end."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Collection
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from node_agent import policy, procs
from node_agent.devices import DeviceError, GpuInfo, Sweep
from node_agent.flows.common import Caller, Conflict, NotYours, OverQuota, Refused
from node_agent.flows.room import Room
from node_agent.kubelet import cgroups
from node_agent.ledger import KUBELET, Lease
from node_agent.quantities import MAX_COUNT, format_bytes

if TYPE_CHECKING:
    from node_agent.flows.context import Context

log = logging.getLogger("gpufrac.agent")

# A CUDA 12 context on a recent data-centre GPU; NVML does not report it on its own.
CONTEXT_ESTIMATE = 500 * 2**20
# A lease said to burst is not said to again for this long (seconds).
BURSTING_QUIET_S = 60.0
# Pid registrations from another PID namespace one uid may have looked up at once.
LOOKUPS_PER_CALLER = 4


def _less_used(gpu: GpuInfo, freed: int) -> GpuInfo:
    """``gpu`` with ``freed`` bytes of its use given back."""
    freed = min(freed, gpu.memory_used)
    return replace(gpu, memory_used=gpu.memory_used - freed,
                   memory_free=gpu.memory_free + freed) if freed else gpu


class Usage(Room):
    """The last sweep, the processes polls look at, what clients reported, and what each
    lease's processes started that uses a GPU."""

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        self._swept: Sweep | None = None
        # What a client said its processes hold, where the backend cannot see them.
        self._reported: dict[str, int] = {}
        # When each lease was last said to burst: a usage that hovers at the request must
        # not flood its follower with notices.
        self._bursting_said: dict[str, float] = {}
        # lease id -> (pid, start time) of what its processes started that uses a GPU
        self._children: dict[str, list[tuple[int, int]]] = {}
        # The processes polls look at, each read once while it lives.
        self._procs = procs.ProcessWatch()
        # Pids of callers in other PID namespaces, looked up one at a time off the loop; how
        # many of each uid's are waiting or running.
        self._lookups = ThreadPoolExecutor(1, thread_name_prefix="gpufrac-pids")
        self._looking: dict[int, int] = {}

    def adopt(self) -> None:
        """At start: follow the live processes the ledger names on their GPUs again."""
        for lease in self.ledger.leases.values():
            for pid, _start in lease.pids:
                self.track(lease, pid)

    def close(self) -> None:
        self._procs.close()
        self._lookups.shutdown(wait=False, cancel_futures=True)

    async def locate(self, caller: Caller, pid: int) -> int:
        """Process ``pid`` as the agent numbers it: the caller's number for it, and a kernel in
        a container has another here. Looked up in the lookups' own thread (file reads, and at
        times a scan of /proc, never on the event loop), at most LOOKUPS_PER_CALLER of one
        uid's at once: one user's flood waits behind itself, not others."""
        if caller.pid is None or procs.pid_namespace(caller.pid) == procs.own_namespace():
            return pid
        busy = self._looking.get(caller.uid, 0)
        if busy >= LOOKUPS_PER_CALLER:
            raise OverQuota("pid", f"{busy} of your pid registrations from another PID namespace "
                                   "are being looked up; wait for them and try again")
        self._looking[caller.uid] = busy + 1
        try:
            found = await asyncio.get_running_loop().run_in_executor(
                self._lookups, procs.as_seen_here, caller.pid, pid)
        finally:
            left = self._looking[caller.uid] - 1
            if left:
                self._looking[caller.uid] = left
            else:
                del self._looking[caller.uid]
        if found is None:
            raise Refused("pid", f"no process {pid} in your PID namespace is visible to the "
                                 "agent (on Kubernetes it needs hostPID: true)")
        return found

    def register_pid(self, caller: Caller, lease_id: str, pid: int,
                     here: int | None = None) -> Lease:
        """Give the lease process ``pid`` (``here``: the agent's number for it, from
        :meth:`locate`, when the caller's differs)."""
        self.ctx.polling.wake()
        lease = self.ctx.lease(caller, lease_id)
        asked, pid = pid, pid if here is None else here
        ident = procs.identify(pid)
        if ident is None:
            raise Refused("pid", f"no running process {asked}")
        if caller.uid != 0 and ident.uid != caller.uid:
            # Only your own processes: the agent may kill what is registered.
            raise NotYours("pid", f"process {asked} is not yours")
        for other in self.ledger.leases.values():
            if other.id != lease.id and any(p == (pid, ident.start_time) for p in other.pids):
                # One process, one lease: otherwise its memory counts twice.
                held = other.id if caller.admin or other.owner_uid == caller.uid else (
                    "of another user")
                raise Conflict("pid", f"process {asked} is already registered to lease {held}")
        pids = tuple(p for p in lease.pids if p[0] != pid and procs.is_alive(*p))
        ended = {p for p, _ in lease.pids} - {p for p, _ in pids} - {pid}
        now = time.time()
        changes: dict[str, Any] = {"orphan_deadline": None, "registered": lease.registered or now}
        # Metrics and status name the pod container it runs in (on Kubernetes).
        container = cgroups.container_of(pid, self.config.container_logs)
        if container is not None:
            changes["pod"] = (container.namespace, container.pod, container.container)
        if lease.kind == policy.NOTEBOOK and (
            lease.registered is not None or lease.state in ("killed", "migrating")
        ):
            # A kernel that comes back (a restart, a move) restores what it held: a grace.
            changes["restore_until"] = now + self.config.restore_grace
        if lease.state == "killed":
            changes.update(state="active", reason="restarted after it was killed")
        with self.ledger.transaction():
            lease = self.ledger.set_pids(lease.id, (*pids, (pid, ident.start_time)))
            lease = self.ledger.update(lease.id, **changes)
        if ended:
            # A restart: the new process starts from what it holds, not what the old one held.
            self.gone(lease.id, ended)
            if lease.frozen:
                # Its frozen process died and the restart registered before a poll saw it go:
                # what the freeze kept went with it (the poll no longer sees the old pid).
                lease = self.ctx.freezing.frozen_process_ended(lease)
        self.track(lease, pid)
        return self.ledger.leases[lease.id]

    def track(self, lease: Lease, pid: int) -> None:
        where = lease.target if lease.state == "migrating" and lease.target else lease.physical
        if not where:
            return  # parked, or waiting for a GPU: its process uses none
        try:
            self.backend.track(pid, where[0])
        except DeviceError as exc:
            log.warning("lease %s: cannot follow pid %d on %s: %s", lease.id, pid, where[0], exc)

    def report_usage(self, caller: Caller, lease_id: str, used: int) -> None:
        """What a client says its processes hold, where the backend cannot see them."""
        self.ctx.polling.wake()
        lease = self.ctx.lease(caller, lease_id)
        if lease.physical:  # a lease with no GPU (parked) holds no device memory
            # Bounded here too (the API refuses more): the ledger and /metrics store it.
            self._reported[lease.id] = max(0, min(used, MAX_COUNT))

    def reported(self) -> tuple[tuple[str, int], ...]:
        """What clients reported, lease by lease."""
        return tuple(self._reported.items())

    def children(self, lease_id: str) -> list[tuple[int, int]]:
        """(pid, start time) of what the lease's processes started that uses a GPU."""
        return self._children.get(lease_id, [])

    def forget(self, lease_id: str) -> None:
        """The lease was released: nothing of it is kept."""
        self._reported.pop(lease_id, None)
        self._bursting_said.pop(lease_id, None)

    def measured(self, m: Sweep) -> bool:
        """What the agent knows of the node from now on: a sweep, or the last one less what
        has ended since. Whether it differs from the last."""
        anew = m != self._swept
        self._swept = m
        self.ctx.gpus = [replace(g, context_size=self._context(g)) for g in m.gpus]
        return anew

    def _context(self, gpu: GpuInfo) -> int:
        """What one process's CUDA context takes on ``gpu``: told, known, or estimated."""
        if self.config.context_size is not None:
            return self.config.context_size
        if gpu.context_size or self.backend.simulated:
            return gpu.context_size
        return CONTEXT_ESTIMATE

    def update_usage(self, m: Sweep) -> None:
        """Each lease's usage in ``m`` (the processes watched read anew), and a notice to its
        follower when it starts to burst."""
        self._procs.sweep()
        now = time.monotonic()
        self._children = {}
        members = self._members(m)
        for lease in list(self.ledger.leases.values()):
            found = members.get(lease.id, {})
            registered = {pid for pid, _ in lease.pids}
            started = {p for pids in found.values() for p in pids} - registered
            # Pinned by start time when seen: a kill later never hits a reused pid. A pod's
            # processes are never the agent's to stop.
            self._children[lease.id] = [] if lease.planned_by == KUBELET else [
                (ident.pid, ident.start_time) for pid in sorted(started)
                if (ident := self._procs.identify(pid)) is not None
                and ident.uid == lease.owner_uid]
            usage, compute = self._held_by(lease, m, found)
            was_bursting = lease.usage > lease.request
            self.ledger.set_usage(lease.id, usage, compute)
            if (usage > lease.request and not was_bursting and lease.state == "active"
                    and now - self._bursting_said.get(lease.id, -BURSTING_QUIET_S)
                    >= BURSTING_QUIET_S):
                self._bursting_said[lease.id] = now
                self.ctx.directives.add(
                    lease, "bursting",
                    f"using {format_bytes(usage)}, above its {format_bytes(lease.request)} "
                    "guarantee: the memory above it is loaned and may be asked back",
                    usage=usage, request=lease.request, limit=lease.limit,
                    gpu=lease.physical[0] if lease.physical else None)

    def _members(self, m: Sweep) -> dict[str, dict[str, list[int]]]:
        """lease id -> GPU -> the processes using it there: the registered ones, and those
        they started (a DataLoader worker, a subprocess), which use the same share."""
        owner = {pid: lease.id for lease in self.ledger.leases.values() for pid, _ in lease.pids}
        members: dict[str, dict[str, list[int]]] = {}
        for uuid, listed in m.processes.items():
            for pid in listed:
                lease_id = owner.get(pid) or next(
                    (owner[p] for p in self._procs.ancestors(pid) if p in owner), None)
                if lease_id is not None:
                    members.setdefault(lease_id, {}).setdefault(uuid, []).append(pid)
        # A pod's whole GPU: whatever no lease holds there is the pod's (the device plugin gave
        # the GPU to it alone); its processes register nowhere.
        for lease in self.ledger.leases.values():
            if lease.planned_by == KUBELET:
                for uuid in lease.physical:
                    theirs = {p for found in members.values() for p in found.get(uuid, [])}
                    members.setdefault(lease.id, {})[uuid] = [
                        pid for pid in m.processes.get(uuid, {}) if pid not in theirs]
        return members

    def _held_by(self, lease: Lease, m: Sweep, found: dict[str, list[int]]
                 ) -> tuple[int, int | None]:
        """The lease's usage and compute use in ``m``: what its processes (``found``: GPU ->
        pids) hold on the GPUs it runs on, the most on any one; where the backend does not
        say, what its client reported — never more than the backend can confirm: nothing
        where it lists the GPU's processes and none of the lease's, else what the GPU uses
        beyond the processes it accounts for (a report is a claim on the freeze budget)."""
        usage = 0
        seen = False
        compute: int | None = None
        confirmed: int | None = None  # the most the backend allows a report (None: no bound)
        for uuid in lease.physical:
            listed = m.processes.get(uuid)
            gpu = next((g for g in m.gpus if g.uuid == uuid), None)
            if listed is None:
                if gpu is not None:
                    confirmed = max(confirmed or 0, gpu.memory_used)
                continue
            mine = found.get(uuid, [])
            held = [listed[pid] for pid in mine]
            if held and all(h is not None for h in held):
                seen = True
                usage = max(usage, sum(h or 0 for h in held))
            else:
                others = sum(h or 0 for pid, h in listed.items() if pid not in mine)
                room = max(0, gpu.memory_used - others) if mine and gpu is not None else 0
                confirmed = max(confirmed or 0, room)
            sampled = m.utilization.get(uuid)
            if sampled is not None:
                busy = min(100, sum(sampled.get(pid, 0) for pid in mine))
                compute = busy if compute is None else max(compute, busy)
        if not seen and lease.id in self._reported:
            reported = self._reported[lease.id]
            usage = reported if confirmed is None else min(reported, confirmed)
        return usage, compute

    def recount(self, lease_id: str) -> None:
        """The lease's usage as the last sweep, less what ended since, shows it on the GPUs
        it runs on now: a call that changes its processes or GPUs need not wait for a sweep."""
        lease = self.ledger.leases.get(lease_id)
        if lease is None or self._swept is None:
            return
        found = self._members(self._swept).get(lease.id, {})
        self.ledger.set_usage(lease.id, *self._held_by(lease, self._swept, found))

    def gone(self, lease_id: str, ended: Collection[int]) -> None:
        """The lease's processes ``ended`` (killed, exited, replaced by a restart) hold nothing
        from now on: what the last sweep saw them hold leaves their GPUs' use and the lease's
        usage now, not at the next sweep. A kernel restarted in a spare asks for room to
        restore into within a tenth of a second; with the dead process counted it gets too
        little, and a reclaim may act on memory nobody holds."""
        self._reported.pop(lease_id, None)  # the client's figure was for the processes it had
        m = self._swept
        if m is not None and ended:
            freed = {uuid: sum(listed.get(pid) or 0 for pid in ended)
                     for uuid, listed in m.processes.items()}
            self.measured(Sweep(
                [_less_used(g, freed.get(g.uuid, 0)) for g in m.gpus],
                {uuid: {pid: held for pid, held in listed.items() if pid not in ended}
                 for uuid, listed in m.processes.items()},
                m.utilization))
        self.recount(lease_id)

    def forget_dead(self, now: float) -> None:
        for lease in list(self.ledger.leases.values()):
            if lease.planned_by == KUBELET:
                continue  # it lives as long as its pod does (sync_cluster)
            alive = tuple((pid, start) for pid, start in lease.pids
                          if self._procs.is_alive(pid, start))
            if alive != lease.pids:
                ended = {pid for pid, _ in lease.pids} - {pid for pid, _ in alive}
                lease = self.ledger.set_pids(lease.id, alive)
                self.gone(lease.id, ended)
                if lease.frozen:
                    lease = self.ctx.freezing.frozen_process_ended(lease)
            if alive:
                if lease.orphan_deadline is not None:
                    self.ledger.update(lease.id, orphan_deadline=None)
                continue
            # The deadline is stored: an agent that keeps restarting still releases orphans
            # (and one restarted with a shorter --orphan-grace honours it).
            deadline = lease.orphan_deadline
            if deadline is None or deadline > now + self.config.orphan_grace:
                deadline = now + self.config.orphan_grace
                lease = self.ledger.update(lease.id, orphan_deadline=deadline)
            if now >= deadline:
                log.info("lease %s: no live process by its orphan deadline, released", lease.id)
                self.ctx.placement.end(lease)
