"""Take and load incremental namespace checkpoints in a private directory."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from jupyter_gpufrac.kernel import restore, store
from jupyter_gpufrac.kernel.restore import LoadResult
from jupyter_gpufrac.kernel.snapshot import CheckpointResult, Snapshots, collector_paused
from jupyter_gpufrac.kernel.state_file import CheckpointError, current_header, header_generation
from jupyter_gpufrac.kernel.writer import WriteError

# What callers of a checkpoint meet besides the Checkpointer: its errors and results.
__all__ = ["CheckpointError", "CheckpointResult", "Checkpointer", "LoadResult"]


class Checkpointer(Snapshots):
    """Checkpoints one namespace into one directory, writing only what changed: snapshots taken
    (:class:`Snapshots`), written in the background (:class:`writer.Writer`), and restored
    (:mod:`restore`)."""

    def take(
        self,
        ns: dict[str, Any],
        *,
        hidden: Mapping[str, object] | None = None,
        full: bool = False,
        execution_count: int | None = None,
        extra: Mapping[str, Any] | None = None,
    ) -> CheckpointResult:
        """Checkpoint ``ns`` (the notebook's globals) and return once it is durable; unpicklable
        variables are listed, not fatal.

        Only variables whose fingerprint changed are pickled again; ``full`` re-pickles and
        re-writes everything (after writes no fingerprint sees, see :mod:`blobs`).
        """
        started = time.monotonic()
        with self.writer.hurry():
            # One snapshot's copies at a time (see Snapshots): the one being written goes first.
            self.writer.flush()
            job = self.begin(ns, hidden=hidden, full=full, execution_count=execution_count,
                             extra=extra)
            try:
                written = job.wait()
            except WriteError as exc:
                raise CheckpointError(str(exc)) from exc
        result = dataclasses.replace(job.result, seconds=time.monotonic() - started,
                                     durable=True)
        if written is not job:  # superseded: the snapshot written is a later one
            result = dataclasses.replace(written.result, seconds=result.seconds, durable=True)
        return result

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every snapshot taken is written (or failed), and in the notebook's thread
        take the owed one first and wait for it too: the namespace as it is is then on disk, or
        the failure said. False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self.writer.hurry():
            if self._owed is not None and threading.current_thread() is threading.main_thread():
                if not self.writer.flush(timeout):
                    return False
                self.take_owed()
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            return self.writer.flush(left)

    def status(self) -> dict[str, Any]:
        """The last durable checkpoint (its cell and time) and the one being written, if any,
        with its progress: what a restore now would load, and what is on its way."""
        durable = self.writer.durable
        cell: int | None
        when: float | None
        generation: int | None
        if durable is not None:
            cell, when = durable.cell, durable.time
            generation = getattr(durable.result, "generation", None)
        else:
            header = self.read_header()
            cell = header.get("execution_count") if header else None
            when = header.get("time") if header else None
            generation = header_generation(header) if header else None
        # What the newest snapshot left out (a restore lacks them once it is written); before
        # any in this process, what the committed one left out.
        newest = self.taken or self.last
        if newest is not None:
            unprotected, why = newest.unprotected, newest.unprotected_why
        else:
            found = self.read_header() or {}
            unprotected, why = dict(found.get("unprotected") or {}), found.get("unprotected_why")
        return {"durable_cell": cell, "durable_time": when, "writing": self.writer.writing(),
                "owed_cell": self.owed, "error": self.writer.error,
                "durable_generation": generation, "unprotected": unprotected,
                "unprotected_why": why}

    def wait_for_cleanup(self) -> None:
        """Wait until every snapshot taken is written and the blobs it replaced are deleted."""
        self.writer.flush()

    def load(
        self, ns: dict[str, Any], *, device: str | None = None, budget: int | None = None,
        measure: str = "gpu_bytes",
    ) -> LoadResult:
        """Restore the committed checkpoint into ``ns``; tensors from a GPU land on ``device``
        (by default the kernel's CUDA device, asked once torch is loaded, else the CPU).

        With a ``budget`` (bytes, counted by each group's ``measure``: ``gpu_bytes`` or
        ``bytes``), the largest variables are left on disk until the rest fits; they are
        named in ``deferred`` and :meth:`load_deferred` brings them back.
        """
        self.flush()  # what is on disk must not change while it is read
        with self._lock, restore.open_folder(self.root) as folder, collector_paused():
            return restore.load(self, folder, ns, device, budget, measure)

    def load_deferred(
        self, ns: dict[str, Any], names: Sequence[str] = (), *, device: str | None = None
    ) -> tuple[list[str], dict[str, str]]:
        """Load deferred variables (those named, or all): (restored names, lost with why).

        A name bound anew since the restore keeps its new value.
        """
        with self._lock:
            return restore.load_deferred(self, ns, names, device)

    def read_header(self) -> dict[str, Any] | None:
        """The committed checkpoint's JSON header (no unpickling), or None when there is none
        or it is not ours alone."""
        try:
            with store.CheckpointDir.open(self.root) as folder:
                return current_header(folder)
        except (OSError, CheckpointError, store.UnsafeCheckpointError):
            return None
