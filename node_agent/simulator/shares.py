"""What each workload asks of a GPU: a notebook session's request and limit, a job's request."""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from node_agent.simulator.traces import Cell, JobSpec, Session


@dataclass(frozen=True)
class Share:
    """Bytes per GPU on ``devices`` GPUs of one node."""

    request: int
    limit: int
    devices: int


def notebook_share(session: Session, capacity: int, context: int, *,
                   all_burstable: bool = False) -> Share | None:
    """A session's lease: its typical GPU cell's memory guaranteed, its peak as the limit, on as
    many GPUs as its largest cell uses; None for a session that never uses a GPU.

    The trace's ``vram`` is read as memory per GPU (it does not say; this is the larger reading).
    A process holds at least its CUDA context.
    """
    vrams = [c.vram for c in session.cells if c.gpus > 0]
    if not vrams:
        return None
    request = min(capacity, max(context, int(statistics.median(vrams))))
    limit = min(capacity, max(request, max(vrams)))
    if all_burstable and limit == request:
        # One byte of loan makes it burstable to the node scheduler and changes nothing else.
        limit = request + 1
    return Share(request, limit, session.peak_gpus)


def cell_demand(cell: Cell, share: Share, context: int) -> int:
    """Bytes per GPU a GPU cell holds while it runs (and keeps after it, until told otherwise)."""
    return min(share.limit, max(context, cell.vram))


def job_share(job: JobSpec, capacity: int) -> Share:
    """A pod's share: whole GPUs, or its fraction of one; jobs never burst."""
    request = capacity if job.fraction >= 1.0 else max(1, int(job.fraction * capacity))
    return Share(request, request, job.gpus)
