"""What the rooms, the facade and the API share: refusals by kind, the caller, the config, the asks."""

from __future__ import annotations

import json
from dataclasses import dataclass

from node_agent import policy
from node_agent.kubelet import cgroups
from node_agent.ledger import Lease
from node_agent.quantities import Quantity


class Refused(Exception):
    """A request the agent does not carry out as asked: the field at fault (or None) and why.
    Raised as such, the value asked for cannot be granted; the subclasses say more."""

    def __init__(self, field: str | None, message: str) -> None:
        super().__init__(message)
        self.field = field
        self.message = message


class NotYours(Refused):
    """What the request names belongs to another user (a process)."""


class NotFound(Refused):
    """No such lease among the caller's: another user's is not theirs to know of."""


class Conflict(Refused):
    """Not possible in the state the lease or the node is in now."""


class OverQuota(Refused):
    """The caller holds as many leases as one user may."""


@dataclass(frozen=True)
class Caller:
    """Who is asking, from the socket (SO_PEERCRED) or a TCP token — never from a body."""

    uid: int
    pid: int | None = None
    admin: bool = False


@dataclass
class AgentConfig:
    poll_interval: float = 1.0
    # Leases one (non-admin) user may hold at once.
    max_leases_per_user: int = 64
    # Memory (bytes, requests summed over devices) and GPUs (requests as shares of a GPU, as
    # Run:ai and KAI count a project's quota) one (non-admin) user's leases may reserve at
    # once, parked ones included (None: no cap).
    max_bytes_per_user: int | None = None
    max_gpus_per_user: int | None = None
    # The node scheduler (Run:ai's): spread burstable notebooks and move them back for room.
    node_scheduler: bool = True
    # How many leases one GPU may run at once (None: not enforced).
    max_workloads_per_gpu: int | None = None
    # How long a borrower has to give its loan back after `shrink` before it is killed.
    reclaim_grace: float = 30.0
    # How long a client has to report a move done before the agent kills the process.
    migrate_grace: float = 120.0
    # How long a lease may have no live process (a kernel restarting) before it is released.
    orphan_grace: float = 60.0
    # How long a kernel that came back (new pid, or a move done) is reclaimed from last only.
    restore_grace: float = 60.0
    # Kills of one lease within this window are counted, and the count is told to its user.
    kill_window: float = 600.0
    # Reclaim starts when free memory falls below this share of the GPU while an owner is owed.
    headroom: float = 0.05
    # One process's CUDA context, where the backend does not know it (None: the estimate).
    context_size: int | None = None
    # Stop leases that stay above their limit. None: with NVML only; a simulated node counts
    # resident memory, which an `import torch` alone takes past a tight limit.
    enforce_limits: bool | None = None
    # Where the kubelet links containers' logs, which name the pod container of a process.
    container_logs: str = cgroups.CONTAINER_LOGS
    # Freeze a notebook's processes (the driver keeps their GPU state in their host memory)
    # wherever it can, before restarting or stopping them.
    freeze: bool = True
    # How long a freeze waits for the kernel's submitted GPU work, and how often it is tried
    # when that wait times out (a long kernel runs), before the fallback.
    freeze_lock_timeout: float = 10.0
    freeze_attempts: int = 3
    # Host memory that frozen GPU state may take on this node (None: freeze_budget_share of
    # its RAM). Frozen memory lives in the kernels' own processes: the host must hold it.
    freeze_budget: int | None = None
    freeze_budget_share: float = 0.5
    # What one user's frozen state may take of it (None: half of it): one user cannot take
    # all of a node's room for frozen kernels.
    freeze_budget_per_user: int | None = None
    # How long a driver call may take beyond its copy (SECONDS_PER_GIB per GiB moved) and a
    # lock's own timeout; past it freezing is off on the node until the call returns.
    freeze_call_timeout: float = 30.0
    # Move a notebook by freezing it and thawing it on the other GPU (driver r580+, the same
    # model). Off by default: a process that CUDA_VISIBLE_DEVICES restricts, as every kernel
    # is, has been reported to fail even a remap onto its own GPU; no hardware here showed
    # otherwise. Off, a move restarts the kernel from its checkpoint, as before.
    freeze_remap: bool = False
    # How long a cell may wait for a frozen kernel's GPU to have room for all it froze before
    # the kernel restarts from its checkpoint within its request instead (what does not fit
    # then waits on disk): a borrower frozen by reclaim may otherwise wait for hours.
    thaw_wait: float = 300.0

    @property
    def rules(self) -> policy.Rules:
        return policy.Rules(spread=self.node_scheduler, max_per_gpu=self.max_workloads_per_gpu)


@dataclass(frozen=True)
class CreateLease:
    """A new lease as asked for; ``limit`` is the request's when none was named."""

    kind: str
    client: str
    request: Quantity
    limit: Quantity
    devices: int = 1
    kernel_id: str | None = None
    name: str = ""
    compute_request: float | None = None
    compute_limit: float | None = None
    # The cluster's plan (KAI's): its logical GPUs, taken as they are where they have room.
    logical: tuple[str, ...] | None = None
    # The GPUs its processes can see (empty: all of the node's).
    reach: tuple[str, ...] = ()


@dataclass(frozen=True)
class Resize:
    """A new share for a lease; None keeps what it has (a kept limit below a new request
    rises to it)."""

    request: Quantity | None = None
    limit: Quantity | None = None
    compute_request: float | None = None
    compute_limit: float | None = None


def describe(lease: Lease) -> str:
    """``job "python train.py" (l-…)``: what a person recognises, and the id to look up.
    For the lease's own user only: to another it is ``another user's job`` (`whose`)."""
    name = lease.name
    if len(name) > 40:
        # A notebook's name is its path: its end says which notebook; a job's command
        # line says what it is at its start.
        name = "…" + name[-39:] if lease.kind == policy.NOTEBOOK else name[:39] + "…"
    # Quoted as JSON: a quote or a newline in a name cannot end the sentence around it.
    quoted = json.dumps(name, ensure_ascii=False)
    return f"{lease.kind} {quoted} ({lease.id})" if name else f"{lease.kind} {lease.id}"


def whose(lease: Lease, reader_uid: int) -> str:
    """``lease`` as the user ``reader_uid`` may read of it: their own by name and id,
    another user's without either (text one user chose is never prose to another)."""
    if lease.owner_uid == reader_uid:
        return describe(lease)
    return f"another user's {lease.kind}"
