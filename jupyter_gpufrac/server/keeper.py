"""Each notebook's state kept through server stops, idle culls, renames and the user's answers."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import time
from typing import Any

from jupyter_gpufrac.notebook_record import Notebook
from jupyter_gpufrac.server import retention
from jupyter_gpufrac.server.kernels import KernelGpu, Kernels
from jupyter_gpufrac.server.notebook_states import ENDED_STOPPED, EarlierState
from jupyter_gpufrac.server.resume import follow_rename, leave_record
from jupyter_gpufrac.server.settings import KernelSettings
from jupyter_gpufrac.server.stopping import Outcome, log_outcomes, make_durable

# jupyter_server's contents events: a rename names the notebook's old and new paths.
CONTENTS_SCHEMA_ID = "https://events.jupyter.org/jupyter_server/contents_service/v1"
# How long the user's "restore" waits for the kernel's restart to answer.
RESTART_WAIT_S = 60.0


class StateKeeper:
    """What the server does so that a notebook outlives it: every checkpoint durable before it
    stops (or when `jupyter gpufrac flush` asks), jupyter_server's idle culling made a park to
    disk, records that follow renames, and the user's answer to "restore the earlier state?"."""

    def __init__(self, kernels: Kernels, settings: KernelSettings, grace: float,
                 log: logging.Logger) -> None:
        self.kernels = kernels
        self.settings = settings
        self.grace = grace
        self.log = log

    # -- durable before the server goes --------------------------------------------------

    async def flush(self) -> list[Outcome]:
        """`jupyter gpufrac flush`: every kernel's checkpoint durable now (the server runs on)."""
        return await self._make_durable("flush")

    async def stopping(self) -> None:
        """The server stops next: every kernel's checkpoint durable within the grace, and each
        record says the server stopped, and what its state holds."""
        outcomes = await self._make_durable("stopping")
        found = {outcome.kernel_id: outcome for outcome in outcomes}

        def ended() -> None:
            for kernel_id, gpu in self.kernels.items():
                outcome = found.get(kernel_id)
                leave_record(gpu, {"how": ENDED_STOPPED, "time": time.time(),
                                   "durable": outcome.durable if outcome else None,
                                   "cell": outcome.cell if outcome else None}, durable=True)

        await asyncio.to_thread(ended)

    async def _make_durable(self, why: str) -> list[Outcome]:
        km = self.kernels.kernel_manager
        if km is None:
            return []
        kernels = [(kernel_id, km.get_kernel(kernel_id), gpu)
                   for kernel_id, gpu in self.kernels.items() if not gpu.closed]
        started = time.monotonic()
        outcomes = await make_durable(kernels, self.grace)
        log_outcomes(self.log, outcomes, time.monotonic() - started, self.grace, why)
        return outcomes

    # -- jupyter_server's own events -----------------------------------------------------

    def watch_culling(self, km: Any) -> None:
        """jupyter_server's idle culling of a kernel parks it to disk: its next kernel resumes
        (the provisioner reads ``culling`` at the shutdown it causes)."""
        cull = getattr(km, "cull_kernel_if_idle", None)
        if cull is None or getattr(cull, "gpufrac_parks", False):
            return
        kernels = self.kernels

        async def cull_kernel_if_idle(kernel_id: str) -> None:
            gpu = kernels.get(kernel_id)
            if gpu is not None:
                gpu.culling = True
            try:
                done = cull(kernel_id)
                if inspect.isawaitable(done):
                    await done
            finally:
                if gpu is not None:
                    gpu.culling = False

        cull_kernel_if_idle.gpufrac_parks = True  # type: ignore[attr-defined]
        km.cull_kernel_if_idle = cull_kernel_if_idle

    def follow_renames(self, event_logger: Any) -> None:
        """A notebook renamed or moved (jupyter_server's contents events) keeps its state: its
        running kernel's record, and the records of earlier kernels' states, follow it."""
        if event_logger is None:
            return

        # jupyter_events calls it with these keywords; what it raises would fail the rename.
        async def renamed(logger: Any, schema_id: str, data: dict[str, Any]) -> None:
            if data.get("action") == "rename" and data.get("source_path") and data.get("path"):
                await self.notebook_moved(str(data["source_path"]), str(data["path"]))

        with contextlib.suppress(Exception):  # an older jupyter_server without the schema
            event_logger.add_listener(schema_id=CONTENTS_SCHEMA_ID, listener=renamed)

    async def notebook_moved(self, source: str, target: str) -> None:
        """``source`` (a notebook or a folder) is now ``target``: records follow (file I/O in a
        thread; never raises)."""
        if self.settings.folder_problem:
            return
        running = [gpu for _, gpu in self.kernels.items() if gpu.notebook is not None]
        try:
            moved = await asyncio.to_thread(follow_rename, running, self.settings, source, target)
        except Exception:  # following a rename must never fail the rename
            self.log.exception("gpufrac: following the rename of %s to %s failed", source, target)
            return
        if moved:
            self.log.info("gpufrac: %d checkpoint records follow %s to %s", moved, source, target)

    async def session_moved(self, kernel_id: str, path: str) -> None:
        """The path of a kernel's session, first seen or moved by a client (JupyterLab moves it
        after a rename): the kernel's record names it, whether or not a contents event said so
        (the name a client gave the session, from which the launch took the path, may not be
        the file's)."""
        gpu = self.kernels.get(kernel_id)
        notebook = gpu.notebook if gpu is not None else None
        if gpu is not None and notebook is not None and notebook.path != path.strip("/"):
            gpu.notebook = Notebook(notebook.user, notebook.root, path.strip("/"))
            await asyncio.to_thread(leave_record, gpu)

    # -- the user's answer ---------------------------------------------------------------

    async def decline(self, gpu: KernelGpu, state: EarlierState) -> None:
        """The user chose a fresh start over an earlier state: it is never offered again, and
        removed like a shut-down kernel's after checkpoint_keep_seconds."""
        settings = self.settings
        await asyncio.to_thread(retention.mark_shut_down, settings.checkpoint_root, state.folder,
                                settings.checkpoint_keep_seconds, self.log)
        await asyncio.to_thread(leave_record, gpu)

    async def restore(self, kernel_id: str, gpu: KernelGpu, state: EarlierState) -> None:
        """The user chose to restore an earlier state: the kernel restarts taking it over."""
        gpu.resume_next = state
        km = self.kernels.kernel_manager
        self.log.info("kernel %s: restarting to take over the state in %s", kernel_id,
                      state.folder)
        try:
            done = await km.restart_kernel(kernel_id, now=True) if km is not None else None
            if isinstance(done, asyncio.Future):
                await asyncio.wait_for(done, timeout=RESTART_WAIT_S)
        except Exception as err:
            self.log.warning("kernel %s: the restart to take over %s did not answer: %s",
                             kernel_id, state.folder, err)
        finally:
            gpu.resume_next = None

    # -- the file system -----------------------------------------------------------------

    async def say_if_hard_links_refused(self) -> None:
        """Once at start: the content store shares identical blobs by hard links; where the
        file system refuses them (some network file systems) each kernel keeps copies."""
        root = self.settings.checkpoint_root
        why = await asyncio.to_thread(retention.hard_links_refused, root)
        if why is not None:
            self.log.warning("gpufrac: hard links are refused in %s (%s): each kernel keeps its "
                             "own copy of the blobs it shares with your other kernels", root, why)
