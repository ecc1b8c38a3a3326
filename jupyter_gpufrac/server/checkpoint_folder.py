"""The checkpoint folder as the server keeps it: its disk budgets, its sweeps, its measure."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

from jupyter_gpufrac.checkpoint_disk import Usage, free_disk, measure
from jupyter_gpufrac.kernel.budget import parse_budget
from jupyter_gpufrac.server import retention
from jupyter_gpufrac.server.kernels import Kernels
from jupyter_gpufrac.server.settings import KernelSettings

# The REST kernel view measures the checkpoint folder at most this often (a walk of stat calls).
CHECKPOINT_DISK_CACHE_S = 10.0


def disk_budget_specs(kernel_budget: str,
                      user_budget: str) -> dict[str, tuple[float | None, int | None]]:
    """The two disk budgets as set: (share of the space free for checkpoints, or bytes)."""
    return {"kernel": parse_budget(kernel_budget, "c.GpuFrac.checkpoint_kernel_budget"),
            "user": parse_budget(user_budget, "c.GpuFrac.checkpoint_user_budget")}


def checkpoint_budgets(root: str, kernel_budget: str, user_budget: str,
                       taken: int | None = None) -> tuple[int, int]:
    """(per-kernel, per-user) checkpoint budgets in bytes now: a share is of the space free
    for checkpoints, free disk plus what the user's checkpoints take (``taken``, when it
    was just measured; else measured here: file I/O)."""
    specs = disk_budget_specs(kernel_budget, user_budget)
    room = 0
    if any(share is not None for share, _ in specs.values()):
        if taken is None:
            taken = measure(Path(root)).total
        room = free_disk(Path(root)) + taken
    kernel, user = (int(share * room) if share is not None else int(nbytes or 0)
                    for share, nbytes in specs.values())
    return kernel, user


def staging_budget(budget: str) -> int:
    """The snapshot memory budget in bytes: a share of the host's RAM, or a size."""
    share, nbytes = parse_budget(budget, "c.GpuFrac.checkpoint_staging_budget", "the host's RAM")
    return int(share * psutil.virtual_memory().total) if share is not None else int(nbytes or 0)


class CheckpointFolder:
    """Expired checkpoints removed at start and then periodically; what the folder takes, for
    the REST kernel view, measured at most every few seconds."""

    def __init__(self, root: str, keep_seconds: float, sweep_interval: float, kernels: Kernels,
                 settings: KernelSettings, budgets: Callable[[int], tuple[int, int]],
                 log: logging.Logger) -> None:
        self.root = root
        self.keep_seconds = keep_seconds
        self.sweep_interval = sweep_interval
        self.kernels = kernels
        self.settings = settings
        # (per-kernel, per-user) budgets in bytes, given what the folder takes (file I/O).
        self.budgets = budgets
        self.log = log
        # The folder as last measured, and the disk budgets then.
        self._disk: tuple[float, Usage, int, int] | None = None

    async def sweep_forever(self) -> None:
        """Remove expired checkpoints at start, then every checkpoint_sweep_interval."""
        while True:
            await self.sweep()
            if not self.sweep_interval:
                return
            await asyncio.sleep(self.sweep_interval)

    async def sweep(self) -> list[retention.Removed]:
        """One sweep of the checkpoint folder, its I/O off the event loop; never raises."""
        if self.settings.folder_problem:
            return []  # not the user's alone: nothing in it is touched
        km = self.kernels.kernel_manager
        running = set(km.list_kernel_ids()) if km is not None else set()
        try:
            removed = await asyncio.to_thread(
                retention.sweep, self.root, self.keep_seconds, running,
                2 * self.sweep_interval, self.log)
        except Exception:  # a sweep must never stop the server or the next sweep
            self.log.exception("gpufrac: the checkpoint sweep of %s failed", self.root)
            return []
        if removed:
            self._disk = None
        return removed

    async def disk_model(self, kernel_id: str) -> dict[str, Any] | None:
        """The REST model's ``checkpoint_disk`` for ``kernel_id``; None when it cannot be said."""
        now = time.time()
        cached = self._disk
        if cached is None or now - cached[0] >= CHECKPOINT_DISK_CACHE_S:
            try:
                usage = await asyncio.to_thread(measure, Path(self.root))
            except OSError as err:
                self.log.info("gpufrac: measuring %s: %s", self.root, err)
                return None
            kernel, user = await asyncio.to_thread(self.budgets, usage.total)
            cached = self._disk = (now, usage, kernel, user)
        return {**cached[1].model(kernel_id, now), "kernel_budget": cached[2],
                "user_budget": cached[3]}
