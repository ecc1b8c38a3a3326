"""The writer of checkpoints: one thread per directory writes each snapshot's blobs, then its state."""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jupyter_gpufrac.kernel import store, stream, tensor_io

log = logging.getLogger(__name__)

# Staging buffers are reused while snapshots follow each other (memory touched for the first
# time costs more page faults than the copy itself: 1 GiB took 0.7 s here against 0.1 s for
# the copy); once the writer has had nothing to write for this many seconds they are let go,
# so a notebook that pauses holds no copy of its state.
POOL_KEEP_ENV = "GPUFRAC_STAGING_KEEP_S"
POOL_KEEP_S = 5.0
# ... but not while a cell that started less than this long ago still runs: its end likely
# takes the next snapshot (a 4 GiB copy took 4-16 s into fresh memory on a 2-core VM, 0.4 s
# into a kept buffer); a longer cell is a job of its own, and its pause lets them go.
POOL_KEEP_CELL_ENV = "GPUFRAC_STAGING_KEEP_CELL_S"
POOL_KEEP_CELL_S = 30.0
# While a cell runs, the writer waits between the chunks it writes, for at most this long into
# the cell: a cell's own work then has the CPU and the memory bandwidth to itself (on two
# cores a writer copying into the page cache beside it made a training step 1.7x slower), and
# a long cell still lets the last good checkpoint reach the disk.
CELL_YIELD_ENV = "GPUFRAC_WRITER_YIELD_S"
CELL_YIELD_S = 2.0


def _seconds(env: str, default: float) -> float:
    try:
        return max(0.0, float(os.environ.get(env, default)))
    except ValueError:
        return default


SEEN_BYTES = 160  # the note of when the committed state was last found current, always as long


class WriteError(Exception):
    """A snapshot could not be written (the message is for people); the last good one stays."""


@dataclass(eq=False)
class Job:
    """One snapshot to write: the state file (None: the one committed or queued before stays
    current, only when and after which cell it was found so is noted), and its new blobs."""

    cell: int | None
    time: float
    state: bytes | None
    digest: str  # of the state file this job leaves current
    referenced: frozenset[str]
    staged: dict[str, store.Staged]
    result: Any = None  # the CheckpointResult of the snapshot
    state_cell: int | None = None  # the cell the state file names (an older one's, absorbed)
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None
    superseded_by: Job | None = None
    bytes_done: int = 0
    identity: tuple[int, int, int, int] | None = None  # of the state file once committed
    written_at: float | None = None  # when it became durable (monotonic)
    pause: Callable[[], None] | None = None  # between chunks: waits while a cell runs
    hurried: Callable[[], bool] = lambda: False  # whether someone waits for it now
    _count: threading.Lock = field(default_factory=threading.Lock)

    @property
    def bytes_total(self) -> int:
        """Bytes of the blobs it writes (before compression)."""
        return sum(s.nbytes for s in self.staged.values())

    def progress(self, nbytes: int) -> None:
        """``nbytes`` more were written (from the writer's threads, a chunk at a time)."""
        with self._count:
            self.bytes_done += nbytes
        if self.pause is not None:
            self.pause()

    def written(self, nbytes: int, staged: store.Staged) -> None:
        """``nbytes`` of ``staged`` were written: compressed ones count only now."""
        result = self.result
        if staged.compress and result is not None:
            with self._count:
                if staged.pack:
                    result.group_bytes_written += nbytes
                else:
                    result.bytes_written += nbytes

    def absorb(self, older: Job) -> None:
        """Take what ``older`` (not written: superseded or failed) held that this job needs."""
        if self.state is None and older.state is not None:
            # Nothing changed since the older snapshot: its state is this one's, to commit.
            self.state, self.digest, self.referenced = older.state, older.digest, older.referenced
            self.state_cell = older.state_cell
        for name, staged in older.staged.items():
            if name in self.referenced and name not in self.staged:
                self.staged[name] = staged
                if self.result is not None and not staged.compress:
                    # Written by this job: counted as its own.
                    if staged.pack:
                        self.result.group_bytes_written += staged.nbytes
                    else:
                        self.result.bytes_written += staged.nbytes
                        self.result.blobs_written += 1
            elif self.staged.get(name) is not staged and staged.release is not None:
                staged.release()
        older.staged = {}

    def release(self) -> None:
        """Give the staged copies' memory back."""
        staged, self.staged = self.staged, {}
        for item in staged.values():
            if item.release is not None:
                item.release()

    def wait(self, timeout: float | None = None) -> Job:
        """The job that wrote this snapshot (this one, or one that superseded it), once written;
        raises WriteError when it failed, TimeoutError when it is not written in time."""
        deadline = None if timeout is None else time.monotonic() + timeout
        job = self
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not job.done.wait(left):
                raise TimeoutError("the checkpoint is still being written")
            if job.superseded_by is None:
                break
            job = job.superseded_by
        if job.error is not None:
            raise WriteError(str(job.error)) from job.error
        return job


class Writer:
    """Writes the jobs of one checkpoint directory, one at a time, in a thread of its own.

    Blobs first, synced, then the state file that names them, renamed into place (the last good
    checkpoint stays whole whatever happens meanwhile), then blobs no longer named are deleted.

    A job that waits while another is written is superseded by the next one (it takes the
    staged blobs of the older one that it names, and the older one's waiters follow it). A job
    that fails (disk full) hands its staged blobs to the next one: that one builds on it, and
    writes them.

    The writer keeps out of the notebook's way: while a cell runs it pauses between chunks
    (:data:`CELL_YIELD_S`), unless someone waits for it (:meth:`flush`, :meth:`hurry`).
    """

    def __init__(self, root: Path, committed: Callable[[Job, list[str]], None]) -> None:
        self.root = Path(root)
        self._committed = committed
        self._cond = threading.Condition()
        self._running: Job | None = None
        self._queued: Job | None = None
        self._failed: Job | None = None  # its staged blobs go to the next job
        self._thread: threading.Thread | None = None
        self.durable: Job | None = None  # the last job written (this process)
        self.error: str | None = None  # why the last job failed; None once one succeeds
        self.failures = 0  # jobs that failed, in all
        # The next snapshot must not build on the last one (blobs it names went missing).
        self.reset = False
        self._cell_since: float | None = None  # when the running cell started (monotonic)
        self._hurried = 0  # threads waiting for the writer: it does not pause for cells then
        self._on_idle: list[Callable[[], None]] = []

    def cell(self, running: bool) -> None:
        """A cell of the notebook starts (True) or ends (False)."""
        with self._cond:
            self._cell_since = time.monotonic() if running else None
            self._cond.notify_all()

    @contextlib.contextmanager
    def hurry(self) -> Iterator[None]:
        """While in it, the writer writes at full speed, cells or not (someone waits for it)."""
        with self._cond:
            self._hurried += 1
            self._cond.notify_all()
        try:
            yield
        finally:
            with self._cond:
                self._hurried -= 1

    def _pause(self) -> None:
        """Between chunks: wait while a cell that started less than CELL_YIELD_S ago runs."""
        yield_s = _seconds(CELL_YIELD_ENV, CELL_YIELD_S)
        with self._cond:
            while self._cell_since is not None and not self._hurried:
                left = self._cell_since + yield_s - time.monotonic()
                if left <= 0:
                    return
                self._cond.wait(left)

    def _cell_keeps_pools(self) -> bool:
        """Whether the staging pools wait for the running cell: its end likely takes the next
        snapshot, which would otherwise copy into fresh memory (a loop of training cells)."""
        return (self._cell_since is not None
                and time.monotonic() - self._cell_since < _seconds(POOL_KEEP_CELL_ENV,
                                                                   POOL_KEEP_CELL_S))

    def _waited_for(self) -> bool:
        return self._hurried > 0

    def when_idle(self, callback: Callable[[], None]) -> bool:
        """Call ``callback`` (in the writer's thread) once nothing is written or queued; False
        when that is already so (then it is not called)."""
        with self._cond:
            if self._running is None and self._queued is None:
                return False
            self._on_idle.append(callback)
            return True

    def submit(self, job: Job) -> None:
        """Queue ``job``: it supersedes a queued one, and takes over a failed one's blobs."""
        with self._cond:
            if self._failed is not None:
                job.absorb(self._failed)
                self._failed = None
            older = self._queued
            if older is not None:
                job.absorb(older)
                older.superseded_by = job
                older.done.set()
            self._queued = job
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="gpufrac-checkpoint-writer",
                                                daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def busy(self) -> bool:
        """Whether a job is being written or waits."""
        with self._cond:
            return self._running is not None or self._queued is not None

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every job is written (or failed); False when ``timeout`` ran out first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self.hurry(), self._cond:
            while self._running is not None or self._queued is not None:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def writing(self) -> dict[str, Any] | None:
        """The job being written, with its progress; None when none is."""
        with self._cond:
            job = self._running if self._running is not None else self._queued
            if job is None or job.state is None:
                return None
            running = job is self._running
        return {"cell": job.cell, "bytes_done": job.bytes_done if running else 0,
                "bytes_total": job.bytes_total, "queued": not running}

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._queued is None:
                    keep = _seconds(POOL_KEEP_ENV, POOL_KEEP_S)
                    if keep and (self._cond.wait(keep) or self._cell_keeps_pools()):
                        continue  # a job, a cell starting or ending, or a cell that runs
                    if self._queued is None:
                        tensor_io.STAGING.clear()
                        stream.PINNED.clear()
                        self._cond.wait()
                job, self._queued = self._queued, None
                self._running = job
            job.pause, job.hurried = self._pause, self._waited_for
            stale: list[str] = []
            try:
                stale = self._write(job)
            except store.Torn as exc:
                # The notebook wrote held bytes while they were written (a cell ran): not a
                # failure to tell. Nothing of it is committed, and the next snapshot builds on
                # what is on disk, writing those bytes anew.
                job.error = exc
                self.reset = True
                log.debug("gpufrac: the snapshot after cell %s changed while it was written",
                          job.cell)
                job.release()
            except BaseException as exc:  # a thread must not die of a failed write
                job.error = exc
                self.failures += 1
                self.error = str(exc)
                # Not a warning: output of this thread would land in whatever cell runs; the
                # notebook is told once, by the hook, between cells.
                log.info("gpufrac: writing the checkpoint after cell %s failed: %s",
                            job.cell, exc)
                with self._cond:
                    if self._queued is not None:
                        self._queued.absorb(job)
                    else:
                        self._failed = job
            else:
                self.error = None
                job.release()
            finally:
                job.done.set()  # durable (or failed): waiters go on while old blobs go
            if stale:
                with contextlib.suppress(OSError, store.UnsafeCheckpointError), \
                        store.CheckpointDir.open(self.root) as folder:
                    folder.remove_blobs(stale)
            # Pinned buffers for the GPU storages this snapshot held (here, never in a cell).
            stream.PINNED.grow()
            with self._cond:
                self._running = None
                self._cond.notify_all()
                idle, self._on_idle = (self._on_idle, []) if self._queued is None else ([], [])
            for callback in idle:
                try:
                    callback()
                except Exception:  # a waiter's failure must not end the writer
                    log.exception("gpufrac: a callback for the idle writer failed")

    def _write(self, job: Job) -> list[str]:
        """Write ``job``: its blobs, synced, then its state file; (blobs no longer named)."""
        try:
            folder = store.CheckpointDir.open(self.root, create=True)
        except (OSError, store.UnsafeCheckpointError) as exc:
            raise WriteError(f"cannot use checkpoint directory {self.root}: {exc}") from exc
        stale: list[str] = []
        with folder:
            try:
                if job.state is not None:
                    stale = self._commit(folder, job)
                if job.state is None or job.cell != job.state_cell:
                    # When, and after which cell, the state was last found current: no fsync
                    # (lost, a restore names an earlier cell; no variable is lost).
                    seen = {"state": job.digest, "time": job.time, "execution_count": job.cell}
                    folder.overwrite(store.SEEN_FILE, json.dumps(seen).encode().ljust(SEEN_BYTES))
            except store.Torn:
                raise
            except (OSError, store.UnsafeCheckpointError) as exc:
                raise WriteError(f"writing the checkpoint to {self.root} failed: {exc}") from exc
        job.written_at = time.monotonic()
        self.durable = job
        self._committed(job, stale)
        return stale

    def _commit(self, folder: store.CheckpointDir, job: Job) -> list[str]:
        assert job.state is not None
        missing = sorted(b for b in job.referenced
                         if b not in job.staged and not folder.exists(b, blob=True))
        if missing:
            self.reset = True
            raise WriteError(
                f"{len(missing)} file(s) that the checkpoint builds on are gone from "
                f"{self.root / store.BLOB_DIR} (was the folder removed or cleaned by hand?); "
                "the next checkpoint writes every variable again")
        sync = store.BlobSync(folder)
        content = store.ContentStore.open(self.root)
        shared = {name: name for name in job.staged if tensor_io.content_addressed(name)}
        try:
            for name, staged in job.staged.items():
                if staged.shared:
                    # Hashed (and linked, or written) in a syncing thread, with the others.
                    sync.add(name, functools.partial(_write_shared_blob, folder, content, job,
                                                     name, staged, shared))
                elif name in shared and content is not None and content.link_into(folder, name):
                    sync.add(name)  # another kernel of this user stored the same bytes
                    job.progress(staged.nbytes)
                else:
                    sync.add(name, functools.partial(_write_blob, folder, job, name, staged))
            # Blobs durable first, then the state file that names them: a kill or crash in
            # between leaves the previous state whole, and its blobs untouched.
            folder.commit(store.STATE_FILE, job.state, blobs=sync)
            if content is not None:
                for name, stored_as in shared.items():
                    content.share(folder, name, stored_as)
        finally:
            sync.close()
            if content is not None:
                content.close()
        job.identity = folder.identity(store.STATE_FILE)
        return folder.unreferenced_blobs(set(job.referenced))


def _write_blob(folder: store.CheckpointDir, job: Job, name: str, staged: store.Staged) -> None:
    job.written(tensor_io.write_staged(folder, name, staged, job.progress, job.hurried), staged)


def _write_shared_blob(folder: store.CheckpointDir, content: store.ContentStore | None, job: Job,
                       name: str, staged: store.Staged, shared: dict[str, str]) -> None:
    """Blob ``name`` of bytes another kernel of the user may hold: linked from the content
    store when it does, else written; either way shared under its content's name."""
    digest = tensor_io.staged_digest(staged, job.pause)
    if staged.hashed is not None:
        staged.hashed(digest)
    stored_as = (tensor_io.COMPRESSED if staged.compress else "") + tensor_io.content_name(digest)
    if content is not None and content.link_into(folder, stored_as, name):
        job.progress(staged.nbytes)
    else:
        _write_blob(folder, job, name, staged)
    shared[name] = stored_as
