"""Carrying out the agent's directives for this server's kernels: migrate, shrink, killed."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from datetime import datetime
from typing import Any

from jupyter_gpufrac import contract
from jupyter_gpufrac.server.agent_link import AgentError, AgentLink, AgentUnavailable
from jupyter_gpufrac.server.events import KernelEventLog
from jupyter_gpufrac.server.kernel_channel import checkpoint, wait_until_idle
from jupyter_gpufrac.server.provisioner import GpuFracProvisioner, gpu_label
from node_agent.quantities import format_bytes

LONG_POLL_S = 25.0
# Every kind: the server acts on migrate and killed, tells people of shrink, resized, bursting.
HEARD = ("migrate", "shrink", "killed", "resized", "bursting")
MAX_BACKOFF_S = 10.0
# Time left before the agent's deadline for the restart itself after the checkpoint.
RESTART_MARGIN_S = 10.0
# How long a process the agent reported killed may take to be gone.
KILL_SETTLE_S = 2.0
# How long a cut-off cell may take to end after its interrupt before the kernel restarts anyway.
INTERRUPT_WAIT_S = 5.0


def restart_cause(directive: dict[str, Any]) -> str:
    """``request_changed`` for a move the user's new request caused, else ``migrated``."""
    if directive.get("cause") == contract.CAUSE_REQUEST_CHANGED:
        return contract.CAUSE_REQUEST_CHANGED
    return contract.CAUSE_MIGRATED


def sentence(text: str) -> str:
    """An agent's reason ("moved from GPU 1 to GPU 0 to free …") as the start of a sentence."""
    text = text.strip().rstrip(".")
    return text[:1].upper() + text[1:]


class DirectiveListener:
    """Long-polls the agent for directives addressed to this server and acts on each."""

    def __init__(
        self,
        link: AgentLink,
        client_name: str,
        kernel_manager: Any,
        events: KernelEventLog,
        grace_period: float,
        remember_request: Callable[[str, str | None], None],
        log: logging.Logger,
    ) -> None:
        self.link = link
        self.client_name = client_name
        self.kernel_manager = kernel_manager
        self.events = events
        self.grace_period = grace_period
        self.remember_request = remember_request
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
        provisioner = self._provisioner(kernel_id)
        held = (provisioner.lease or {}).get("id") if provisioner is not None else None
        if held is None or held != directive.get("lease_id"):
            # Kernel ids show in `ps`: anyone may write one on a lease of their own.
            self.log.warning("directive %s for kernel %s names lease %s, not the kernel's (%s): "
                             "ignored", kind, kernel_id, directive.get("lease_id"), held)
            return
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
                else:
                    self.log.warning("unknown directive %r for kernel %s", kind, kernel_id)
            except asyncio.CancelledError:
                raise
            except Exception:
                self.log.exception("directive %s for kernel %s failed", kind, kernel_id)

    def _provisioner(self, kernel_id: str) -> GpuFracProvisioner | None:
        kernel = self.kernel_manager.get_kernel(kernel_id)
        provisioner = getattr(kernel, "provisioner", None)
        return provisioner if isinstance(provisioner, GpuFracProvisioner) else None

    # -- migrate -----------------------------------------------------------------------

    async def migrate(self, kernel_id: str, directive: dict[str, Any]) -> None:
        """Checkpoint (now when idle, else after the grace period) and restart on the new GPU."""
        kernel = self.kernel_manager.get_kernel(kernel_id)
        provisioner = self._provisioner(kernel_id)
        if provisioner is None:
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
        gpus = provisioner.gpus
        source, target = directive.get("from_gpu"), directive.get("to_gpu")
        reason = str(directive.get("reason") or "")
        moves = f"from {gpu_label(gpus, source)} to {gpu_label(gpus, target)}"
        where = {
            "reason": reason,
            "from_gpu_index": gpus.get(source or "", {}).get("index"),
            "to_gpu_index": gpus.get(target or "", {}).get("index"),
            "gpu_uuid": source, "gpu_index": gpus.get(source or "", {}).get("index"),
        }
        now, clock = time.time(), time.monotonic()
        agent_deadline = float(directive.get("deadline") or now + self.grace_period + 60)
        time_left = max(agent_deadline - now - RESTART_MARGIN_S, 1.0)
        grace = min(self.grace_period, time_left)
        idle = await wait_until_idle(kernel, clock)
        if not idle:
            # Nothing moves yet: the running cell gets its grace period, and the user a countdown.
            self.events.emit(
                kernel_id, "move_pending",
                f"Will move {moves} in {grace:.0f} s ({reason or 'asked by the GPU agent'}); the "
                "running cell may finish until then, otherwise it is cut off and the kernel "
                "restarts from the state after the last completed cell.",
                deadline=now + grace, **where,
            )
            idle = await wait_until_idle(kernel, clock + grace)
        cut_off = not idle
        if cut_off:
            self.events.emit(
                kernel_id, "migrating",
                f"Moving {moves} now: the running cell did not finish within {grace:.0f} s and is "
                "cut off; the variables come back as they were after the last completed cell.",
                **where,
            )
            # An interrupt ends the cell as the user's own would: its reply reaches the notebook
            # (no cell left at [*]) and the kernel hook records it as cut off, unsaved.
            await self._interrupt(kernel_id, kernel)
        else:
            self.events.emit(kernel_id, "migrating", f"Moving {moves}: checkpointing, then "
                             f"restarting there ({reason or 'asked by the GPU agent'}).", **where)
            saved, why = await checkpoint(kernel, timeout=max(time_left - grace, 5.0))
            if not saved:
                # The checkpoint after the last completed cell is still there to restore.
                self.log.warning("kernel %s: checkpoint before move failed: %s", kernel_id, why)
        message = sentence(reason) if reason else f"Moved {moves}"
        self.log.info("kernel %s: restarting %s (cell cut off: %s)", kernel_id, moves, cut_off)
        await self._restart_restoring(kernel_id, provisioner, {
            "cause": restart_cause(directive),
            "message": message + ".",
            "from_gpu": source,
            "to_gpu": target,
        })

    async def _restart_restoring(
        self, kernel_id: str, provisioner: GpuFracProvisioner, reason: dict[str, Any]
    ) -> None:
        """Restart the kernel now; the new process restores the last good checkpoint."""
        provisioner.request_restore(reason)
        try:
            await self._restart(kernel_id, now=True)
        except Exception:
            if provisioner.restore_pending:
                provisioner.cancel_restore()
            raise

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
        """Restart a kernel onto the lease its provisioner now holds, with its variables.

        Used when a kernel gets a GPU it did not have; nothing forces it, so a running cell is
        never cut off: the restart waits until the kernel is idle.
        """
        lock = self._locks.setdefault(kernel_id, asyncio.Lock())
        async with lock:
            provisioner = self._provisioner(kernel_id)
            if provisioner is None:
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
            await self._restart_restoring(kernel_id, provisioner, reason)

    # -- shrink and killed -------------------------------------------------------------

    def shrink(self, kernel_id: str, directive: dict[str, Any]) -> None:
        """The kernel hook shrinks itself (it hears the agent too); the user hears why."""
        request, usage = int(directive.get("request") or 0), int(directive.get("usage") or 0)
        deadline = directive.get("deadline")
        by = ""
        if deadline:
            by = f" by {datetime.fromtimestamp(float(deadline)).strftime('%H:%M:%S')}"
        reason = str(directive.get("reason") or "")
        self.events.emit(
            kernel_id, "shrink_requested",
            f"Asked to shrink to its {format_bytes(request)} request{by} (it holds "
            f"{format_bytes(usage)}): {reason or 'its GPU owner needs the memory back'}. "
            "If it does not, the kernel is stopped and restored from its last checkpoint.",
            reason=reason, request=directive.get("request"), limit=directive.get("limit"),
            usage=directive.get("usage"),
        )

    def resized(self, kernel_id: str, directive: dict[str, Any]) -> None:
        """The user changed the share in the kernel (``%gpu request``): their next kernels ask
        for it too."""
        provisioner = self._provisioner(kernel_id)
        request, limit = directive.get("request_spec"), directive.get("limit_spec")
        if provisioner is None or not isinstance(request, str) or not request:
            return
        spec = (request, limit if isinstance(limit, str) else None)
        if provisioner.asked_share is not None and spec != provisioner.asked_share:
            provisioner.asked_share = spec
            provisioner.share_source = {"request": contract.SOURCE_MAGIC,
                                        "limit": contract.SOURCE_MAGIC}
            self.remember_request(*spec)

    def bursting(self, kernel_id: str, directive: dict[str, Any]) -> None:
        """The kernel began to use loaned memory: say so, once per burst."""
        provisioner = self._provisioner(kernel_id)
        if provisioner is None:
            return
        uuid = directive.get("gpu")
        index = provisioner.gpus.get(str(uuid), {}).get("index")
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
        provisioner = self._provisioner(kernel_id)
        if provisioner is None:
            return
        gpu = directive.get("gpu") or directive.get("to_gpu")
        moved = directive.get("cause") == "migrate_timeout"
        reason = str(directive.get("reason") or "")
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
        if provisioner.last_launch_started >= killed_at:
            return
        provisioner.request_restore({
            "cause": contract.CAUSE_MIGRATED if moved else contract.CAUSE_OOM_KILLED,
            "message": message,
            "from_gpu": (provisioner.lease or {}).get("physical_gpu") if moved else gpu,
            "to_gpu": gpu,
        })
        await self._restart_dead(kernel_id, provisioner)

    async def _restart_dead(self, kernel_id: str, provisioner: GpuFracProvisioner) -> None:
        """Restart a killed kernel now, not on jupyter_client's restarter's next poll (up to
        ``time_to_dead`` seconds later), and never a second time when the restarter began.

        With the restarter stopped and one turn of the loop given to a poll already under way
        (it runs without pausing from finding the kernel dead to firing its restart callback),
        the callback count says whether it took the restart on; if not, nobody else will.
        """
        kernel = self.kernel_manager.get_kernel(kernel_id)
        restarts, launches = provisioner.restarter_restarts, provisioner.launches
        restarter = bool(getattr(kernel, "autorestart", False))
        if restarter:
            kernel.stop_restarter()
        try:
            await asyncio.sleep(0)
            deadline = time.monotonic() + KILL_SETTLE_S
            while await kernel.is_alive():  # the notice may come a moment before the exit
                if time.monotonic() >= deadline:
                    self.log.info("kernel %s: reported killed but alive; leaving it be", kernel_id)
                    return
                await asyncio.sleep(0.05)
            if provisioner.restarter_restarts != restarts or provisioner.launches != launches:
                return
            self.log.info("kernel %s: killed by the agent; restarting it now", kernel_id)
            await self._restart(kernel_id, now=True)
        finally:
            if restarter and kernel_id in self.kernel_manager:
                kernel.start_restarter()
