"""The per-kernel controller: caps torch, follows directives, checkpoints, restores, explains."""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import sys
import threading
import time
import types
from collections.abc import Callable, Mapping
from dataclasses import asdict
from typing import Any

from jupyter_gpufrac.kernel import (
    cell_errors,
    frameworks,
    history,
    ladder,
    messages,
    namespace,
    offload,
    parking,
    restoring,
    rng,
    server_channel,
    store,
    torch_adapter,
)
from jupyter_gpufrac.kernel import env as kenv
from jupyter_gpufrac.kernel.agent_client import AGENT_CALL_TIMEOUT, make_client
from jupyter_gpufrac.kernel.budget import DiskLimits
from jupyter_gpufrac.kernel.checkpoint import Checkpointer, CheckpointError, CheckpointResult
from jupyter_gpufrac.kernel.directives import DirectiveWatcher
from jupyter_gpufrac.kernel.disk_shares import SharedDiskLimits
from jupyter_gpufrac.kernel.import_hook import after_import
from jupyter_gpufrac.kernel.observations import ObservationSender
from jupyter_gpufrac.kernel.served_notebook import ServedNotebook
from jupyter_gpufrac.wake import WakeReceiver, wake_path

log = logging.getLogger(__name__)

FIRST_LINE_CHARS = 80
# A kernel that exits waits this long for the checkpoint being written (jupyter_client kills a
# kernel that has not exited 5 s after it was asked to shut down).
EXIT_FLUSH_S = 4.0


def cell_label(execution_count: int | None, source: str) -> str:
    """``[7] for epoch in range(100):``: how people find a cell again."""
    first = next((line.strip() for line in source.splitlines() if line.strip()), "")
    if len(first) > FIRST_LINE_CHARS:
        first = first[: FIRST_LINE_CHARS - 1] + "…"
    return f"[{execution_count if execution_count is not None else ' '}] {first}".rstrip()


class GpuFracHook:
    """Everything the extension does in one kernel; one instance per loaded extension."""

    def __init__(self, ip: Any, environment: kenv.KernelEnv, *, poll_timeout: float = 25.0) -> None:
        self.ip = ip
        self.env = environment
        self.request = environment.request
        self.limit = environment.limit
        self.share_source: dict[str, str | None] = dict(environment.share_source)
        # Generations go on from the newest the server saw, whatever a restore loads.
        self.checkpointer = self._make_checkpointer(environment.checkpoint_generation)
        # The notebook this kernel serves as the server's record says, and which record that
        # was (inode, mtime, size): it goes into every checkpoint's header.
        self._served = ServedNotebook(environment.checkpoint_dir)
        # An earlier kernel's state of the notebook waits (c.GpuFrac.resume "ask", "never"):
        # the first cell says `%gpu restore` takes it over.
        self._resume_untold = environment.resumable is not None and not environment.restore
        self.state = ladder.LadderState()
        self.cap: int | None = None
        self.torch_seen = False
        self.offloaded: list[offload.Offloaded] = []
        self.restore_report: dict[str, Any] | None = None
        self._restore_reason: kenv.RestartReason | None = None
        # The restore at start is told with the first cell, however late that cell comes.
        self._restore_untold = False
        # When a cell last got its GPU back by a thaw: the agent's notice of that thaw, which
        # may come later, was told by the cell.
        self._thawed_by_cell_at = 0.0
        # Restored at extension load: IPython hides every name present then (user_ns_hidden);
        # these are the user's, so they are unhidden before anything else runs.
        self._restored_names: list[str] = []
        self._rng_after_restore: dict[str, Any] | None = None
        self._running: dict[str, Any] | None = None  # the cell running now, as cells.json says
        self._in_cell = False  # any cell runs (one kept in the history or not)
        self._running_source: tuple[str, str] | None = None  # its source (parsed, raw)
        self.checkpoint_error: str | None = None
        self.watcher: DirectiveWatcher | None = None
        self.poll_timeout = poll_timeout
        self.started = time.time()
        self._lock = threading.RLock()
        # What turns the after-import callbacks off again (``%unload_ext``).
        self._import_hooks: list[Callable[[], None]] = []
        self.tensorflow_capped: list[str] = []
        self._cells_path = environment.checkpoint_dir / store.CELLS_FILE
        self._previous_cells = {} if environment.checkpoints_off else self._read_previous_cells()
        # Checkpoints and offloads, told to the agent for its metrics (with a lease only).
        self.observations: ObservationSender | None = None
        if environment.lease_id:
            self.observations = ObservationSender(
                lambda: make_client(environment.agent_socket), environment.lease_id)
        # Started parked: CUDA stays untouched until a cell gets a GPU back (see unpark).
        self.parked = environment.parked
        # Frozen by the agent: the process kept everything, its GPU state is in host memory,
        # and the next cell asks for it back before it runs (as a parked one does).
        self.frozen = False
        # (message id, why) of the last cell that did not get a GPU back.
        self._unpark_refused: tuple[str, str] | None = None

    def _make_checkpointer(self, generation: int) -> Checkpointer:
        """The checkpointer of this kernel's folder, its budgets from the environment."""
        environment = self.env
        checkpointer = Checkpointer(environment.checkpoint_dir)
        checkpointer.generation = generation
        if environment.checkpoint_disk_shares:
            checkpointer.limits = SharedDiskLimits(
                environment.checkpoint_dir, environment.checkpoint_kernel_budget,
                environment.checkpoint_user_budget, environment.checkpoint_disk_shares)
        elif (environment.checkpoint_kernel_budget is not None
                or environment.checkpoint_user_budget is not None):
            checkpointer.limits = DiskLimits(
                environment.checkpoint_dir, environment.checkpoint_kernel_budget,
                environment.checkpoint_user_budget)
        checkpointer.staging_budget = environment.checkpoint_staging_budget
        return checkpointer

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        """Register callbacks, cap torch, restore if asked, start following the agent."""
        if self.parked:
            # Before anything can import torch (the restore does) and ask it about CUDA.
            torch_adapter.hold_cuda()
            self.ip.input_transformers_post.append(self._unpark_before_cell)
        server_channel.register(self)
        atexit.register(self.flush_checkpoints)
        self.ip.events.register("pre_execute", self.pre_execute)
        self.ip.events.register("pre_run_cell", self.pre_run_cell)
        self.ip.events.register("post_run_cell", self.post_run_cell)
        self._install_error_handler()
        self._import_hooks.append(after_import("torch", self.on_torch_imported))
        if self.env.has_lease and self.limit is not None:
            self._import_hooks.append(after_import("tensorflow", self.on_tensorflow_imported))
        if self.env.restore:
            restoring.restore_at_start(self)
        elif self.env.checkpoint_dir_stable:
            # A kernel started afresh (or restarted by its user) holds nothing: that empty
            # namespace is now the last good state, not whatever an earlier process saved.
            self._checkpoint_quietly()
            self._write_cells(running=None)
        if self.env.has_lease and self.env.lease_id:
            try:
                client = make_client(self.env.agent_socket)
            except Exception as exc:  # the agent package missing must not break the kernel
                log.warning("gpufrac: no agent client: %s", exc)
            else:
                self.watcher = DirectiveWatcher(
                    client, self.env.lease_id, self.handle_directive,
                    usage=torch_adapter.reserved_bytes, poll_timeout=self.poll_timeout,
                    started=self.started, wake=self._wake_receiver(),
                )
                self.watcher.start()

    def _wake_receiver(self) -> WakeReceiver | None:
        """The socket the server wakes this kernel's directive thread on, or None (then the
        thread long-polls the agent itself)."""
        if not self.env.checkpoint_dir_given:
            return None  # no launcher knows this folder, so none would wake the thread
        try:
            return WakeReceiver(wake_path(self.env.checkpoint_dir))
        except OSError as exc:
            log.warning("gpufrac: no wake socket in %s (%s); polling the agent instead",
                        self.env.checkpoint_dir, exc)
            return None

    def stop(self) -> None:
        """Undo :meth:`start` (``%unload_ext``)."""
        for event, callback in (("pre_execute", self.pre_execute),
                                ("pre_run_cell", self.pre_run_cell),
                                ("post_run_cell", self.post_run_cell)):
            with contextlib.suppress(ValueError):
                self.ip.events.unregister(event, callback)
        for off in self._import_hooks:
            off()
        if self.env.has_lease or self.torch_seen:
            self.ip.set_custom_exc((), None)
        if self.watcher is not None:
            self.watcher.stop()
        with contextlib.suppress(ValueError):
            self.ip.input_transformers_post.remove(self._unpark_before_cell)
        server_channel.unregister(self)
        atexit.unregister(self.flush_checkpoints)
        self.flush_checkpoints()

    # -- torch -------------------------------------------------------------------------------

    def on_torch_imported(self, torch: types.ModuleType) -> None:
        """Cap the allocator and explain OOMs from now on."""
        with self._lock:
            if self.torch_seen:
                return
            self.torch_seen = True
        self._install_error_handler()
        self.apply_cap()

    def _install_error_handler(self) -> None:
        """Explain, before the traceback, a cell cut off by a move (with a lease) and a GPU
        memory failure (once torch is imported)."""
        kinds: tuple[type[BaseException], ...] = (KeyboardInterrupt,) if self.env.has_lease else ()
        if self.torch_seen and torch_adapter.oom_exception_types():
            kinds += tuple(torch_adapter.gpu_error_types())
        if kinds:
            self.ip.set_custom_exc(kinds, cell_errors.error_handler(self))

    def on_tensorflow_imported(self, tensorflow: types.ModuleType) -> None:
        """Cap TensorFlow at the limit (less the context) before it touches a GPU."""
        if self.limit is not None:
            self.tensorflow_capped = frameworks.cap_tensorflow(
                tensorflow, max(0, self.limit - self.env.context))

    def apply_cap(self) -> None:
        """Cap PyTorch at the limit, or at the request while memory is being reclaimed.

        A share counts the process's CUDA context, as NVML does; the allocator gets the rest.
        """
        target = self.request if self.state.shrinking else self.limit
        if target is None:
            return
        target = max(0, target - self.env.context)
        if torch_adapter.set_memory_cap(target, self.env.gpu_total or None) is not None:
            self.cap = target

    # -- directives (agent thread) -----------------------------------------------------------

    def handle_directive(self, directive: Mapping[str, Any]) -> None:
        """Apply a directive now; shrink is safe even while a cell runs."""
        with self._lock:
            actions = ladder.on_directive(self.state, directive)
        for action in actions:
            if action is ladder.Action.EMPTY_CACHE:
                torch_adapter.empty_cache()
            elif action is ladder.Action.CAP_REQUEST:
                self.apply_cap()
            elif action is ladder.Action.FROZEN:
                parking.on_frozen(self)
            elif action is ladder.Action.THAWED:
                parking.on_thawed(self, directive)
            elif action is ladder.Action.MOVED:
                target = directive.get("gpus") or [directive.get("to_gpu")]
                with contextlib.suppress(Exception):  # the labels; the process runs there
                    parking.take_gpu(self, make_client(self.env.agent_socket), {},
                                   [str(u) for u in target if u])

    # -- cells -------------------------------------------------------------------------------

    def pre_execute(self) -> None:
        """Before any code runs (silent requests too): finish what the restore began."""
        if self._restored_names:
            hidden = getattr(self.ip, "user_ns_hidden", None)
            ns = self.ip.user_ns
            for name in self._restored_names:
                if hidden is not None and name in hidden and hidden[name] is ns.get(name):
                    del hidden[name]
            self._restored_names = []
        self._settle_rng()

    def _settle_rng(self) -> None:
        """Put back the generators a restore loaded, once, before the notebook's first code or
        the first checkpoint (the server may ask for one before any cell): kernel start-up may
        have drawn from them since the load, and the notebook continues from the state the
        checkpoint holds, as an unmoved kernel would."""
        if self._rng_after_restore is not None:
            state, self._rng_after_restore = self._rng_after_restore, None
            try:
                rng.restore(state)
            except Exception:
                log.warning("gpufrac: restoring the random generators failed", exc_info=True)

    def tell_news(self) -> None:
        """Say, once, what happened to this kernel since the last cell (a restore, a move, a
        freeze, a park, a thaw), however long ago: the user may have been away."""
        with self._lock:
            lines = []
            if self._restore_untold:
                self._restore_untold = False
                lines.append(self.restore_text())
            if self._resume_untold and self.env.resumable is not None:
                self._resume_untold = False
                lines.append(messages.resume_hint(self.env.resumable))
            lines += self.state.notices
            self.state.notices.clear()
        if lines:
            print("\n".join(lines), flush=True)

    def pre_run_cell(self, info: Any = None) -> None:
        """Show what happened since the last cell; note which cell runs, in case it is cut off."""
        self._in_cell = True
        self.checkpointer.writer.cell(running=True)
        with contextlib.suppress(Exception):
            self._tell_checkpoint_failure()
        raw = str(getattr(info, "raw_cell", "") or "")
        if not ((self.parked or self.frozen) and parking.ONLY_PARK.match(raw)):
            # A `%gpu park` of a kernel without a GPU leaves the news for the cell that
            # takes one back.
            self.tell_news()
        if info is not None and getattr(info, "store_history", False):
            count = getattr(self.ip, "execution_count", None)
            # IPython counts the cell before pre_run_cell: the running one is one less.
            number = count - 1 if isinstance(count, int) and count > 0 else None
            parsed = str(getattr(info, "transformed_cell", None) or raw)
            self._running = {"execution_count": number, "time": time.time(),
                             "cell": cell_label(number, raw)}
            self._running_source = (parsed.rstrip("\n"), raw.rstrip("\n"))
            self._write_cells(running=self._running)

    def post_run_cell(self, result: Any = None) -> None:
        """Between cells: offload while over the request, then the last good checkpoint."""
        try:
            self._post_run_cell(result)
        except Exception:  # a bookkeeping failure must never turn a cell into an error
            log.exception("gpufrac: post_run_cell failed")
        finally:
            self._in_cell = False
            self.checkpointer.writer.cell(running=False)

    def _post_run_cell(self, result: Any) -> None:
        if not self.torch_seen and torch_adapter.torch_module() is not None:
            self.on_torch_imported(torch_adapter.torch_module())  # type: ignore[arg-type]
        self._running = None
        error = getattr(result, "error_in_exec", None)
        if isinstance(error, NameError) and any(
            error.name in g["names"] for g in self.checkpointer.deferred
        ):
            print(f"gpufrac: {error.name} was kept on disk at the last restore (there was no "
                  f"room on the GPU for it): `%gpu restore {error.name}` loads it.",
                  file=sys.stderr, flush=True)
        # Said by the exception handler, before the traceback (_error_handler).
        cut_off = self._cut_off_by_move(result)
        if self.env.has_lease and self.state.shrinking:
            self._maybe_end_shrink()
        usage = torch_adapter.reserved_bytes() if self.env.has_lease else None
        with self._lock:
            allocator_request = (None if self.request is None
                                 else max(0, self.request - self.env.context))
            actions = ladder.after_cell(self.state, usage=usage, request=allocator_request,
                                        cut_off=cut_off)
        for action in actions:
            if action is ladder.Action.OFFLOAD:
                self.release(cache_only=False, reason="shrink")
            elif action is ladder.Action.EMPTY_CACHE:
                torch_adapter.empty_cache()
            elif action is ladder.Action.CHECKPOINT:
                self._checkpoint_quietly()
        if not cut_off:
            self._write_cells(running=None)
        # else cells.json keeps saying what pre_run_cell wrote: the names before the cell, and
        # the cell as running, so the restored kernel names it and loses none of its names.

    def _cut_off_by_move(self, result: Any) -> bool:
        """Whether the cell ended in the interrupt the server sends a busy kernel that must move."""
        error = getattr(result, "error_in_exec", None)
        return isinstance(error, KeyboardInterrupt) and self.moving()

    def moving(self) -> bool:
        """Whether the agent is moving this kernel (an interrupt now is the server's)."""
        if not self.env.has_lease:
            return False
        if self.state.moving:
            return True
        lease = self.lease_info(timeout=1.0)
        return lease is not None and lease.get("state") == "migrating"

    def _maybe_end_shrink(self) -> None:
        # The agent sends no directive when a reclaim ends; its lease goes back to "active".
        if self.watcher is None or self.watcher.available is False:
            return
        lease = self.lease_info(timeout=1.0)
        if lease is None or lease.get("state") != "active":
            return
        with self._lock:
            self.state.shrinking = False
            self.state.notices.append(
                "gpufrac: the other notebook no longer needs the memory lent to this kernel; it "
                "may burst to its limit again" + ("; `%gpu reload` brings offloaded tensors back."
                                                 if self.offloaded else ".")
            )
        self.apply_cap()

    def _checkpoint_quietly(self) -> None:
        """The automatic checkpoint, in the background: the cell's reply is not held for it.
        The snapshot is taken now (what changed, copied) and a writer thread writes it; while
        the writer is still busy with the one before, it is owed instead and taken as soon as
        the writer is done, between cells. A failure is said once per distinct error, never
        raised."""
        if not self.env.checkpoint_dir_stable:
            return
        self._tell_checkpoint_failure()
        checkpointer = self.checkpointer
        if checkpointer.owe_if_busy(self._execution_count(), self._snapshot_quietly):
            loop = getattr(getattr(self.ip, "kernel", None), "io_loop", None)
            if loop is not None and not checkpointer.writer.when_idle(
                    lambda: loop.add_callback(self._take_owed)):
                checkpointer.take_owed()  # the writer was done in between
            return
        self._snapshot_quietly()

    def _snapshot_quietly(self) -> None:
        try:
            job = self.checkpointer.begin(
                self.ip.user_ns, hidden=self._hidden(), execution_count=self._execution_count(),
                extra=self._checkpoint_extra())
        except CheckpointError as exc:
            self._checkpoint_failed(str(exc))
            return
        result = job.result
        if self.observations is not None:
            self.observations.checkpoint(
                "cell", result.tensors_bytes + result.buffers_bytes,
                result.bytes_written + result.group_bytes_written, result.seconds)

    def _take_owed(self) -> None:
        """Take the snapshot owed since a cell's end (on the kernel's own thread, between
        messages), unless a cell runs (one awaiting something lets the loop run): its end
        takes one anyway."""
        if not self._in_cell:
            self.checkpointer.take_owed()

    def _tell_checkpoint_failure(self) -> None:
        """Say, once, that a checkpoint written in the background failed (and which cell the
        last good one reflects); say once too when they are written again."""
        error = self.checkpointer.writer.error
        if error is not None:
            self._checkpoint_failed(error)
        elif self.checkpoint_error is not None and self.checkpointer.writer.durable is not None \
                and not self.checkpointer.writer.busy():
            self.checkpoint_error = None

    def _checkpoint_failed(self, error: str) -> None:
        if self.checkpoint_error == error:
            return
        self.checkpoint_error = error
        status = self.checkpointer.status()
        cell = status.get("durable_cell")
        kept = (f" The last good checkpoint (after cell [{cell}]) is kept; a restart restores it."
                if cell is not None else "")
        print(f"gpufrac: automatic checkpoint failed: {error}.{kept}", file=sys.stderr, flush=True)

    def _checkpoint_extra(self) -> dict[str, Any]:
        return {"kernel_id": self.env.kernel_id,
                "offloaded": [asdict(r) for r in self.offloaded],
                "notebook": self.notebook()}

    def notebook(self) -> dict[str, str] | None:
        """The notebook this kernel serves (user, folder, path), as the server's record in the
        kernel's folder says (None where no launcher made that folder)."""
        return self._served.notebook() if self.env.checkpoint_dir_given else None

    def flush_checkpoints(self, timeout: float = EXIT_FLUSH_S) -> None:
        """Wait, at most ``timeout`` seconds, for the checkpoint being written and the owed one
        (kernel exit): one not written by then is said to be lost, and which cell a restart
        restores."""
        checkpointer = self.checkpointer
        if checkpointer.flush(timeout):
            return
        status = checkpointer.status()
        lost = status.get("owed_cell") if checkpointer.owed_since is not None else (
            (status.get("writing") or {}).get("cell"))
        print(f"gpufrac: the checkpoint after cell [{lost}] was still being written "
              f"when the kernel stopped and is lost; a restart restores the one after cell "
              f"[{status.get('durable_cell')}].", file=sys.stderr, flush=True)

    def _execution_count(self) -> int | None:
        count = getattr(self.ip, "execution_count", None)
        # IPython increments the counter after a stored cell; the one that just ran is one less.
        return count - 1 if isinstance(count, int) and count > 0 else None

    def _hidden(self) -> Mapping[str, object] | None:
        """IPython's hidden names, less the ones this kernel restored (those are the user's)."""
        hidden = getattr(self.ip, "user_ns_hidden", None)
        if hidden is None or not self._restored_names:
            return hidden
        ns = self.ip.user_ns
        return {k: v for k, v in hidden.items()
                if not (k in self._restored_names and v is ns.get(k))}

    def _write_cells(self, *, running: dict[str, Any] | None) -> None:
        # Names alone, without values: after a kill we can still say what the checkpoint missed,
        # and which cell was running when the process went away.
        if self.env.checkpoints_off:
            return  # nothing goes into a folder that is not the user's alone
        selection = namespace.select(self.ip.user_ns, self._hidden())
        data = {"execution_count": self._execution_count(), "time": time.time(),
                "names": sorted([*selection.values, *selection.modules]), "running": running,
                **history.record(self.ip, self._running_source if running else None,
                                 selection.values)}
        # Our own small files go only into a directory that is ours alone (created if needed).
        try:
            store.write_file(self.env.checkpoint_dir, store.CELLS_FILE, json.dumps(data).encode(),
                             durable=False)
        except (OSError, store.UnsafeCheckpointError):
            log.debug("gpufrac: writing %s failed", self._cells_path, exc_info=True)

    def _read_previous_cells(self) -> dict[str, Any]:
        try:
            data = json.loads(store.read_file(self.env.checkpoint_dir, store.CELLS_FILE))
        except (OSError, ValueError, store.UnsafeCheckpointError):
            return {}
        return data if isinstance(data, dict) else {}

    # -- checkpoint and restore --------------------------------------------------------------

    def checkpoint(self, *, full: bool = False, trigger: str = "manual") -> CheckpointResult:
        """Checkpoint the notebook namespace now (raises CheckpointError for people);
        ``trigger`` says why, for the agent's metrics: cell, server, park or manual."""
        if self.env.checkpoints_off:
            raise CheckpointError(f"checkpoints are off for this kernel: {self.env.checkpoints_off}")
        self._settle_rng()
        extra = self._checkpoint_extra()
        # Durable when it returns (the server restarts the kernel from it): a snapshot still
        # being written is superseded by this one, or written first.
        result = self.checkpointer.take(
            self.ip.user_ns, hidden=self._hidden(), full=full,
            execution_count=self._execution_count(), extra=extra,
        )
        if self.observations is not None:
            self.observations.checkpoint(
                trigger, result.tensors_bytes + result.buffers_bytes,
                result.bytes_written + result.group_bytes_written, result.seconds)
        return result

    def restore(self, reason: kenv.RestartReason | None, *, at_start: bool) -> dict[str, Any]:
        """Restore the last good checkpoint into the namespace; returns the report."""
        return restoring.restore(self, reason, at_start=at_start)

    def restore_text(self, now: float | None = None) -> str:
        """The last restore for people, its ages counted to ``now`` (when it is shown)."""
        return restoring.restore_text(self, now)

    def restore_deferred(self, names: list[str]) -> tuple[list[str], dict[str, str]]:
        """Load variables a restore kept on disk (``names``, or all); (loaded, lost)."""
        return restoring.restore_deferred(self, names)

    def resume(self) -> dict[str, Any]:
        """``%gpu restore`` in a fresh kernel: take over its notebook's earlier state."""
        return restoring.resume(self)

    # -- memory ------------------------------------------------------------------------------

    def release(self, *, cache_only: bool, reason: str = "manual") -> list[offload.Offloaded]:
        """Empty the allocator cache and (unless ``cache_only``) move GPU tensors to the host;
        ``reason`` (shrink, park or manual) is for the agent's metrics."""
        moved: list[offload.Offloaded] = []
        if not cache_only:
            moved = offload.offload(self.ip.user_ns)
            self.offloaded += moved
            if moved and self.observations is not None:
                self.observations.offload(reason, sum(r.nbytes for r in moved))
        torch_adapter.empty_cache()
        return moved

    def reload(self) -> tuple[list[offload.Offloaded], list[offload.Offloaded], str]:
        """Bring offloaded tensors back while they fit; returns (back, still away, note)."""
        note = ""
        if self.state.shrinking:
            lease = self.lease_info()
            if lease is not None and lease.get("state") == "active":
                with self._lock:
                    self.state.shrinking = False
                self.apply_cap()
                note = "The agent no longer needs the lent memory: the cap is back at the limit."
            else:
                note = ("Memory is still being reclaimed for another notebook: only what fits "
                        "in the request comes back.")
        budget: int | None = None
        reserved = torch_adapter.reserved_bytes()
        if reserved is not None and self.cap is not None:
            free = torch_adapter.free_bytes()
            budget = max(0, self.cap - reserved)
            if free is not None:
                budget = min(budget, free)
        back, left = offload.reload(self.ip.user_ns, self.offloaded, budget)
        self.offloaded = left
        return back, left, note

    # -- parking -----------------------------------------------------------------------------

    def park_for_server(self) -> dict[str, Any]:
        """GPU tensors to host memory, then a checkpoint (see :func:`parking.park_for_server`)."""
        return parking.park_for_server(self)

    def _unpark_before_cell(self, lines: list[str]) -> list[str]:
        """The input transformer a parked or frozen kernel runs before each cell (one bound
        method, so that it can be removed again)."""
        return parking.unpark_before_cell(self, lines)

    def unpark(self) -> None:
        """Get a GPU back before a cell runs (see :func:`parking.unpark`)."""
        parking.unpark(self)

    def cell_started(self) -> float:
        """When the running cell began (now, outside a cell)."""
        running = self._running
        return float(running["time"]) if running else time.time()

    def gpu_label(self) -> str:
        """``GPU 1`` (or its UUID): where this kernel runs, for people."""
        return (f"GPU {self.env.gpu_index}" if self.env.gpu_index is not None
                else self.env.gpu_uuid or "its GPU")

    def gpu_names(self, uuids: list[str]) -> list[str]:
        """``GPU 0`` for each UUID, as the panel names them (a GPU the agent does not list
        keeps its UUID)."""
        index: dict[str, Any] = {}
        with contextlib.suppress(Exception):  # names only
            index = {g.get("uuid"): g.get("index")
                     for g in make_client(self.env.agent_socket, timeout=2.0).node()["gpus"]}
        return [f"GPU {index[u]}" if index.get(u) is not None else u for u in uuids]

    # -- agent -------------------------------------------------------------------------------

    def lease_info(self, timeout: float = AGENT_CALL_TIMEOUT) -> dict[str, Any] | None:
        """This kernel's lease as the agent sees it, or None."""
        if not self.env.lease_id:
            return None
        try:
            client = make_client(self.env.agent_socket, timeout=timeout)
            lease: dict[str, Any] = client.lease(self.env.lease_id)
            return lease
        except Exception:
            return None

    def summary(self) -> dict[str, Any]:
        """Machine-readable state for the server (``user_expressions``) and ``%gpu``."""
        last = self.checkpointer.last
        header = None if last else self.checkpointer.read_header()
        return {
            "lease_id": self.env.lease_id,
            "kernel_id": self.env.kernel_id,
            "has_lease": self.env.has_lease,
            "no_lease_reason": self.env.no_lease_reason(),
            "request": self.request, "limit": self.limit, "cap": self.cap,
            "usage": torch_adapter.reserved_bytes(),
            "shrinking": self.state.shrinking,
            "torch_imported": self.torch_seen,
            "cuda": torch_adapter.cuda_available(),
            "offloaded": [asdict(r) for r in self.offloaded],
            "checkpoint_dir": str(self.env.checkpoint_dir),
            "last_checkpoint": last.to_json() if last else (
                {"time": header.get("time"), "names": header.get("names"),
                 "lost": header.get("lost"), "execution_count": header.get("execution_count")}
                if header else None),
            # The last durable checkpoint (what a restart restores) and the one being written.
            "checkpoint": self.checkpointer.status(),
            "restore": self.restore_report,
            # Why this kernel takes no checkpoints (its folder is not the user's alone).
            "checkpoints_off": self.env.checkpoints_off,
            "agent_available": None if self.watcher is None else self.watcher.available,
            "agent_error": None if self.watcher is None else self.watcher.last_error,
            "pid": os.getpid(),
            "parked": self.parked,
        }

