"""Compute contention: how fast each busy workload runs when others use the same GPUs (pure)."""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from typing import TypeVar

K = TypeVar("K", bound=Hashable)


def speeds(busy: Mapping[K, tuple[Sequence[str], float]], *, shared: bool = True) -> dict[K, float]:
    """Speed (0..1 of traced) of each workload, given the GPUs it runs on and the share of each
    GPU's compute it asks for.

    A GPU whose workloads ask for more than all of it gives each the same fraction of what it
    asked (two busy cells: each at 1/2; a cell and a half-GPU job: each at 2/3). A workload on
    several GPUs runs at the pace of its most contended one. ``shared=False``: all at full speed.
    """
    if not shared:
        return dict.fromkeys(busy, 1.0)
    asked: dict[str, float] = {}
    for gpus, compute in busy.values():
        for uuid in gpus:
            asked[uuid] = asked.get(uuid, 0.0) + compute
    return {key: min((1.0 / max(1.0, asked[u]) for u in gpus), default=1.0)
            for key, (gpus, _) in busy.items()}
