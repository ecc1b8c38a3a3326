"""Following each kernel of the server: its launches and restores, its account, its GPU share."""

from __future__ import annotations

import asyncio
import datetime
import logging
import time
from collections.abc import Callable
from typing import Any

from jupyter_gpufrac import contract
from jupyter_gpufrac.server.account import kernel_push
from jupyter_gpufrac.server.directive_listener import DirectiveListener
from jupyter_gpufrac.server.events import KernelEventLog
from jupyter_gpufrac.server.keeper import StateKeeper
from jupyter_gpufrac.server.kernel_channel import restore_report, restore_summary
from jupyter_gpufrac.server.kernels import KernelGpu, Kernels
from jupyter_gpufrac.server.launch import lease_gpus
from jupyter_gpufrac.server.notebook_states import EarlierState, clock, how_it_ended
from jupyter_gpufrac.server.resume import heartbeat

RESTORE_REPORT_WAIT_S = 60.0
# How long a kernel's account waits for the kernel manager to list a launching kernel.
ACCOUNT_LIST_WAIT_S = 60.0


class KernelFollower:
    """What the server does after each kernel event and launch, and its watch of the leases."""

    def __init__(self, serverapp: Any, kernels: Kernels, events: KernelEventLog,
                 keeper: StateKeeper, spawn: Callable[[Any], None],
                 agent_error: Callable[[], str | None], log: logging.Logger, *, resume: str,
                 lease_poll_interval: float, park_after: float) -> None:
        self.serverapp = serverapp
        self.kernels = kernels
        self.events = events
        self.keeper = keeper
        self.spawn = spawn
        # None while the agent answers; else why not (the app's, as it changes).
        self.agent_error = agent_error
        self.log = log
        self.resume = resume
        self.lease_poll_interval = lease_poll_interval
        self.park_after = park_after
        # Set once the server listens for the agent's directives.
        self.listener: DirectiveListener | None = None

    def launched(self, kernel_id: str, info: dict[str, Any]) -> None:
        """After each launch: when it restored, wait for the kernel hook's report; when an
        earlier state of its notebook waits for the user's word (c.GpuFrac.resume "ask"), ask."""
        if info.get("notebook") and kernel_id not in self.events.notebooks:
            # Its events name the notebook from the start (the session is listed later).
            self.events.notebooks[kernel_id] = str(info["notebook"])
        reason = info.get("reason")
        if reason is not None:
            self.spawn(self._follow_restore(kernel_id, reason))
        state = info.get("resumable")
        if isinstance(state, EarlierState) and self.resume == contract.RESUME_ASK:
            cell = f"after cell [{state.cell}], " if state.cell else ""
            self.events.emit(
                kernel_id, "resumable",
                f"This notebook's earlier kernel left its state: {how_it_ended(state)}. Its last "
                f"checkpoint ({cell}{clock(state.time)}) holds "
                f"{len(state.names)} variable{'' if len(state.names) == 1 else 's'}. Restore it, "
                "or start fresh.", reason=how_it_ended(state))

    def account_changed(self, kernel_id: str) -> None:
        # Written in the event itself, so a `%gpu` run after anything that shows the event
        # reads it; only a launch's events, before the kernel is listed, wait for the listing.
        if not self._leave_account(kernel_id):
            self.spawn(self._leave_account_once_listed(kernel_id))

    async def _leave_account_once_listed(self, kernel_id: str) -> None:
        if await self._listed(kernel_id):
            self._leave_account(kernel_id)

    async def _listed(self, kernel_id: str) -> bool:
        """Wait until the kernel manager lists a launching kernel (a new one is listed only once
        its first launch is done); False when it is not listed in time."""
        km = self.serverapp.kernel_manager if self.serverapp else None
        deadline = time.monotonic() + ACCOUNT_LIST_WAIT_S
        while km is not None and kernel_id not in km:
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.05)
        return km is not None

    def _leave_account(self, kernel_id: str) -> bool:
        """After each event of a kernel: its account, for `%gpu`, in its folder (a small file,
        computed when written, so the last one written follows the last event). False while
        the kernel manager does not list the kernel yet."""
        km = self.serverapp.kernel_manager if self.serverapp else None
        if km is None or kernel_id not in km:
            return km is None
        gpu = self.kernels.get(kernel_id)
        if gpu is not None:
            gpu.write_account(kernel_push(km.get_kernel(kernel_id), gpu, gpu.lease,
                                          self.events.events(kernel_id),
                                          agent_error=self.agent_error()))
        return True

    async def _follow_restore(self, kernel_id: str, reason: dict[str, Any]) -> None:
        listed = await self._listed(kernel_id)
        kernel = (self.serverapp.kernel_manager.get_kernel(kernel_id)
                  if listed and self.serverapp is not None else None)
        report = None if kernel is None else await restore_report(kernel, RESTORE_REPORT_WAIT_S)
        gpu = self.kernels.get(kernel_id)
        if gpu is not None and report is not None:
            gpu.saw_generation(report.get("generation"))
            await gpu.restored()
        where = gpu.where() if gpu is not None else {}
        cause = str(reason.get("message") or "Restarted").rstrip(".")
        summary = restore_summary(report, RESTORE_REPORT_WAIT_S)
        if gpu is not None:
            gpu.last_restore = summary
        if reason.get("cause") == contract.CAUSE_PARKED and summary["ok"]:
            # Nothing happened to the notebook that it must hear of: "parked" said it all, and
            # the REST model keeps the verified report. A loss is said like any other.
            self.log.info("kernel %s: parked with every variable (%s)", kernel_id,
                          summary["message"])
            return
        message = f"{cause}; {summary['message']}"
        if reason.get("cause") == contract.CAUSE_RESUMED:
            # Short enough for a notification: from when and where, what came back and not.
            message = f"Resumed from {reason.get('from_where')}: {summary['message']}"
        self.events.emit(
            kernel_id, "restored", message, cause=reason.get("cause"),
            reason=str(reason.get("message") or ""), restored=summary["restored"],
            lost=summary["lost"], deferred=summary["deferred"], ok=summary["ok"],
            interrupted_cell=summary["interrupted_cell"], **where,
        )

    async def watch_leases(self) -> None:
        """A GPU share for kernels that started without one, once there is room."""
        while True:
            await asyncio.sleep(self.lease_poll_interval)
            try:
                await self._look_at_leases()
            except Exception:  # the watch must outlive any one bad answer
                self.log.exception("gpufrac: the lease watch failed; looking again")

    async def _look_at_leases(self) -> None:
        kernels = self.kernels.items()
        await self._refresh_notebooks()
        # Each kernel's newest checkpoint generation, learned while it runs: a restore after
        # a crash then knows what the folder held before anyone could rename it.
        await asyncio.to_thread(_look_at_checkpoints,
                                [gpu for _, gpu in kernels if gpu.hooked and not gpu.closed])
        if self.agent_error() is None:
            for kernel_id, gpu in kernels:
                if gpu.lease is None and gpu.launches and not gpu.closed:
                    await self._give_gpu(kernel_id, gpu)
            self._park_idle(kernels)

    def _park_idle(self, kernels: list[tuple[str, KernelGpu]]) -> None:
        """Park the kernels idle for park_after seconds (a refused one waits as long again)."""
        km = self.kernels.kernel_manager
        if not self.park_after or self.listener is None or km is None:
            return
        now = time.time()
        for kernel_id, gpu in kernels:
            kernel = km.get_kernel(kernel_id) if kernel_id in km else None
            last = getattr(kernel, "last_activity", None)
            if (getattr(kernel, "execution_state", None) != "idle"
                    or not isinstance(last, datetime.datetime)):
                continue
            idle = now - last.timestamp()
            if idle >= self.park_after and gpu.parkable(now, self.park_after):
                self.spawn(self.listener.park_idle(kernel_id, idle))

    async def _give_gpu(self, kernel_id: str, gpu: KernelGpu) -> None:
        """A kernel that started without a GPU share gets one once there is room."""
        if self.listener is None or self.listener.busy(kernel_id):
            return
        lease = await gpu.acquire_lease()
        if lease is None:
            return
        uuids = lease_gpus(lease)
        label = gpu.label(uuids[0] if uuids else None)
        self.log.info("kernel %s: a GPU share became free on %s", kernel_id, label)
        self.spawn(self.listener.restart_onto_lease(kernel_id, {
            "cause": contract.CAUSE_PLACED,
            "message": f"A GPU share became free on {label}: restarted there with its variables.",
            "from_gpu": None, "to_gpu": uuids[0] if uuids else None,
        }))

    async def _refresh_notebooks(self) -> None:
        """Which notebook each kernel serves, so messages can name it."""
        sessions = getattr(self.serverapp, "session_manager", None)
        if sessions is None:
            return
        try:
            for session in await sessions.list_sessions():
                kernel = session.get("kernel") or {}
                if kernel.get("id") and session.get("path"):
                    kernel_id, path = str(kernel["id"]), str(session["path"])
                    before = self.events.notebooks.get(kernel_id)
                    self.events.notebooks[kernel_id] = path
                    if before != path:
                        await self.keeper.session_moved(kernel_id, path)
        except Exception as err:  # a lookup for messages must never stop the watch
            self.log.debug("gpufrac: sessions: %s", err)


def _look_at_checkpoints(gpus: list[KernelGpu]) -> None:
    """:meth:`KernelGpu.look_at_checkpoint` of each, and its record's heartbeat (in a thread:
    file I/O); never raises."""
    for gpu in gpus:
        try:
            gpu.look_at_checkpoint()
            heartbeat(gpu)
        except Exception:  # one unreadable folder must not stop the lease watch
            gpu.log.debug("gpufrac: kernel %s: checkpoint not read", gpu.kernel_id,
                          exc_info=True)
