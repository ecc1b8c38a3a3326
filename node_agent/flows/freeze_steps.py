"""The driver's steps on a lease's processes, each checked: what a freeze and a thaw come to."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from node_agent.devices import GpuBackend, GpuInfo
from node_agent.devices.base import (
    CHECKPOINTED,
    FAILED,
    GONE,
    LOCKED,
    NO_CUDA,
    OS_ERROR,
    OUT_OF_MEMORY,
    RUNNING,
    FreezeError,
)
from node_agent.flows.common import AgentConfig
from node_agent.flows.freeze_calls import FROZEN_LEFT, DriverCalls
from node_agent.ledger import Lease
from node_agent.quantities import format_bytes
from node_agent.stats import AgentStats

# Why the GPUs as just measured cannot take a thaw (None: they can).
Room = Callable[[Sequence[GpuInfo]], "str | None"]


@dataclass
class Outcome:
    """How a freeze or a thaw of a lease's processes ended: done (nothing set); ``failed``: it
    did not happen and they run as before; ``wait``: a thaw found no room and is tried again
    once there is; ``lost``: the driver left a process unable to run on (FAILED, or wedged), so
    its kernel restarts from its durable checkpoint; ``note``: done, but not all as the driver
    said (for the lease's fallback)."""

    failed: str | None = None
    wait: str | None = None
    lost: str | None = None
    note: str | None = None


class FreezeSteps:
    """Lock and checkpoint, restore and unlock, process by process, each call bounded (through
    ``calls``) and each result checked against the driver's state and, with NVML, against what
    the GPU lists; a failure is read back and acted on. Which frozen leases' restores ran out
    of GPU memory once (the driver refuses every later one, cuda-checkpoint#44)."""

    def __init__(self, calls: DriverCalls, backend: GpuBackend, config: AgentConfig,
                 stats: AgentStats) -> None:
        self.calls = calls
        self.backend = backend
        self.config = config
        self.stats = stats
        self.out_of_memory: set[str] = set()

    async def freeze(self, lease: Lease, by_pid: Mapping[int, int], held: int) -> Outcome:
        """Lock and checkpoint each process in turn, checking each: the driver's state after,
        and (with NVML) that its memory left the GPU. On a failure the ones frozen are thawed
        again, and what the driver left of the failed one is read and acted on."""
        done: list[tuple[int, int]] = []
        for pid, start in lease.pids:
            try:
                state = await self.calls.call("state", pid, start)
            except FreezeError as exc:
                if exc.kind == NO_CUDA:
                    continue  # nothing of it is on a GPU: nothing to freeze
                return await self._undo(done, Outcome(failed=f"the driver could not say how "
                                                      f"process {pid} is: {exc}"))
            if state != RUNNING:
                return await self._undo(done, Outcome(failed=f"process {pid} is {state} already: "
                                                      "something else froze it"))
            for attempt in range(1, self.config.freeze_attempts + 1):
                try:
                    await self.calls.call("lock", pid, start,
                                          timeout=self.config.freeze_lock_timeout)
                    break
                except FreezeError as exc:
                    if exc.retry and attempt < self.config.freeze_attempts:
                        continue
                    tries = f" after {attempt} tries" if attempt > 1 else ""
                    return await self._undo(done, Outcome(
                        failed=f"the driver did not freeze process {pid}{tries}: {exc}"))
            try:
                await self.calls.call("checkpoint", pid, start, moves=by_pid.get(pid, held))
            except FreezeError as exc:
                return await self._undo(done, await self._after_failed_checkpoint(pid, start, exc))
            mismatch = await self._frozen_as_said(lease, pid, start)
            if mismatch is not None:
                self.stats.freeze_mismatch("freeze")
                await self.thaw_back(((pid, start),))
                return await self._undo(done, Outcome(failed=mismatch))
            done.append((pid, start))
        return Outcome()

    async def _after_failed_checkpoint(self, pid: int, start: int, exc: FreezeError) -> Outcome:
        """A checkpoint failed: read what the driver left and act on it — locked, unlock it;
        checkpointed after all, thaw it; FAILED, its kernel restarts from its checkpoint."""
        failed = f"the driver did not checkpoint process {pid}: {exc}"
        try:
            state = await self.calls.call("state", pid, start)
        except FreezeError as read:
            state = None
            failed += f"; its state could not be read ({read})"
        if state == FAILED:
            return Outcome(lost=f"{failed}; the driver left it FAILED, so it cannot run on")
        if state in (LOCKED, CHECKPOINTED, None):
            undone = await self.thaw_back(((pid, start),))
            if undone is not None and state is not None:
                return Outcome(lost=f"{failed}; and it could not be let run again ({undone})")
            return Outcome(failed=f"{failed} (it was let run again)")
        return Outcome(failed=failed)

    async def _frozen_as_said(self, lease: Lease, pid: int, start: int) -> str | None:
        """After a checkpoint: None when the driver says CHECKPOINTED and (with NVML) the
        process's memory left its GPUs, else what did not match."""
        try:
            state = await self.calls.call("state", pid, start)
        except FreezeError as exc:
            return f"after its checkpoint the driver could not say how process {pid} is: {exc}"
        if state != CHECKPOINTED:
            return f"after its checkpoint the driver says process {pid} is {state}"
        if self.backend.simulated:
            return None
        listed = await self.calls.held(lease.physical, [pid])
        left = max((found.get(pid) or 0 for found in listed.values()), default=0)
        if left > FROZEN_LEFT:
            return (f"after its checkpoint NVML still lists {format_bytes(left)} of process "
                    f"{pid} on its GPU")
        return None

    async def _undo(self, done: Sequence[tuple[int, int]], outcome: Outcome) -> Outcome:
        """The processes frozen before a failure run again where they were."""
        undone = await self.thaw_back(done)
        if undone is not None and outcome.lost is None:
            return Outcome(lost=f"{outcome.failed}; and {undone}")
        return outcome

    async def thaw_back(self, pids: Sequence[tuple[int, int]]) -> str | None:
        """Let each process run again where it was (a freeze undone): restored if checkpointed,
        unlocked if locked. Why one could not be (None: all run)."""
        for pid, start in pids:
            try:
                state = await self.calls.call("state", pid, start)
                if state == CHECKPOINTED:
                    await self.calls.call("restore", pid, start)
                    state = LOCKED
                if state == LOCKED:
                    await self.calls.call("unlock", pid, start)
            except FreezeError as exc:
                if exc.kind in (GONE, NO_CUDA):
                    continue
                return f"process {pid} could not be let run again: {exc}"
        return None

    async def thaw(self, lease: Lease, pairs: Mapping[str, str] | None, room: Room) -> Outcome:
        """Restore and unlock each process still frozen, checking the GPU's room again just
        before the first restore (``room``: why the GPUs as measured now cannot take it) and the
        driver's state after each."""
        checked = False
        for pid, start in lease.pids:
            try:
                state = await self.calls.call("state", pid, start)
            except FreezeError as exc:
                if exc.kind in (NO_CUDA, GONE):
                    continue  # none of it was frozen, or it ended (the poll lets it go)
                return Outcome(lost=f"the driver could not say how process {pid} is: {exc}")
            if state == RUNNING:
                continue  # thawed already (a thaw that raced this one)
            if state == FAILED:
                return Outcome(lost=f"the driver lost process {pid}'s GPU state (FAILED)")
            if state == CHECKPOINTED:
                if not checked:
                    short = room(await self.calls.gpus())
                    if short is not None:
                        return Outcome(wait=short)
                    checked = True
                try:
                    await self.calls.call("restore", pid, start, pairs,
                                          moves=lease.frozen_bytes)
                except FreezeError as exc:
                    return self._after_failed_restore(lease, pid, exc)
            try:
                await self.calls.call("unlock", pid, start)
                state = await self.calls.call("state", pid, start)
            except FreezeError as exc:
                return Outcome(lost=f"process {pid} could not be let run again: {exc}")
            if state != RUNNING:
                self.stats.freeze_mismatch("thaw")
                return Outcome(lost=f"after its thaw the driver says process {pid} is {state}")
        return await self._thawed_as_said(lease)

    def _after_failed_restore(self, lease: Lease, pid: int, exc: FreezeError) -> Outcome:
        """A restore that ran out of GPU memory waits for room and is tried again; one that
        fails after that (the driver refuses every later one, cuda-checkpoint#44), or for any
        other reason, leaves the process unable to run on."""
        if exc.kind == OUT_OF_MEMORY and lease.id not in self.out_of_memory:
            self.out_of_memory.add(lease.id)
            return Outcome(wait=f"its restore ran out of GPU memory and is tried again once "
                                f"there is room: {exc}")
        if exc.kind in (OUT_OF_MEMORY, OS_ERROR) and lease.id in self.out_of_memory:
            return Outcome(lost=f"after a restore that ran out of GPU memory the driver will not "
                                f"restore process {pid} again (cuda-checkpoint#44): {exc}")
        return Outcome(lost=f"the driver did not thaw process {pid}: {exc}")

    async def _thawed_as_said(self, lease: Lease) -> Outcome:
        """After a thaw, with NVML: its processes are listed on its GPUs again, holding memory
        (a mismatch is counted and noted; the kernel runs, and the agent trusts the driver's
        RUNNING)."""
        if self.backend.simulated or lease.frozen_bytes <= FROZEN_LEFT:
            return Outcome()
        pids = [pid for pid, _ in lease.pids]
        listed = await self.calls.held(lease.physical, pids)
        back = max((sum(u or 0 for u in found.values()) for found in listed.values()), default=0)
        if back <= FROZEN_LEFT:
            self.stats.freeze_mismatch("thaw")
            return Outcome(note=f"after its thaw NVML lists {format_bytes(back)} of the "
                                f"{format_bytes(lease.frozen_bytes)} it froze")
        return Outcome()

