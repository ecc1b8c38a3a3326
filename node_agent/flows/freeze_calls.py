"""The driver's checkpoint calls as the agent makes them: off its loop, pinned, bounded; the canary."""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from node_agent import procs
from node_agent.devices import GpuInfo
from node_agent.devices import canary as canary_process
from node_agent.devices.base import (
    CHECKPOINTED,
    GONE,
    NOT_PERMITTED,
    OS_ERROR,
    RUNNING,
    DeviceError,
    FreezeError,
    Freezer,
    GpuBackend,
)
from node_agent.flows.common import AgentConfig
from node_agent.quantities import format_bytes, format_duration

log = logging.getLogger("gpufrac.agent")
T = TypeVar("T")

GiB, MiB = 2**30, 2**20
# Seconds a checkpoint or restore may take per GiB it moves, beyond --freeze-call-timeout: the
# slowest public figure, rounded up (CRIUgpu: up to 2.7 s/GB; the H100 measured here: 0.9).
SECONDS_PER_GIB = 4.0
# What NVML may still list for a checkpointed process (the H100 showed 4 MiB).
FROZEN_LEFT = 64 * MiB
# How long the canary may take to start and hold its memory (CUDA's first start takes
# seconds), and to answer after its thaw.
CANARY_START_S = 60.0
# How the canary's verdict begins where it could not run yet (it is tried again later).
NOT_YET = "not yet checked"
# The call names people read: the driver's own.
SYMBOLS = {"state": "cuCheckpointProcessGetState", "lock": "cuCheckpointProcessLock",
           "checkpoint": "cuCheckpointProcessCheckpoint",
           "restore": "cuCheckpointProcessRestore", "unlock": "cuCheckpointProcessUnlock"}


class DriverCalls:
    """Every call the agent makes into the driver's checkpoint API, each in a thread of its own
    (a daemon: a call that never returns cannot keep the agent from exiting) with a deadline
    sized from what it moves, on a process pinned by its start time (a pid that names another
    process by now is never acted on). A call past its deadline turns freezing off on the node
    — :meth:`stalled` says so — while the agent goes on waiting for it in the background: its
    answer, if it comes, is used, and freezing is back."""

    def __init__(self, freezer: Freezer, backend: GpuBackend, config: AgentConfig) -> None:
        self.freezer = freezer
        self.backend = backend
        self.config = config
        self._stalled: dict[int, str] = {}
        self._next = 0

    def stalled(self) -> str | None:
        """Why freezing is off while a call has not returned (None: none hangs)."""
        if not self._stalled:
            return None
        first = next(iter(self._stalled.values()))
        more = f" (and {len(self._stalled) - 1} more)" if len(self._stalled) > 1 else ""
        return (f"the CUDA driver has not answered {first}{more}; freezing is off on this node "
                "until it does")

    def seconds(self, what: str, moves: int = 0) -> float:
        """The deadline of one ``what`` call that moves ``moves`` bytes."""
        base = self.config.freeze_call_timeout
        if what == "lock":
            return self.config.freeze_lock_timeout + base
        if what in ("checkpoint", "restore"):
            return base + moves / GiB * SECONDS_PER_GIB
        return base

    async def call(self, what: str, pid: int, start: int, *args: Any, moves: int = 0,
                   **kwargs: Any) -> Any:
        """``freezer.<what>(pid, *args)`` on the process that started at ``start``; FreezeError
        GONE if the pid names no such process (it ended, or was reused)."""
        fn = functools.partial(getattr(self.freezer, what), pid, *args, **kwargs)

        def pinned() -> Any:
            try:
                with procs.pinned(pid, start) as pin:
                    result = fn()
                    if not pin.alive():
                        raise FreezeError(f"process {pid} ended during {SYMBOLS[what]}", kind=GONE)
                    return result
            except ProcessLookupError as exc:
                raise FreezeError(f"process {pid} is gone: {exc}", kind=GONE) from None

        return await self.run(f"{SYMBOLS[what]}({pid})", pinned, self.seconds(what, moves))

    async def run(self, what: str, fn: Callable[[], T], seconds: float) -> T:
        """``fn()`` in a thread of its own; past ``seconds`` the call is named stalled until it
        returns."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()

        def settle(outcome: Callable[[], None]) -> None:
            if not future.done():
                outcome()

        def work() -> None:
            try:
                result = fn()
            except BaseException as exc:  # handed to the awaiting task, whatever it is
                loop.call_soon_threadsafe(settle, functools.partial(future.set_exception, exc))
            else:
                loop.call_soon_threadsafe(settle, functools.partial(future.set_result, result))

        threading.Thread(target=work, name=f"gpufrac-driver {what}", daemon=True).start()
        try:
            return await asyncio.wait_for(asyncio.shield(future), seconds)
        except asyncio.TimeoutError:
            pass
        key, self._next = self._next, self._next + 1
        self._stalled[key] = f"{what} within {format_duration(seconds)}"
        log.error("freezing: %s has not returned within %s; freezing is off on this node until "
                  "it does", what, format_duration(seconds))
        started = time.monotonic()
        try:
            return await future
        finally:
            del self._stalled[key]
            log.warning("freezing: %s returned after %s", what,
                        format_duration(seconds + time.monotonic() - started))

    async def held(self, uuids: Sequence[str], pids: Sequence[int]) -> dict[str, dict[int, int | None]]:
        """What each of ``pids`` holds on each of ``uuids`` now, read anew (a pid absent: not
        listed there); a GPU that cannot say is left out."""
        def read() -> dict[str, dict[int, int | None]]:
            out: dict[str, dict[int, int | None]] = {}
            for uuid in uuids:
                try:
                    listed = self.backend.processes(uuid)
                except DeviceError:
                    continue
                out[uuid] = {p.pid: p.used for p in listed if p.pid in pids}
            return out

        return await self.run("the GPUs' process lists", read, self.config.freeze_call_timeout)

    async def gpus(self) -> list[GpuInfo]:
        """The GPUs as the backend measures them now."""
        return await self.run("the GPUs' memory", self.backend.gpus,
                              self.config.freeze_call_timeout)

    async def prove(self, gpus: Sequence[GpuInfo]) -> str | None:
        """Freeze and thaw a small CUDA process of the agent's own once, checking each step
        (the driver's state, NVML's listing, the memory's content): None when all held, else
        what failed and how to fix it."""
        room = [g for g in gpus if g.healthy
                and g.memory_free >= canary_process.CANARY_BYTES + g.context_size + 64 * MiB]
        if not room:
            return (f"{NOT_YET}: no GPU has room for the agent's test process "
                    f"({format_bytes(canary_process.CANARY_BYTES)} and a CUDA context)")
        gpu = max(room, key=lambda g: g.memory_free)
        loop = asyncio.get_running_loop()
        proc = canary_process.spawn(gpu.uuid)
        assert proc.stdin is not None and proc.stdout is not None
        try:
            line = await asyncio.wait_for(loop.run_in_executor(None, proc.stdout.readline),
                                          CANARY_START_S)
            if not line.startswith("ready "):
                return _canary_broke(f"its test process could not use CUDA: "
                                     f"{line.strip().removeprefix('error ') or 'it exited'}")
            ident = procs.identify(proc.pid)
            if ident is None:
                return _canary_broke("its test process ended before it was frozen")
            pid, start = proc.pid, ident.start_time
            before = await self._listed(gpu.uuid, pid)
            await self.call("lock", pid, start, timeout=self.config.freeze_lock_timeout)
            await self.call("checkpoint", pid, start, moves=canary_process.CANARY_BYTES)
            if (state := await self.call("state", pid, start)) != CHECKPOINTED:
                return _canary_broke(f"after a checkpoint the driver says it is {state}")
            after = await self._listed(gpu.uuid, pid)
            if after is not None and after > FROZEN_LEFT:
                return _canary_broke(f"after a checkpoint NVML still lists {format_bytes(after)} "
                                     "of its GPU memory")
            await self.call("restore", pid, start, moves=canary_process.CANARY_BYTES)
            await self.call("unlock", pid, start)
            if (state := await self.call("state", pid, start)) != RUNNING:
                return _canary_broke(f"after a thaw the driver says it is {state}")
            back = await self._listed(gpu.uuid, pid)
            if before is not None and (back is None or back < before - FROZEN_LEFT):
                return _canary_broke(f"after a thaw NVML lists {format_bytes(back or 0)} of the "
                                     f"{format_bytes(before)} it held")
            proc.stdin.write("check\n")
            proc.stdin.flush()
            said = await asyncio.wait_for(loop.run_in_executor(None, proc.stdout.readline),
                                          CANARY_START_S)
            if said.strip() != "ok":
                return _canary_broke("after a thaw its GPU memory did not hold what it held "
                                     "before")
            log.info("freezing: proven on GPU %d: the agent froze and thawed a CUDA process of "
                     "its own", gpu.index)
            return None
        except FreezeError as exc:
            return _canary_broke(str(exc), exc.kind)
        except asyncio.TimeoutError:
            return _canary_broke("its test process did not answer in time")
        finally:
            proc.kill()
            proc.wait()

    async def _listed(self, uuid: str, pid: int) -> int | None:
        """What NVML lists ``pid`` holding on ``uuid`` (0: not listed); None on a simulated node,
        whose memory is the agent's own bookkeeping."""
        if self.backend.simulated:
            return None
        found = await self.held([uuid], [pid])
        return found.get(uuid, {}).get(pid) or 0


def _canary_broke(what: str, kind: str = "") -> str:
    """Why freezing is off after the canary failed, with the fix where one is known."""
    why = f"freezing a test process of the agent's own failed: {what}"
    if kind == NOT_PERMITTED and os.geteuid() == 0:
        why += (". As root the driver refuses while persistence mode is off: turn it on "
                "(`nvidia-smi -pm 1`, or run nvidia-persistenced) and restart the agent")
    elif kind == NOT_PERMITTED:
        why += ". Run the agent as root, in the host's PID namespace"
    elif kind == OS_ERROR:
        why += (". Inside a container the driver's checkpoint calls have failed so "
                "(cuda-checkpoint#37): run the agent on the host, or with the host's PID "
                "namespace and privileges")
    return why
