"""Carrying out the agent's directives for this server's kernels: migrate, shrink, killed."""

from __future__ import annotations

import asyncio
import logging
import time
from datetime import datetime
from typing import Any

from jupyter_gpufrac import contract
from jupyter_gpufrac.server.agent_link import AgentError, AgentLink, AgentUnavailable
from jupyter_gpufrac.server.events import KernelEventLog
from jupyter_gpufrac.server.kernel_channel import checkpoint, wait_until_idle
from jupyter_gpufrac.server.kernels import KernelGpu, Kernels
from node_agent.quantities import format_bytes, format_duration
from node_agent.words import FROZEN_IN_HOST_MEMORY, named_for_people

LONG_POLL_S = 25.0
# Every kind: the server acts on migrate and killed, tells people of shrink, resized, bursting.
HEARD = ("migrate", "shrink", "killed", "resized", "bursting", "park", "unparked", "frozen",
         "moved")
MAX_BACKOFF_S = 10.0
# Time left before the agent's deadline for the restart itself after the checkpoint.
RESTART_MARGIN_S = 10.0
# How long a process the agent reported killed may take to be gone.
KILL_SETTLE_S = 2.0
# How long a cut-off cell may take to end after its interrupt before the kernel restarts anyway.
INTERRUPT_WAIT_S = 5.0
# How long a kernel may take to move its GPU tensors to host memory and checkpoint to park.
PARK_CHECKPOINT_S = 300.0
# How long a park waits for the kernel to be idle (the `%gpu park` cell to end).
PARK_IDLE_WAIT_S = 10.0
# How long a move waits for a shutdown in progress to end (jupyter_client asks, then kills).
SHUTDOWN_WAIT_S = 30.0


def restart_cause(directive: dict[str, Any]) -> str:
    """``request_changed`` for a move the user's new request caused, else ``migrated``."""
    if directive.get("cause") == contract.CAUSE_REQUEST_CHANGED:
        return contract.CAUSE_REQUEST_CHANGED
    return contract.CAUSE_MIGRATED


def purpose(reason: str, moves: str) -> str:
    """The agent's reason for a move without its own "moved from GPU 1 to GPU 0" (the sentence
    says where, in the tense it needs): " to free GPU 1 for a job", or empty."""
    text = reason.strip().rstrip(".")
    head = f"moved {moves}"
    if text.lower().startswith(head.lower()):
        text = text[len(head):].strip()
    return f" {text}" if text else ""


def sentence(text: str) -> str:
    """An agent's reason ("moved from GPU 1 to GPU 0 to free …") as the start of a sentence,
    without the lease ids in it (people know a job by its command)."""
    text = named_for_people(text).strip().rstrip(".")
    return text[:1].upper() + text[1:]


class DirectiveListener:
    """Long-polls the agent for directives addressed to this server and acts on each."""

    def __init__(
        self,
        link: AgentLink,
        client_name: str,
        kernel_manager: Any,
        kernels: Kernels,
        events: KernelEventLog,
        grace_period: float,
        log: logging.Logger,
    ) -> None:
        self.link = link
        self.client_name = client_name
        self.kernel_manager = kernel_manager
        self.kernels = kernels
        self.events = events
        self.grace_period = grace_period
        self.log = log
        self.after = 0
        self.connected = False
        self._tasks: set[asyncio.Task[None]] = set()
        self._locks: dict[str, asyncio.Lock] = {}

    async def run(self) -> None:
        """Poll forever; survive the agent going away and coming back (exponential backoff)."""
        backoff = 0.5
        self.log.info("gpufrac: listening for GPU agent directives as %s", self.client_name)
        while True:
            try:
                # Not yet connected: a poll that answers at once tells us the agent is there.
                directives, last = await self.link.directives(
                    client=self.client_name, after=self.after, kinds=HEARD,
                    wait=LONG_POLL_S if self.connected else 0.0,
                )
            except asyncio.CancelledError:
                raise
            except (AgentUnavailable, AgentError, OSError, TimeoutError) as err:
                if self.connected:
                    self.log.warning("lost the GPU agent (%s); retrying", err)
                self.connected = False
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, MAX_BACKOFF_S)
                continue
            except Exception:
                self.log.exception("unexpected error polling GPU agent directives")
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, MAX_BACKOFF_S)
                continue
            if not self.connected and backoff > 0.5:
                self.log.info("gpufrac: the GPU agent is back")
            self.connected, backoff = True, 0.5
            if last < self.after:
                # The agent started over (new sequence numbers): do not skip its new directives.
                self.log.info("GPU agent directive sequence restarted at %s", last)
                self.after = 0
                continue
            for directive in directives:
                self.after = max(self.after, int(directive.get("seq", 0)))
                self.dispatch(directive)
            self.after = max(self.after, last)

    def dispatch(self, directive: dict[str, Any]) -> None:
        """Act on one directive in its own task, one at a time per kernel."""
        task = asyncio.create_task(self._handle(directive))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def stop(self) -> None:
        """Cancel directives in progress (the server is going down)."""
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _handle(self, directive: dict[str, Any]) -> None:
        kernel_id = str(directive.get("kernel_id") or "")
        kind = directive.get("kind")
        if kernel_id not in self.kernel_manager:
            self.log.info("directive %s for unknown kernel %s ignored", kind, kernel_id)
            return
        gpu = self.kernels.get(kernel_id)
        held = (gpu.lease or {}).get("id") if gpu is not None else None
        if gpu is None or held is None or held != directive.get("lease_id"):
            # Kernel ids show in `ps`: anyone may write one on a lease of their own.
            self.log.warning("directive %s for kernel %s names lease %s, not the kernel's (%s): "
                             "ignored", kind, kernel_id, directive.get("lease_id"), held)
            return
        if kind in contract.KERNEL_DIRECTIVES and not gpu.wake():
            self.log.debug("kernel %s did not take the wake-up for %s", kernel_id, kind)
        lock = self._locks.setdefault(kernel_id, asyncio.Lock())
        async with lock:
            try:
                if kind == "migrate":
                    await self.migrate(kernel_id, directive)
                elif kind == "shrink":
                    self.shrink(kernel_id, directive)
                elif kind == "killed":
                    await self.killed(kernel_id, directive)
                elif kind == "resized":
                    self.resized(kernel_id, directive)
                elif kind == "bursting":
                    self.bursting(kernel_id, directive)
                elif kind == "park":
                    await self._park(kernel_id, sentence(str(directive.get("reason") or "")
                                                         or "Parked with %gpu park"))
                elif kind == "unparked":
                    await self.unparked(kernel_id, directive)
                elif kind == "frozen":
                    await self.frozen(kernel_id, directive)
                elif kind == "moved":
                    await self.moved(kernel_id, directive)
                else:
                    self.log.warning("unknown directive %r for kernel %s", kind, kernel_id)
            except asyncio.CancelledError:
                raise
            except Exception:
                self.log.exception("directive %s for kernel %s failed", kind, kernel_id)

    # -- migrate -----------------------------------------------------------------------

    async def migrate(self, kernel_id: str, directive: dict[str, Any]) -> None:
        """Checkpoint (now when idle, else after the grace period) and restart on the new GPU."""
        kernel = self.kernel_manager.get_kernel(kernel_id)
        gpu = self.kernels.get(kernel_id)
        if gpu is None:
            return
        try:
            lease = await self.link.lease(str(directive.get("lease_id")))
        except AgentError as err:
            self.log.warning("kernel %s: migrate for a lease the agent cannot show: %s", kernel_id, err)
            return
        if lease.get("state") != "migrating":
            # Already carried out (a directive seen twice after the agent restarted), or the
            # agent gave up on the move and killed the kernel: nothing to do here.
            self.log.info("kernel %s: lease is %s; migrate directive skipped", kernel_id, lease.get("state"))
            return
        # The spare this kernel restarts in imports and makes its CUDA context on the target
        # meanwhile (the lease says where: it is migrating).
        await self._prepare_spare(kernel, lease)
        source, target = directive.get("from_gpu"), directive.get("to_gpu")
        reason = named_for_people(str(directive.get("reason") or ""))
        moves = f"from {gpu.label(source)} to {gpu.label(target)}"
        where = {
            # What the move is for ("to free GPU 1 for a job"): where to where, the event says.
            "reason": purpose(reason, moves).strip(),
            "from_gpu_index": gpu.index(source),
            "to_gpu_index": gpu.index(target),
            "gpu_uuid": source, "gpu_index": gpu.index(source),
        }
        now, clock = time.time(), time.monotonic()
        agent_deadline = float(directive.get("deadline") or now + self.grace_period + 60)
        time_left = max(agent_deadline - now - RESTART_MARGIN_S, 1.0)
        grace = min(self.grace_period, time_left)

        idle = await wait_until_idle(kernel, clock)
        if not idle:
            # Nothing moves yet: the running cell gets its grace period, and the user a countdown.
            # No count of seconds in the words: they would be stale at once (the event's
            # deadline is for a countdown); the clock time stays true.
            by = datetime.fromtimestamp(now + grace).strftime("%H:%M:%S")
            self.events.emit(
                kernel_id, "move_pending",
                f"To move {moves}{purpose(reason, moves)} once the running cell ends. If it has "
                f"not ended by {by}, it is cut off, and the kernel restarts from the state after "
                "the last completed cell.",
                deadline=now + grace, **where,
            )
            idle = await wait_until_idle(kernel, clock + grace,
                                         unless=lambda: self._shut_down(kernel_id, gpu))
            if await self._shut_down_meanwhile(kernel_id, kernel, gpu):
                return
        cut_off = not idle
        if cut_off:
            self.events.emit(
                kernel_id, "migrating",
                f"Moving {moves} now: the running cell did not finish within {format_duration(grace)} and is "
                "cut off; the variables come back as they were after the last completed cell.",
                **where,
            )
            # An interrupt ends the cell as the user's own would: its reply reaches the notebook
            # (no cell left at [*]) and the kernel hook records it as cut off, unsaved.
            await self._interrupt(kernel_id, kernel)
        else:
            self.events.emit(kernel_id, "migrating", f"Moving {moves}{purpose(reason, moves)}: "
                             "checkpointing, then restarting there.", **where)
            saved, why = await checkpoint(kernel, timeout=max(time_left - grace, 5.0))
            if not saved:
                # The checkpoint after the last completed cell is still there to restore.
                self.log.warning("kernel %s: checkpoint before move failed: %s", kernel_id, why)
        message = sentence(reason) if reason else f"Moved {moves}"
        self.log.info("kernel %s: restarting %s (cell cut off: %s)", kernel_id, moves, cut_off)
        await self._restart_restoring(kernel_id, gpu, {
            "cause": restart_cause(directive),
            "message": message + ".",
            "from_gpu": source,
            "to_gpu": target,
        })

    async def _restart_restoring(
        self, kernel_id: str, gpu: KernelGpu, reason: dict[str, Any]
    ) -> None:
        """Restart the kernel now; the new process restores the last good checkpoint."""
        if self._shut_down(kernel_id, gpu):
            self.log.info("kernel %s: shut down by its user; not restarted", kernel_id)
            return
        gpu.request_restore(reason)
        try:
            await self._restart(kernel_id, now=True)
        except Exception:
            if gpu.restore_pending:
                gpu.cancel_restore()
            raise

    def _shut_down(self, kernel_id: str, gpu: KernelGpu) -> bool:
        """Whether the kernel was shut down for good (its user's or the server's doing)."""
        return gpu.closed or kernel_id not in self.kernel_manager

    async def _shut_down_meanwhile(self, kernel_id: str, kernel: Any, gpu: KernelGpu) -> bool:
        """Whether the kernel was shut down while a move waited for its cell: then the move has
        nothing to restart (its GPU is free already). A shutdown in progress is waited for: a
        restart of the user's also passes through one, and the move goes on after that."""
        deadline = time.monotonic() + SHUTDOWN_WAIT_S
        while getattr(kernel, "shutting_down", False) and not self._shut_down(kernel_id, gpu):
            if time.monotonic() >= deadline:
                break
            await asyncio.sleep(0.1)
        if not self._shut_down(kernel_id, gpu):
            return False
        self.log.info("kernel %s: shut down by its user while a move waited for its cell; "
                      "nothing to move", kernel_id)
        return True

    @staticmethod
    async def _prepare_spare(kernel: Any, lease: dict[str, Any] | None) -> None:
        """Have a spare made ready for the kernel's coming restoring launch, if it has spares."""
        provisioner = getattr(kernel, "provisioner", None)
        prepare = getattr(provisioner, "prepare_spare", None)
        if prepare is not None:
            await prepare(lease)

    async def _interrupt(self, kernel_id: str, kernel: Any) -> None:
        try:
            await kernel.interrupt_kernel()
        except Exception as err:
            self.log.warning("kernel %s: interrupt before move failed: %s", kernel_id, err)
            return
        if not await wait_until_idle(kernel, time.monotonic() + INTERRUPT_WAIT_S):
            self.log.info("kernel %s: cell ignored the interrupt; restarting anyway", kernel_id)

    async def _restart(self, kernel_id: str, now: bool) -> None:
        future = await self.kernel_manager.restart_kernel(kernel_id, now=now)
        if isinstance(future, asyncio.Future):
            try:
                await asyncio.wait_for(future, timeout=120)
            except Exception as err:
                self.log.warning("kernel %s: restart did not answer: %s", kernel_id, err)

    def busy(self, kernel_id: str) -> bool:
        """Whether a directive or a restart is in progress for the kernel."""
        lock = self._locks.get(kernel_id)
        return lock is not None and lock.locked()

    async def restart_onto_lease(self, kernel_id: str, reason: dict[str, Any]) -> None:
        """Restart a kernel onto the lease it now holds, with its variables.

        Used when a kernel gets a GPU it did not have; nothing forces it, so a running cell is
        never cut off: the restart waits until the kernel is idle.
        """
        lock = self._locks.setdefault(kernel_id, asyncio.Lock())
        async with lock:
            gpu = self.kernels.get(kernel_id)
            if gpu is None:
                return
            kernel = self.kernel_manager.get_kernel(kernel_id)
            while not await wait_until_idle(kernel, time.monotonic() + 1.0):
                if kernel_id not in self.kernel_manager:
                    return
            saved, why = await checkpoint(kernel, timeout=60.0)
            if kernel_id not in self.kernel_manager:
                return  # shut down meanwhile: its cleanup gave the lease back
            if not saved:
                self.log.warning("kernel %s: checkpoint before restart failed: %s", kernel_id, why)
            self.log.info("kernel %s: restarting onto its new GPU share", kernel_id)
            await self._restart_restoring(kernel_id, gpu, reason)

    # -- park --------------------------------------------------------------------------

    async def park_idle(self, kernel_id: str, idle_s: float) -> None:
        """Park a kernel that has been idle for ``idle_s`` seconds (unless something else is
        under way for it)."""
        if self.busy(kernel_id):
            return
        lock = self._locks.setdefault(kernel_id, asyncio.Lock())
        async with lock:
            minutes = f"{idle_s / 60:.0f} min" if idle_s >= 90 else f"{idle_s:.0f} s"
            await self._park(kernel_id, f"Parked after {minutes} idle", idle_s)

    async def _park(self, kernel_id: str, message: str, idle_s: float | None = None) -> None:
        """Once the kernel is idle: frozen by the agent, the process and everything in it kept;
        where freezing cannot be used, its GPU tensors to host memory and a checkpoint, then a
        restart without a GPU (the agent parks the lease at the launch)."""
        gpu = self.kernels.get(kernel_id)
        if (gpu is None or not gpu.hooked or gpu.lease is None
                or gpu.lease.get("state") in ("parked", "freezing")):
            return
        kernel = self.kernel_manager.get_kernel(kernel_id)
        if not await wait_until_idle(kernel, time.monotonic() + PARK_IDLE_WAIT_S):
            # A cell runs again (the one after `%gpu park`): the kernel is in use, and a move
            # must not wait behind a park. It is parked once it is idle long enough.
            self.log.info("kernel %s: not parked: a cell is running", kernel_id)
            return
        # The durable copy first: a frozen process that dies later restores from it.
        saved, why = await checkpoint(kernel, timeout=PARK_CHECKPOINT_S)
        if kernel_id not in self.kernel_manager:
            return
        if not saved:
            self.log.warning("kernel %s: checkpoint before the freeze failed: %s", kernel_id, why)
        fallback = await self._park_frozen(kernel_id, gpu, message, idle_s)
        if fallback is None:
            return
        message = f"{message} (by a checkpoint and restart: {fallback.rstrip('.')})"
        saved, why = await checkpoint(kernel, timeout=PARK_CHECKPOINT_S, park=True)
        if kernel_id not in self.kernel_manager:
            return  # shut down meanwhile: its cleanup gave the lease back
        if not saved:
            gpu.park_refused = time.time()
            self.log.warning("kernel %s: not parked: %s", kernel_id, why)
            return
        source = gpu.lease.get("physical_gpu")
        self.log.info("kernel %s: parking (%s)", kernel_id, message)
        await self._restart_restoring(kernel_id, gpu, {
            "cause": contract.CAUSE_PARKED, "message": f"{message}; it gave {gpu.label(source)} "
            "back", "from_gpu": source, "to_gpu": None, "idle_s": idle_s,
        })

    async def _park_frozen(self, kernel_id: str, gpu: KernelGpu, message: str,
                           idle_s: float | None) -> str | None:
        """Ask the agent to freeze the kernel's process; None when it did, else why it could
        not (the caller falls back to a checkpoint and restart)."""
        lease_id = str((gpu.lease or {}).get("id"))
        source = (gpu.lease or {}).get("physical_gpu")
        started = time.monotonic()
        try:
            lease = await self.link.freeze(lease_id, reason=message[:1].lower() + message[1:])
        except AgentError as err:
            self.log.info("kernel %s: not frozen (%s); parking by checkpoint and restart",
                          kernel_id, err.message)
            return err.message
        gpu.lease = lease
        self.log.info("kernel %s: parked by freezing (%s)", kernel_id, message)
        self.events.emit(
            kernel_id, "parked", f"{message}: frozen in host memory in "
            f"{format_duration(time.monotonic() - started)}, it gave {gpu.label(source)} back. Its next cell "
            "thaws it; every variable, open file and thread is kept.",
            gpu_uuid=source, gpu_index=gpu.index(source), seconds=idle_s,
            protection=lease.get("protection"), frozen_bytes=lease.get("frozen_bytes"))
        return None

    async def _refreshed(self, kernel_id: str, what: str) -> KernelGpu | None:
        """The kernel's GPU state with its lease read again (None: not one of ours)."""
        gpu = self.kernels.get(kernel_id)
        if gpu is not None:
            try:
                await gpu.refresh()
            except AgentError as err:
                self.log.info("kernel %s: lease not refreshed %s: %s", kernel_id, what, err)
        return gpu

    async def frozen(self, kernel_id: str, directive: dict[str, Any]) -> None:
        """The agent froze the kernel for someone else's sake (a reclaim, a job): say why, and
        that it comes back by itself."""
        gpu = await self._refreshed(kernel_id, "after a freeze")
        if gpu is None or directive.get("cause") == "park":
            return  # a park this server asked for: it said so itself
        uuid = directive.get("gpu")
        reason = sentence(str(directive.get("reason") or "Frozen by the GPU agent"))
        self.events.emit(
            kernel_id, "frozen", f"{reason}.",
            reason=named_for_people(str(directive.get("reason") or "")),
            gpu_uuid=uuid, gpu_index=gpu.index(uuid), request=directive.get("request"),
            limit=directive.get("limit"), frozen_bytes=directive.get("frozen_bytes"),
            protection=FROZEN_IN_HOST_MEMORY)

    async def moved(self, kernel_id: str, directive: dict[str, Any]) -> None:
        """The agent moved the kernel by freezing it and thawing it on another GPU: say so."""
        gpu = await self._refreshed(kernel_id, "after a move")
        if gpu is None:
            return
        source, target = directive.get("from_gpu"), directive.get("to_gpu")
        self.events.emit(
            kernel_id, "migrated", f"{sentence(str(directive.get('reason') or 'Moved'))}.",
            reason=named_for_people(str(directive.get("reason") or "")),
            from_gpu_index=gpu.index(source),
            to_gpu_index=gpu.index(target), gpu_uuid=target, gpu_index=gpu.index(target),
            seconds=directive.get("seconds"))

    async def unparked(self, kernel_id: str, directive: dict[str, Any]) -> None:
        """A cell of a parked kernel got it a GPU again (a frozen one was thawed): say where."""
        gpu = await self._refreshed(kernel_id, "after unpark")
        if gpu is None:
            return
        uuid = directive.get("gpu")
        where = gpu.label(str(uuid) if uuid else None)
        if directive.get("thawed"):
            message = (f"Back on {where}: thawed after being frozen for "
                       f"{format_duration(float(directive.get('frozen_s') or 0))} in host "
                       "memory, with everything it held; nothing was restarted.")
        else:
            message = f"Back on {where}: a cell asked for a GPU, and it runs there."
        self.events.emit(
            kernel_id, "unparked", message, gpu_uuid=uuid, gpu_index=gpu.index(uuid),
            request=directive.get("request"), limit=directive.get("limit"),
            seconds=directive.get("seconds"),
        )

    # -- shrink and killed -------------------------------------------------------------

    def shrink(self, kernel_id: str, directive: dict[str, Any]) -> None:
        """The kernel hook shrinks itself (woken by ``_handle``, it reads the directive from the
        agent); the user hears why."""
        request, usage = int(directive.get("request") or 0), int(directive.get("usage") or 0)
        deadline = directive.get("deadline")
        by = ""
        if deadline:
            by = f" by {datetime.fromtimestamp(float(deadline)).strftime('%H:%M:%S')}"
        reason = named_for_people(str(directive.get("reason") or ""))
        self.events.emit(
            kernel_id, "shrink_requested",
            f"Asked to shrink to its {format_bytes(request)} request{by} (it holds "
            f"{format_bytes(usage)}): {reason or 'its GPU owner needs the memory back'}. "
            + ("If it does not, its process is frozen in host memory, with everything in it, "
               + ("until its next cell." if directive.get("cause") == "limit" else
                  "until its GPU has room again.") if directive.get("then") == "freeze" else
               "If it does not, the kernel is stopped and restored from its last checkpoint."),
            reason=reason, request=directive.get("request"), limit=directive.get("limit"),
            usage=directive.get("usage"),
        )

    def resized(self, kernel_id: str, directive: dict[str, Any]) -> None:
        """The user changed the share in the kernel (``%gpu request``): that is where it comes
        from now. Only this notebook's: ``--remember`` keeps it for new ones (the kernel does)."""
        gpu = self.kernels.get(kernel_id)
        request, limit = directive.get("request_spec"), directive.get("limit_spec")
        if gpu is None or not isinstance(request, str) or not request:
            return
        gpu.changed_share(request, limit if isinstance(limit, str) else None)

    def bursting(self, kernel_id: str, directive: dict[str, Any]) -> None:
        """The kernel began to use loaned memory: say so, once per burst."""
        gpu = self.kernels.get(kernel_id)
        if gpu is None:
            return
        uuid = directive.get("gpu")
        index = gpu.index(uuid)
        self.events.emit(
            kernel_id, "bursting",
            f"Using {format_bytes(int(directive.get('usage') or 0))}, above its "
            f"{format_bytes(int(directive.get('request') or 0))} guarantee on GPU {index}: the "
            "memory above the guarantee is loaned and may be asked back.",
            gpu_uuid=uuid, gpu_index=index, request=directive.get("request"),
            limit=directive.get("limit"), usage=directive.get("usage"),
        )

    async def killed(self, kernel_id: str, directive: dict[str, Any]) -> None:
        """Tell the user; make sure the kernel comes back once, restoring its last checkpoint."""
        state = self.kernels.get(kernel_id)
        if state is None:
            return
        gpu = directive.get("gpu") or directive.get("to_gpu")
        moved = directive.get("cause") == "migrate_timeout"
        reason = named_for_people(str(directive.get("reason") or ""))
        what = "Stopped by the GPU agent"
        if moved:
            what = "Stopped because its move did not finish in time"
        message = (f"{what}: {reason.strip().rstrip('.')}" if reason else what) + (
            "; it restarts and restores the state after its last completed cell.")
        self.events.emit(
            kernel_id, "oom_killed", message, reason=reason, request=directive.get("request"),
            limit=directive.get("limit"), usage=directive.get("usage"),
        )
        killed_at = float(directive.get("created") or time.time())
        # A launch that began after the kill has read the killed lease and restores by itself.
        if state.last_launch_started >= killed_at:
            return
        await self._prepare_spare(self.kernel_manager.get_kernel(kernel_id), state.lease)
        state.request_restore({
            "cause": contract.CAUSE_MIGRATED if moved else contract.CAUSE_OOM_KILLED,
            "message": message,
            "from_gpu": (state.lease or {}).get("physical_gpu") if moved else gpu,
            "to_gpu": gpu,
        })
        await self._restart_dead(kernel_id, state)

    async def _restart_dead(self, kernel_id: str, gpu: KernelGpu) -> None:
        """Restart a killed kernel now, not on jupyter_client's restarter's next poll (up to
        ``time_to_dead`` seconds later), and never a second time when the restarter began.

        With the restarter stopped and one turn of the loop given to a poll already under way
        (it runs without pausing from finding the kernel dead to firing its restart callback),
        the callback count says whether it took the restart on; if not, nobody else will.
        """
        kernel = self.kernel_manager.get_kernel(kernel_id)
        restarts, launches = gpu.restarter_restarts, gpu.launches
        restarter = bool(getattr(kernel, "autorestart", False))
        if restarter:
            kernel.stop_restarter()
        try:
            await asyncio.sleep(0)
            deadline = time.monotonic() + KILL_SETTLE_S
            while True:
                # Someone else's launch (a restart that began meanwhile, or the user's shutdown
                # or restart) has it in hand; a new process's liveness says nothing of the old.
                if (gpu.restarter_restarts != restarts or gpu.launches != launches
                        or getattr(kernel, "shutting_down", False)):
                    return
                if not await kernel.is_alive():
                    break
                if time.monotonic() >= deadline:  # the notice may come a moment before the exit
                    self.log.info("kernel %s: reported killed but alive; leaving it be", kernel_id)
                    return
                await asyncio.sleep(0.05)
            self.log.info("kernel %s: killed by the agent; restarting it now", kernel_id)
            await self._restart(kernel_id, now=True)
        finally:
            # A shutdown under way ends with no restarter (for good) or starts its own (a
            # restart): one started now would outlive the kernel and launch it again.
            if (restarter and kernel_id in self.kernel_manager
                    and not getattr(kernel, "shutting_down", False)):
                kernel.start_restarter()
