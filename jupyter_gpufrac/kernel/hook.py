"""The per-kernel controller: caps torch, follows directives, checkpoints, restores, explains."""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import re
import sys
import threading
import time
import types
from collections.abc import Callable, Mapping
from dataclasses import asdict, replace
from typing import Any

import psutil
from IPython.core.error import UsageError

from jupyter_gpufrac import contract
from jupyter_gpufrac.kernel import env as kenv
from jupyter_gpufrac.kernel import (
    frameworks,
    history,
    ladder,
    messages,
    namespace,
    offload,
    rng,
    server_channel,
    store,
    torch_adapter,
)
from jupyter_gpufrac.kernel.budget import DiskLimits
from jupyter_gpufrac.kernel.checkpoint import Checkpointer, CheckpointError, CheckpointResult
from jupyter_gpufrac.kernel.directives import DirectiveWatcher
from jupyter_gpufrac.kernel.disk_shares import SharedDiskLimits
from jupyter_gpufrac.kernel.import_hook import after_import
from jupyter_gpufrac.kernel.observations import ObservationSender
from jupyter_gpufrac.kernel.state_file import header_generation
from jupyter_gpufrac.notebook_record import RECORD, Notebook, adopt, read_record
from jupyter_gpufrac.wake import WakeReceiver, wake_path

log = logging.getLogger(__name__)

AGENT_CALL_TIMEOUT = 5.0
FIRST_LINE_CHARS = 80
# A parked kernel restores into host memory up to this share of what is available; the rest
# stays in the checkpoint (`%gpu restore` loads it).
HOST_ROOM_SHARE = 0.8
# How often a cell waiting for a GPU asks the agent again (seconds, growing to the second).
UNPARK_POLL_FIRST_S = 0.1
UNPARK_POLL_MAX_S = 2.0
# A kernel that exits waits this long for the checkpoint being written (jupyter_client kills a
# kernel that has not exited 5 s after it was asked to shut down).
EXIT_FLUSH_S = 4.0


# A cell that only parks (as IPython has transformed it by then): run on a kernel that holds
# no GPU, it does not take one first.
_ONLY_PARK = re.compile(r"""^\s*(?:%gpu\s+park|get_ipython\(\)\.run_line_magic\(['"]gpu['"],"""
                        r"""\s*['"]park['"]\))\s*$""")


def cell_label(execution_count: int | None, source: str) -> str:
    """``[7] for epoch in range(100):``: how people find a cell again."""
    first = next((line.strip() for line in source.splitlines() if line.strip()), "")
    if len(first) > FIRST_LINE_CHARS:
        first = first[: FIRST_LINE_CHARS - 1] + "…"
    return f"[{execution_count if execution_count is not None else ' '}] {first}".rstrip()


def make_client(socket_path: str | None, timeout: float = AGENT_CALL_TIMEOUT) -> Any:
    """An ``AgentClient``; imported late so the kernel works where the agent package is absent."""
    from node_agent.client import AgentClient

    return AgentClient(socket_path, timeout=timeout)


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
        self._notebook: dict[str, str] | None = None
        self._record_seen: tuple[int, int, int] | None = None
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
            self.restore_at_start()
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
            self.ip.set_custom_exc(kinds, _error_handler(self))

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
                self._on_frozen()
            elif action is ladder.Action.THAWED:
                self._on_thawed(directive)
            elif action is ladder.Action.MOVED:
                target = directive.get("gpus") or [directive.get("to_gpu")]
                with contextlib.suppress(Exception):  # the labels; the process runs there
                    self._take_gpu(make_client(self.env.agent_socket), {},
                                   [str(u) for u in target if u])

    def _on_frozen(self) -> None:
        """The agent froze this process: cells ask for the GPU back before they run. A cell
        that runs now waits in its next CUDA call; it asks for the GPU back at once."""
        with self._lock:
            self.frozen = True
            if self._unpark_before_cell not in self.ip.input_transformers_post:
                self.ip.input_transformers_post.append(self._unpark_before_cell)
            running = self._running is not None
        if running and self.env.lease_id:
            try:
                make_client(self.env.agent_socket).unpark(self.env.lease_id)
            except Exception as exc:  # the next cell asks again
                log.warning("gpufrac: asking to thaw for the running cell failed: %s", exc)

    def _on_thawed(self, directive: Mapping[str, Any]) -> None:
        """The agent thawed this process (room came back): cells run at once again, where
        the agent put it, and the next cell says so unless a cell asked for the thaw (it
        said so itself)."""
        uuids = [str(u) for u in directive.get("gpus") or [directive.get("gpu")] if u]
        try:
            self._take_gpu(make_client(self.env.agent_socket), {}, uuids)
        except Exception:  # the labels only; the process runs there
            with self._lock:
                self.frozen = False
                with contextlib.suppress(ValueError):
                    self.ip.input_transformers_post.remove(self._unpark_before_cell)
        created = directive.get("created")
        at = float(created) if isinstance(created, int | float) else time.time()
        if at <= self._thawed_by_cell_at:
            return
        frozen_s = directive.get("frozen_s")
        with self._lock:
            self.state.notices.append(messages.thawed_news(
                self.gpu_label(), float(frozen_s) if isinstance(frozen_s, int | float) else None,
                at))

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
        if not ((self.parked or self.frozen) and _ONLY_PARK.match(raw)):
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

    def cut_off_text(self) -> str:
        """Why the running cell stopped, said before its traceback."""
        running = self._running or {}
        cell = running.get("cell") or "this cell"
        return (f"gpufrac: cell {cell} was cut off because this kernel is moving to another "
                "GPU and the cell did not end in time. After the move the variables are as "
                "they were before this cell; re-run it then.")

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
        kernel's folder says; read again only when the record changed (a rename)."""
        if not self.env.checkpoint_dir_given:
            return None
        try:
            st = os.stat(self.env.checkpoint_dir / RECORD, follow_symlinks=False)
        except OSError:
            return self._notebook
        seen = (st.st_ino, st.st_mtime_ns, st.st_size)
        if seen != self._record_seen:
            self._record_seen = seen
            found = Notebook.from_json((read_record(self.env.checkpoint_dir) or {}).get("notebook"))
            self._notebook = found.to_json() if found is not None else None
        return self._notebook

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
        """Restore the last good checkpoint into the namespace; returns the report.

        ``ok`` in the report is true only when every variable came back and no cell was cut
        off: the server and the widget claim success on nothing less.
        """
        load_started = time.monotonic()
        previous = self._previous_cells if at_start else {}
        running = previous.get("running")
        interrupted = str(running.get("cell")) if isinstance(running, dict) else None
        report: dict[str, Any] = {
            "time": time.time(), "kernel_id": self.env.kernel_id, "pid": os.getpid(),
            "cause": reason.cause if reason else "manual",
            "reason": asdict(reason) if reason else None,
            "restored": [], "lost": [], "lost_reasons": {}, "newer_names": [], "deferred": {},
            "room": None,
            "interrupted_cell": interrupted,
            "checkpoint_time": None, "checkpoint_cell": None, "moved_to_cpu_bytes": 0,
            "ok": False, "error": None,
        }
        room = self._room() if at_start else None
        # The simulated node counts a kernel's whole memory; a GPU counts its device memory.
        measure = "bytes" if self.env.simulated else "gpu_bytes"
        if self.parked:
            # Everything lands in host memory (the park moved GPU tensors there first).
            room, measure = int(psutil.virtual_memory().available * HOST_ROOM_SHARE), "bytes"
        cpu_fallback = False
        # The newest generation known before loading: the server's, or this process's own.
        newest = max(self.env.checkpoint_generation, self.checkpointer.generation)
        try:
            if self.env.checkpoints_off:
                raise CheckpointError(f"checkpoints are off for this kernel: "
                                      f"{self.env.checkpoints_off}")
            try:
                loaded = self.checkpointer.load(self.ip.user_ns, budget=room, measure=measure)
            except CheckpointError as exc:
                oom = torch_adapter.oom_exception_types()
                if not (oom and isinstance(exc.__cause__, oom)):
                    raise
                # The GPU tensors do not fit under the cap (or the GPU is busy): the variables
                # matter more than where they live, so load them into host memory instead.
                torch_adapter.empty_cache()
                loaded = self.checkpointer.load(self.ip.user_ns, device="cpu", budget=room,
                                                measure=measure)
                cpu_fallback = True
        except CheckpointError as exc:
            report["error"] = str(exc)
        else:
            known = set(loaded.restored) | set(loaded.lost) | set(loaded.modules) | set(
                loaded.deferred)
            newer = sorted(set(previous.get("names", [])) - known)
            began = running.get("execution_count") if isinstance(running, dict) else None
            # A cut-off cell did not run: the last that ran is the one before it.
            last_cell = began - 1 if isinstance(began, int) else previous.get("execution_count")
            self._readopt_offloaded(loaded.header.get("offloaded", []))
            self._restored_names = [*loaded.restored, *loaded.modules]
            self._rng_after_restore = loaded.rng_state or None
            report.update(
                restored=loaded.restored + loaded.modules, lost=sorted(loaded.lost),
                lost_reasons=loaded.lost, newer_names=newer,
                checkpoint_time=loaded.checkpoint_time, checkpoint_cell=loaded.execution_count,
                moved_to_cpu_bytes=loaded.moved_to_cpu_bytes, rng=loaded.rng,
                deferred=loaded.deferred, room=room,
                # Cells that ran after the checkpoint (its write failed, or had not ended)
                # lost their effects, whatever names came back.
                ok=(not loaded.lost and not newer and interrupted is None and not loaded.deferred
                    and not _ran_after(last_cell, loaded.execution_count)),
                last_cell=last_cell if isinstance(last_cell, int) else None,
                cpu_reason=("they did not fit in this kernel's GPU memory limit"
                            if cpu_fallback else "this kernel has no CUDA device"),
            )
            found = header_generation(loaded.header)
            report["generation"] = found
            if newest and found < newest:
                # Loaded, but never as if it were the latest: its folder was replaced or
                # renamed (by someone who can write above it), or restored from a backup.
                older = (f"this checkpoint is older than the newest one recorded for it "
                         f"(generation {found} < {newest}): its folder was replaced or renamed "
                         f"since, so these variables are as they were then, not as after your "
                         f"last cells")
                log.warning("gpufrac: %s", older)
                report.update(older=older, ok=False)
        self._restore_reason = reason
        report["seconds"] = time.monotonic() - load_started
        self.restore_report = report  # the server asks for it (server_channel)
        report["message"] = self.restore_text(report["time"])
        return report

    def restore_text(self, now: float | None = None) -> str:
        """The last restore for people, its ages counted to ``now`` (when it is shown)."""
        r = self.restore_report
        if r is None:
            return ""
        text = messages.restore_message(
            self._restore_reason, restored=r["restored"], lost=r["lost_reasons"],
            checkpoint_time=r["checkpoint_time"], checkpoint_cell=r["checkpoint_cell"],
            last_cell=r.get("last_cell"), newer_names=r["newer_names"],
            moved_to_cpu_bytes=r["moved_to_cpu_bytes"], interrupted_cell=r["interrupted_cell"],
            error=r["error"], deferred=r["deferred"], room=r["room"], now=now,
            **({"cpu_reason": r["cpu_reason"]} if r.get("cpu_reason") else {}))
        return f"Warning: {r['older']}.\n{text}" if r.get("older") else text

    def _room(self) -> int | None:
        """What this kernel may load without setting off a reclaim (None: no limit known).

        A kernel stopped to give loaned memory back that loads all of it again would only be
        stopped again: what does not fit waits on disk.
        """
        lease = self.lease_info(timeout=2.0)
        room = lease.get("room") if lease else None
        return int(room) if isinstance(room, int) else None

    def restore_deferred(self, names: list[str]) -> tuple[list[str], dict[str, str]]:
        """Load variables a restore kept on disk (``names``, or all); (loaded, lost)."""
        restored, lost = self.checkpointer.load_deferred(self.ip.user_ns, names)
        self._restored_names += restored
        return restored, lost

    def resume(self) -> dict[str, Any]:
        """``%gpu restore`` in a fresh kernel: take over the state its notebook's earlier kernel
        left (the server offered it) as a kernel resumed at start does: its folder becomes this
        kernel's, then variables, generators and cell numbers come back. Raises
        CheckpointError when it cannot be taken over (nothing changed then)."""
        offer = self.env.resumable
        if offer is None:
            raise CheckpointError("no earlier state of this notebook waits to be taken over")
        self.flush_checkpoints()
        folder = self.env.checkpoint_dir
        try:
            adopt(folder.parent, offer.folder, folder.name, (contract.WAKE_SOCKET,))
        except (OSError, store.UnsafeCheckpointError) as exc:
            raise CheckpointError(f"the earlier state in {folder.parent / offer.folder} could "
                                  f"not be taken over ({exc})") from None
        self.env = replace(self.env, resumable=None)
        self.checkpointer = self._make_checkpointer(
            max(offer.generation, self.checkpointer.generation))
        self._previous_cells = self._read_previous_cells()
        report = self.restore(offer.reason, at_start=True)
        last = history.last_number(self._previous_cells, report.get("checkpoint_cell"))
        if last is not None:
            history.continue_after(self.ip, self._previous_cells, last, set(report["restored"]),
                                   running=True)
        return report

    def restore_at_start(self) -> None:
        """GPUFRAC_RESTORE: bring the variables back and keep the message for the first cell."""
        report = self.restore(self.env.restart_reason, at_start=True)
        # The notebook's cell numbers go on from the old process's (its In/Out with them).
        last = history.last_number(self._previous_cells, report.get("checkpoint_cell"))
        if last is not None:
            history.continue_after(self.ip, self._previous_cells, last, set(report["restored"]))
        # Output at load time reaches the kernel's log, not a cell: tell it with the first cell.
        print(report["message"], flush=True)
        self._restore_untold = True
        # The restored state is the last good one from now on; the cut-off cell is reported once.
        self._write_cells(running=None)

    def _readopt_offloaded(self, records: list[Any]) -> None:
        ns = self.ip.user_ns
        adopted = []
        for raw in records:
            if isinstance(raw, dict) and raw.get("name") in ns:
                value = ns[raw["name"]]
                adopted.append(offload.Offloaded(raw["name"], raw.get("kind", "tensor"),
                                                 raw.get("device", "cuda"),
                                                 int(raw.get("nbytes", 0)), id(value)))
        self.offloaded = adopted

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
        """The server parks this kernel next: GPU tensors go to host memory, then a checkpoint
        records them and where they were (raises CheckpointError; then nothing stays moved)."""
        allocated = torch_adapter.allocated_bytes() or 0
        available = int(psutil.virtual_memory().available)
        if allocated > available * HOST_ROOM_SHARE:
            raise CheckpointError(
                f"its GPU tensors ({messages.fmt_bytes(allocated)}) do not fit in the host memory "
                f"available ({messages.fmt_bytes(available)}), so it keeps its GPU")
        moved = self.release(cache_only=False, reason="park")
        try:
            result = self.checkpoint(trigger="park")
        except BaseException:
            self.offloaded = [r for r in self.offloaded if r not in moved]
            offload.reload(self.ip.user_ns, moved, None)
            raise
        return {"checkpoint": result.to_json(),
                "offloaded_bytes": sum(r.nbytes for r in moved)}

    def _unpark_before_cell(self, lines: list[str]) -> list[str]:
        """An input transformer: IPython runs it before the cell, and what it raises stops the
        cell from running (the error is the cell's output)."""
        if not self.parked and not self.frozen:
            return lines
        if _ONLY_PARK.match("".join(lines)):
            return lines  # `%gpu park` of a kernel that holds no GPU: nothing to take back
        parent = getattr(self.ip, "parent_header", None)
        parent = parent if isinstance(parent, dict) else {}
        if (parent.get("content") or {}).get("silent"):
            return lines
        # ipykernel may transform one cell twice: a wait given up on is not begun again.
        msg_id = str((parent.get("header") or {}).get("msg_id") or "")
        if self._unpark_refused is not None and self._unpark_refused[0] == msg_id:
            raise UsageError(self._unpark_refused[1])
        try:
            self.unpark()
        except UsageError as exc:
            self._unpark_refused = (msg_id, str(exc))
            raise
        return lines

    def unpark(self) -> None:
        """Get a GPU back (waiting, interruptibly, while none has room), let CUDA see it, and
        move the parked tensors back; raises UsageError when the cell must not run."""
        started = time.monotonic()
        lease_id = self.env.lease_id
        if not lease_id:
            return
        # Read once: the thaw's notice may reach the directive thread before this returns.
        frozen = self.frozen and not self.parked
        frozen_at = self.state.frozen_at
        # Why it has no GPU comes first (a freeze or park told at this cell, however late).
        self.tell_news()
        client = make_client(self.env.agent_socket)
        try:
            lease = client.unpark(lease_id)
            delay, told = UNPARK_POLL_FIRST_S, False
            while lease.get("state") != "active":
                if not told and lease.get("state") != "thawing":
                    print(messages.waiting_for_gpu(lease.get("reason"), frozen), flush=True)
                    told = True
                time.sleep(delay)
                delay = min(delay * 1.5, UNPARK_POLL_MAX_S)
                lease = client.lease(lease_id)
        except KeyboardInterrupt:
            with contextlib.suppress(Exception):  # parked again, or it would take a GPU unseen
                client.park(lease_id)
            raise UsageError("gpufrac: stopped waiting for a GPU; the cell did not run and the "
                             "kernel stays parked. Run a cell to wait again.") from None
        except Exception as exc:  # the agent refused or went away: nothing changed here
            raise UsageError(f"gpufrac: this kernel is parked and could not get a GPU back: "
                             f"{exc}. The cell did not run; run it again, or see `%gpu`.") from None
        uuids = [str(u) for u in lease.get("physical_gpus") or []]
        if frozen:
            # Thawed: CUDA, its memory and every object were kept; nothing to move back.
            self._thawed_by_cell_at = time.time()
            self._take_gpu(client, lease, uuids)
            print(messages.thawed(self.gpu_label(), time.monotonic() - started,
                                  None if frozen_at is None else time.time() - frozen_at),
                  flush=True)
            return
        if not torch_adapter.attach_cuda(",".join(uuids)):
            raise UsageError(
                "gpufrac: CUDA was initialised in this kernel while it was parked (by code sent "
                "outside a cell), so it cannot see the GPU it got back. Restart the kernel.")
        self._take_gpu(client, lease, uuids)
        back, left, _ = self.reload()
        print(messages.unparked(self.gpu_label(), time.monotonic() - started,
                                [r.name for r in back], sum(r.nbytes for r in back),
                                [r.name for r in left]), flush=True)

    def _take_gpu(self, client: Any, lease: Mapping[str, Any], uuids: list[str]) -> None:
        """Where the kernel runs from now on, as the agent placed it."""
        gpu: dict[str, Any] = {}
        with contextlib.suppress(Exception):  # the labels only; the GPU is the lease's
            gpu = next((g for g in client.node().get("gpus", []) if g.get("uuid") in uuids), {})
        self.env = replace(
            self.env, parked=False, gpu_uuid=uuids[0] if uuids else None,
            gpu_index=gpu.get("index"), gpu_name=gpu.get("name"),
            gpu_total=gpu.get("memory_total"), context=int(gpu.get("context_size") or 0))
        self.parked = self.frozen = False
        with contextlib.suppress(ValueError):
            self.ip.input_transformers_post.remove(self._unpark_before_cell)
        self.apply_cap()

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

    def oom_explanation(self, error: BaseException, source: str) -> str:
        """What a GPU memory failure means for this kernel: whose memory ran out, and why."""
        reserved = torch_adapter.reserved_bytes()
        shares: list[dict[str, Any]] = []
        if self.env.has_lease:
            with contextlib.suppress(Exception):  # the explanation must come, agent or not
                node = make_client(self.env.agent_socket, timeout=2.0).node()
                gpus: list[dict[str, Any]] = node.get("gpus", [])
                gpu = next((g for g in gpus if g.get("uuid") == self.env.gpu_uuid), {})
                shares = list(gpu.get("shares", []))
        cause = messages.oom_cause(
            wanted=messages.oom_wanted(error), reserved=reserved, cap=self.cap,
            gpu_free=torch_adapter.free_bytes(), shares=shares, own_lease=self.env.lease_id,
        )
        return messages.oom_explanation(
            request=self.request, limit=self.limit,
            total=self.env.gpu_total or torch_adapter.device_total(),
            reserved=reserved, allocated=torch_adapter.allocated_bytes(), cap=self.cap,
            shrunk=self.state.shrinking, has_lease=self.env.has_lease, source=source,
            cause=cause,
        )

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


def _error_handler(hook: GpuFracHook) -> Any:
    """A ``set_custom_exc`` handler: the usual traceback, after what a cut-off cell means and
    before what a GPU memory failure means here (other errors of the same classes are shown
    as IPython would)."""

    def handler(shell: Any, etype: type, value: BaseException, tb: Any,
                tb_offset: int | None = None) -> None:
        stb: list[str] = shell.InteractiveTB.structured_traceback(
            etype, value, tb, tb_offset=tb_offset
        )
        if isinstance(value, KeyboardInterrupt):
            # The user reads why first; the traceback only says where the cell was.
            if hook.moving():
                stb = [hook.cut_off_text(), *stb]
            extra: list[str] = []
        else:
            source = messages.oom_source(value)
            extra = [] if source is None else [hook.oom_explanation(value, source)]
        # IPython ignores what a custom handler returns; _showtraceback is what showtraceback
        # ends with, and ipykernel turns it into the cell's error output and the reply.
        show = getattr(shell, "_showtraceback", None)
        if show is not None:
            show(etype, value, [*stb, *extra])
        else:
            print(shell.InteractiveTB.stb2text(stb), file=sys.stderr)
            print(*extra, file=sys.stderr)

    return handler


def _ran_after(last_cell: object, checkpoint_cell: object) -> bool:
    """Whether cell ``last_cell`` ran after the checkpoint taken after ``checkpoint_cell``."""
    return (isinstance(last_cell, int) and isinstance(checkpoint_cell, int)
            and 0 < checkpoint_cell < last_cell)
