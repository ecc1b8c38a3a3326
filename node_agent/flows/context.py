"""What every room shares: the ledger, the backend, the config, the GPUs as measured, the rooms."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace

from node_agent import policy
from node_agent.devices import GpuBackend, GpuInfo
from node_agent.devices.base import Freezer
from node_agent.flows.common import AgentConfig, Caller, NotFound
from node_agent.flows.directives import Directives
from node_agent.flows.freezing import Freezing
from node_agent.flows.kubelet_sync import KubeletSync
from node_agent.flows.moves import Moves
from node_agent.flows.parking import Parking
from node_agent.flows.placement import Placement
from node_agent.flows.polling import Polling
from node_agent.flows.reclaim import Reclaim
from node_agent.flows.usage import Usage
from node_agent.ledger import Lease, Ledger
from node_agent.stats import AgentStats


class Context:
    """One node's agent as its rooms see it, on one asyncio loop. The rooms are built here, in
    one place, so that each can call another's functions (flows call each other both ways: a
    thaw that fails stops the kernel, a reclaim freezes it)."""

    def __init__(self, backend: GpuBackend, ledger: Ledger, config: AgentConfig,
                 freezer: Freezer | None) -> None:
        self.backend = backend
        self.ledger = ledger
        self.config = config
        self.freezer = freezer
        # The node as the last sweep measured it (the usage room keeps it current).
        self.gpus: list[GpuInfo] = []
        self.counters: dict[str, int] = {"kills": 0, "shrinks": 0, "migrations": 0, "ticks": 0,
                                         "freezes": 0, "thaws": 0}
        # Moves, shrinks and kills by cause, and move durations, for /metrics.
        self.stats = AgentStats()
        self.directives = Directives(self)
        self.polling = Polling(self)
        self.usage = Usage(self)
        self.placement = Placement(self)
        self.moves = Moves(self)
        self.parking = Parking(self)
        self.freezing = Freezing(self)
        self.reclaim = Reclaim(self)
        self.kubelet_sync = KubeletSync(self)

    def devices(self) -> list[policy.Device]:
        """GPUs as policy sees them: what processes can hold, less the driver's reserve."""
        return [policy.Device(g.uuid, g.index, g.memory_usable, g.healthy) for g in self.gpus]

    def gpu(self, uuid: str) -> GpuInfo | None:
        return next((g for g in self.gpus if g.uuid == uuid), None)

    def gpu_label(self, uuid: str) -> str:
        gpu = self.gpu(uuid)
        return f"GPU {gpu.index}" if gpu else uuid

    def lease(self, caller: Caller, lease_id: str) -> Lease:
        lease = self.ledger.leases.get(lease_id)
        # Someone else's lease is reported as missing: its existence is not theirs to know.
        if lease is None or not (caller.admin or lease.owner_uid == caller.uid):
            raise NotFound("lease", f"no lease {lease_id!r} of yours")
        return lease

    def planning_view(self, exclude: str | None = None) -> list[policy.Placement]:
        """Leases as policy should see them: a lease on its way somewhere counts as there."""
        out = []
        for lease in self.ledger.leases.values():
            if lease.id == exclude:
                continue
            p = lease.placement()
            if lease.state == "migrating" and lease.target:
                p = replace(p, physical=lease.target)
            out.append(p)
        return out

    def labels(self, uuids: Iterable[str]) -> str:
        return ", ".join(self.gpu_label(u) for u in uuids)

