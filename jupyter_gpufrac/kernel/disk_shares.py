"""Checkpoint disk budgets set as shares of the free disk, measured again as the disk fills and empties."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from pathlib import Path

from jupyter_gpufrac.checkpoint_disk import free_disk, measure
from jupyter_gpufrac.kernel.budget import KERNEL_TRAIT, USER_TRAIT, DiskLimits, Room
from node_agent.quantities import format_bytes

# The space free for checkpoints is measured (a statvfs and a walk of stat calls) at most
# this often: a budget follows the disk within this many seconds.
SPACE_CACHE_S = 30.0


class SharedDiskLimits(DiskLimits):
    """:class:`DiskLimits` whose budgets (those named in ``shares``: "kernel", "user") are
    shares of the space free for checkpoints now: the free disk under the checkpoint root plus
    what the user's checkpoints there take. A disk nearly full when the server started does not
    fix a kernel's budget for its life, and the reason given says the disk is what is short."""

    def __init__(self, folder: Path, kernel_budget: int | None, user_budget: int | None,
                 shares: Mapping[str, float],
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(folder, kernel_budget, user_budget, clock)
        self.shares = dict(shares)
        self._space: tuple[float, int] | None = None

    def space(self) -> int:
        """Bytes free for the user's checkpoints now (cached SPACE_CACHE_S)."""
        now = self._clock()
        if self._space is None or now - self._space[0] >= SPACE_CACHE_S:
            root = self.folder.parent
            self._space = (now, free_disk(root) + measure(root).total)
        return self._space[1]

    def room(self) -> Room | None:
        """The tighter budget for the next checkpoint, the shares taken of the space now."""
        space = self.space()
        kernel = self.shares.get("kernel")
        user = self.shares.get("user")
        if kernel is not None:
            self.kernel_budget = int(kernel * space)
        if user is not None:
            self.user_budget = int(user * space)
        room = super().room()
        if room is None:
            return None
        if kernel is not None and room.bytes == self.kernel_budget:
            return Room(room.bytes, self._why("per-kernel", kernel, space, KERNEL_TRAIT,
                                              "delete variables you no longer need"))
        if user is not None and self.user_budget is not None and \
                room.bytes == max(0, self.user_budget - self.others()):
            return Room(room.bytes, self._why(
                "per-user", user, space, USER_TRAIT, "shut down kernels you no longer need",
                f", of which your other kernels' checkpoints take {format_bytes(self.others())}"))
        return room

    def _why(self, which: str, share: float, space: int, trait: str, or_else: str,
             others: str = "") -> str:
        budget = int(share * space)
        return (f"over the {which} checkpoint budget of {format_bytes(budget)}{others}: "
                f"{share:.0%} of the {format_bytes(space)} free for checkpoints now (the free "
                f"disk under {self.folder.parent} and your checkpoints there); free disk space "
                f"there, set {trait} to a size, or {or_else}")
