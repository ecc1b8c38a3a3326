"""The agent's facade: what the API and the CLI call, each handed to the room of its flow (flows/)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from node_agent.caps import mps_running
from node_agent.devices import GpuBackend, GpuInfo
from node_agent.devices.base import Freezer
from node_agent.flows.common import (
    AgentConfig,
    Caller,
    Conflict,
    CreateLease,
    NotFound,
    NotYours,
    OverQuota,
    Refused,
    Resize,
)
from node_agent.flows.context import Context
from node_agent.flows.directives import ACTIONS, ASKED_BY_NAME, KINDS, MAX_WAIT, NOTICES
from node_agent.kubelet.claims import WholeGpus
from node_agent.ledger import Directive, Lease, Ledger
from node_agent.stats import Observation

__all__ = [
    "ACTIONS",
    "ASKED_BY_NAME",
    "KINDS",
    "MAX_WAIT",
    "NOTICES",
    "Agent",
    "AgentConfig",
    "Caller",
    "Conflict",
    "CreateLease",
    "NotFound",
    "NotYours",
    "OverQuota",
    "Refused",
    "Resize",
]


class Agent:
    """Leases, placement and reclaim for one node, on one asyncio loop: the rooms of its flows
    (``ctx``) do the work; this is what callers see of them."""

    def __init__(self, backend: GpuBackend, ledger: Ledger, config: AgentConfig | None = None,
                 freezer: Freezer | None = None) -> None:
        self.ctx = Context(backend, ledger, config or AgentConfig(), freezer)
        self.backend = backend
        self.ledger = ledger
        self.config = self.ctx.config
        self.freezer = freezer
        self.counters = self.ctx.counters
        self.stats = self.ctx.stats

    # --- life cycle ------------------------------------------------------------------
    async def start(self) -> None:
        """Measure the node, re-adopt live processes from the ledger, then poll."""
        await self.ctx.freezing.probe()
        await self.ctx.polling.tick()
        self.ctx.usage.adopt()
        self.ctx.freezing.resume_freezes()
        self.ctx.freezing.prove()
        self.ctx.polling.run()

    async def stop(self) -> None:
        await self.ctx.polling.stop()
        # A freeze or thaw may finish within its bound: a caller stopped mid-call is said to
        # leave the driver out of step.
        await self.ctx.freezing.stop()
        self.ctx.usage.close()

    async def tick(self) -> None:
        """One poll: measure, forget dead processes, release orphans, reclaim, enforce deadlines."""
        await self.ctx.polling.tick()

    async def acted(self, lease_id: str, timeout: float) -> Lease | None:
        """The lease once its freeze or thaw under way has ended, or as it is after
        ``timeout`` seconds (None: released)."""
        return await self.ctx.freezing.acted(lease_id, timeout)

    async def settled(self) -> None:
        """Wait for the freezes and thaws under way (and any they lead to) to end."""
        await self.ctx.freezing.settled()

    # --- views -----------------------------------------------------------------------
    @property
    def gpus(self) -> list[GpuInfo]:
        """The node's GPUs as the last sweep measured them."""
        return self.ctx.gpus

    @property
    def tick_seconds(self) -> float:
        """How long the last tick took."""
        return self.ctx.polling.tick_seconds

    def gpu(self, uuid: str) -> GpuInfo | None:
        return self.ctx.gpu(uuid)

    def node(self, caller: Caller | None = None) -> dict[str, Any]:
        """The GPUs, each with the shares running on it: the caller's own (admins: all) by
        lease id, the others without id or owner, so that a user can see why a GPU is full."""
        def share(lease: Lease) -> dict[str, Any]:
            mine = caller is not None and (caller.admin or lease.owner_uid == caller.uid)
            return {"lease": lease.id if mine else None, "kind": lease.kind,
                    "request": lease.request, "usage": lease.usage, "state": lease.state}

        return {
            "backend": self.backend.name,
            "simulated": self.backend.simulated,
            "gpus": [{**g.to_json(), "shares": [share(lease) for lease in self.ledger.leases.values()
                                                if g.uuid in lease.physical]}
                     for g in self.gpus],
            # Compute shares hold only where CUDA MPS runs; elsewhere they are recorded.
            "mps": mps_running(),
            "freezing": self.freezing(),
        }

    def freezing(self) -> dict[str, Any]:
        """Whether this node freezes notebooks (and why not), whether a thaw can land on another
        GPU, and the host memory frozen state takes against its budget."""
        return self.ctx.freezing.status()

    def visible(self, caller: Caller) -> list[Lease]:
        return [
            lease for lease in self.ledger.leases.values()
            if caller.admin or lease.owner_uid == caller.uid
        ]

    def lease(self, caller: Caller, lease_id: str) -> Lease:
        return self.ctx.lease(caller, lease_id)

    def room(self, lease: Lease) -> int | None:
        """Bytes ``lease`` can add on its GPU now without a reclaim (None: not running on one)."""
        return self.ctx.reclaim.room(lease)

    def waiting_for(self, lease: Lease, reader_uid: int) -> list[dict[str, Any]]:
        """What a pending ``lease`` waits for, for the user ``reader_uid``."""
        return self.ctx.placement.waiting_for(lease, reader_uid)

    # --- leases ----------------------------------------------------------------------
    def create_lease(self, caller: Caller, ask: CreateLease) -> Lease:
        return self.ctx.placement.create_lease(caller, ask)

    def resize(self, caller: Caller, lease_id: str, change: Resize) -> Lease:
        return self.ctx.placement.resize(caller, lease_id, change)

    def release(self, caller: Caller, lease_id: str) -> None:
        self.ctx.placement.release(caller, lease_id)

    async def locate_pid(self, caller: Caller, pid: int) -> int:
        """The agent's number for the caller's process ``pid`` (another PID namespace's)."""
        return await self.ctx.usage.locate(caller, pid)

    def register_pid(self, caller: Caller, lease_id: str, pid: int,
                     here: int | None = None) -> Lease:
        return self.ctx.usage.register_pid(caller, lease_id, pid, here)

    def report_usage(self, caller: Caller, lease_id: str, used: int) -> None:
        """What a client says its processes hold, where the backend cannot see them."""
        self.ctx.usage.report_usage(caller, lease_id, used)

    def observe(self, caller: Caller, lease_id: str, seen: Observation) -> None:
        """A checkpoint or an offload a lease's kernel made, counted for /metrics."""
        self.lease(caller, lease_id)  # the caller's own lease (or an admin's): else 403/404
        self.stats.observed(seen)

    def migrated(self, caller: Caller, lease_id: str) -> Lease:
        return self.ctx.moves.migrated(caller, lease_id)

    # --- parking and freezing ----------------------------------------------------------
    def park(self, caller: Caller, lease_id: str, reason: str | None = None) -> Lease:
        return self.ctx.parking.park(caller, lease_id, reason)

    def park_request(self, caller: Caller, lease_id: str) -> Lease:
        return self.ctx.parking.park_request(caller, lease_id)

    def unpark(self, caller: Caller, lease_id: str) -> Lease:
        return self.ctx.parking.unpark(caller, lease_id)

    async def freeze(self, caller: Caller, lease_id: str, reason: str | None = None) -> Lease:
        return await self.ctx.freezing.freeze(caller, lease_id, reason)

    def freeze_blocker(self, lease: Lease) -> str | None:
        """Why ``lease``'s processes cannot be frozen now (None: they can)."""
        return self.ctx.freezing.freeze_blocker(lease)

    # --- the cluster's pods (Kubernetes) and directives ----------------------------------
    def sync_cluster(self, claims: Mapping[str, WholeGpus]) -> None:
        self.ctx.kubelet_sync.sync_cluster(claims)

    async def wait_directives(
        self, caller: Caller, *, client: str | None, lease_id: str | None, after: int,
        timeout: float, kinds: Sequence[str] = ACTIONS,
    ) -> tuple[list[Directive], int]:
        return await self.ctx.directives.wait(caller, client=client, lease_id=lease_id,
                                              after=after, timeout=timeout, kinds=kinds)
