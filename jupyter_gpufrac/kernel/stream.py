"""Blobs streamed into tensor storages: read in chunks by several threads at once, and for a device
through a small ring of pinned host buffers, copied asynchronously while the next chunks are read."""

from __future__ import annotations

import contextlib
import functools
import os
import threading
from collections.abc import Callable
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field
from typing import Any

from jupyter_gpufrac.kernel import store, tensor_io

# Bytes read at once into one ring buffer (or straight into a host storage): large enough that a
# read and a copy cost far more than their call, small enough that the ring stays small.
CHUNK = 32 * 1024 * 1024
# Ring buffers: twice the reading threads, so every thread reads while the last chunks copy.
RING_BUFFERS = 8
# True sends host storages through the ring too, as a device's go (a check of that path on a
# machine without a device); normally they are read straight into place.
HOST_VIA_RING = False


class Ring:
    """``count`` host buffers of ``chunk`` bytes that chunks are read into before their copy to a
    device: pinned (page-locked) when ``pinned`` and the driver allows it, so the copy is an
    asynchronous DMA; pageable otherwise (then each copy completes before it returns).

    :meth:`take` hands out a buffer whose last copy is done (it waits on that copy's event);
    :meth:`give` returns it with the event of the copy just queued out of it.
    """

    def __init__(self, count: int = RING_BUFFERS, chunk: int = CHUNK, *, pinned: bool = True) -> None:
        import torch

        self.chunk = chunk
        self.pinned = pinned
        self._buffers: list[Any] = []
        for _ in range(count):
            try:
                buffer = torch.empty(chunk, dtype=torch.uint8, pin_memory=pinned)
            except RuntimeError:  # no driver, or no room to pin: pageable, synchronous copies
                self.pinned = False
                buffer = torch.empty(chunk, dtype=torch.uint8)
            self._buffers.append(buffer)
        self._free: list[tuple[int, Any]] = [(i, None) for i in range(count)]
        self._cond = threading.Condition()

    @property
    def nbytes(self) -> int:
        """Host memory the ring holds."""
        return self.chunk * len(self._buffers)

    def take(self) -> tuple[int, Any]:
        """(index, buffer) of a free buffer, waiting until one is."""
        with self._cond:
            while not self._free:
                self._cond.wait()
            index, event = self._free.pop(0)
        if event is not None:
            event.synchronize()  # the copy out of it is done: it may be written again
        return index, self._buffers[index]

    def give(self, index: int, event: Any) -> None:
        """Buffer ``index`` is free once ``event`` (None: at once) has happened."""
        with self._cond:
            self._free.append((index, event))
            self._cond.notify()

    def drain(self) -> None:
        """Wait until every copy out of the ring is done."""
        with self._cond:
            pending = [event for _, event in self._free if event is not None]
        for event in pending:
            event.synchronize()


_ring: Ring | None = None
_ring_lock = threading.Lock()


def ring() -> Ring:
    """The process's ring (made at the first restore to a device, or warmed ahead by a spare
    kernel: pinning memory takes the driver a while)."""
    global _ring
    with _ring_lock:
        if _ring is None:
            _ring = Ring(pinned=pinning_works())
        return _ring


def pinning_works() -> bool:
    """Whether host memory can be pinned here (a CUDA driver answers)."""
    import torch

    try:
        return bool(torch.cuda.is_available())
    except Exception:  # a broken driver: pageable buffers still work
        return False


@dataclass(eq=False)
class _Storage:
    """One storage on its way: where it goes, how many of its chunks are still to come."""

    blob: str
    nbytes: int
    fd: int
    target: Any  # the storage filled (on its device)
    host: memoryview | None  # its bytes when it is in host memory
    left: int
    future: Future[Any] = field(default_factory=Future)
    error: BaseException | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)
    done: Any = None  # a device storage's: the event after its last chunk's copy


class Streamer:
    """Fills storages from blob files, chunk by chunk, in the threads of ``executor``.

    A host storage is made at its final place and its chunks are read straight into it (several
    at once: reading into memory touched for the first time costs page faults, which threads
    share out). A device storage is made on its device at once, never in pageable host memory
    first: each chunk is read into a buffer of the ring and copied from there on a stream of
    its own, while the next chunks are read. :meth:`submit` returns a future, done once every
    chunk is read (and for a device, its copy queued); :meth:`take` gives its storage, ordered
    on the current stream after those copies; :meth:`close` waits for every copy.
    """

    def __init__(self, folder: store.CheckpointDir, executor: Executor, *,
                 ring_of: Callable[[], Ring] = ring) -> None:
        self._folder = folder
        self._executor = executor
        self._ring_of = ring_of
        self._streams: dict[str, Any] = {}
        self._lock = threading.Lock()
        self._jobs: dict[int, _Storage] = {}

    def submit(self, blob: str, nbytes: int, device: str) -> Future[Any]:
        """Start filling a new storage on ``device`` with blob ``blob`` (``nbytes`` bytes). What
        fails (no room on the device, a blob missing or of another size) fails the future: the
        variables on that storage are lost, not the restore."""
        try:
            job = self._open(blob, nbytes, device)
        except Exception as exc:
            failed: Future[Any] = Future()
            failed.set_exception(exc)
            return failed
        self._jobs[id(job.future)] = job
        direct = job.host is not None or (job.target.device.type == "cpu" and not HOST_VIA_RING)
        chunk = CHUNK if direct else self._ring_of().chunk
        chunks = range(0, nbytes, chunk)
        job.left = max(1, len(chunks))
        if not nbytes:
            self._chunk_done(job, None)
        for offset in chunks:
            self._executor.submit(self._fill, job, offset, min(chunk, nbytes - offset))
        return job.future

    def _open(self, blob: str, nbytes: int, device: str) -> _Storage:
        import torch

        fh = self._folder.open_read(blob, blob=True)
        try:
            size = os.fstat(fh.fileno()).st_size
            if size != nbytes:
                raise OSError(f"blob {blob} holds {size} bytes, the checkpoint expects {nbytes}")
            target = torch.empty(nbytes, dtype=torch.uint8, device=device).untyped_storage()
            fd = os.dup(fh.fileno())
        finally:
            fh.close()
        with contextlib.suppress(OSError, AttributeError):
            os.posix_fadvise(fd, 0, nbytes, os.POSIX_FADV_SEQUENTIAL)
        direct = target.device.type == "cpu" and not HOST_VIA_RING
        host = tensor_io.host_view(target) if direct and nbytes else None
        return _Storage(blob, nbytes, fd, target, host, 0)

    def _fill(self, job: _Storage, offset: int, length: int) -> None:
        event = None
        try:
            if job.error is None:
                if job.host is not None:
                    _pread_into(job, job.host[offset:offset + length], offset)
                else:
                    event = self._through_ring(job, offset, length)
        except BaseException as exc:  # told through the storage's future
            job.error = job.error or exc
        self._chunk_done(job, event)

    def _through_ring(self, job: _Storage, offset: int, length: int) -> Any:
        import torch

        ring = self._ring_of()
        index, buffer = ring.take()
        event = None
        try:
            _pread_into(job, tensor_io.host_view(buffer.untyped_storage())[:length], offset)
            destination = torch.empty(0, dtype=torch.uint8, device=job.target.device).set_(
                job.target, offset, (length,), (1,))
            if job.target.device.type == "cuda":
                stream = self._stream(job.target.device)
                with torch.cuda.stream(stream):
                    destination.copy_(buffer[:length], non_blocking=ring.pinned)
                    event = torch.cuda.Event()
                    event.record(stream)
            else:
                destination.copy_(buffer[:length])
        finally:
            ring.give(index, event)
        return event

    def _stream(self, device: Any) -> Any:
        import torch

        key = str(device)
        with self._lock:
            if key not in self._streams:
                self._streams[key] = torch.cuda.Stream(device=device)
            return self._streams[key]

    def _chunk_done(self, job: _Storage, event: Any) -> None:
        with job.lock:
            job.left -= 1
            last = job.left == 0
        if not last:
            return
        os.close(job.fd)
        if job.error is not None:
            job.future.set_exception(job.error)
            return
        if job.target.device.type == "cuda":
            import torch

            # Every chunk's copy was queued on this stream before the count reached zero: once
            # it has run them, the storage is whole.
            job.done = torch.cuda.Event()
            job.done.record(self._stream(job.target.device))
        job.future.set_result(job.target)

    def take(self, future: Future[Any]) -> Any:
        """The storage ``future`` (from :meth:`submit`) fills, once read; what runs after on the
        current stream (the notebook's work) runs after its copies."""
        storage = future.result()
        job = self._jobs.pop(id(future), None)
        if job is not None and job.done is not None:
            import torch

            torch.cuda.current_stream(storage.device).wait_event(job.done)
        return storage

    def close(self) -> None:
        """Wait for every copy queued (a storage must not be freed or used while one writes it)."""
        for stream in list(self._streams.values()):
            stream.synchronize()


def _pread_into(job: _Storage, view: memoryview, offset: int) -> None:
    done = 0
    while done < len(view):
        got = os.preadv(job.fd, [view[done:]], offset + done)
        if not got:
            raise OSError(f"blob {job.blob} ended after {offset + done} of {job.nbytes} bytes")
        done += got


# -- snapshots of device storages ----------------------------------------------------------


class PinnedPool:
    """Pinned host buffers that GPU storages are copied into at a cell's end, kept from one
    snapshot to the next: pinning memory takes the driver far longer than the copy (a cell must
    not wait for it), so buffers are pinned only by the writer's thread (:meth:`grow`), for the
    sizes snapshots asked for and found none (:meth:`want`), at most ``limit`` bytes in all.
    Without a driver to pin them (or to check this path on a machine without one), buffers are
    plain host memory."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._free: list[Any] = []
        self._lent = 0
        self._wanted: list[int] = []
        self._lock = threading.Lock()

    def _bytes(self) -> int:
        return self._lent + sum(int(b.numel()) for b in self._free)

    def take(self, nbytes: int) -> Any | None:
        """A free buffer of ``nbytes`` to twice that, or None (then :meth:`want` it)."""
        with self._lock:
            fits = [b for b in self._free if nbytes <= int(b.numel()) <= 2 * nbytes]
            if not fits:
                return None
            buffer = min(fits, key=lambda b: int(b.numel()))
            self._free.remove(buffer)
            self._lent += int(buffer.numel())
            return buffer

    def give(self, buffer: Any) -> None:
        """Keep ``buffer`` for the next snapshot."""
        with self._lock:
            self._lent -= int(buffer.numel())
            self._free.append(buffer)

    def want(self, nbytes: int) -> None:
        """A snapshot found no buffer for ``nbytes``: the writer pins one after its write."""
        with self._lock:
            self._wanted.append(nbytes)

    def grow(self) -> None:
        """Pin the buffers snapshots wanted, within the limit (in the writer's thread)."""
        with self._lock:
            wanted, self._wanted = self._wanted, []
            room = self.limit - self._bytes()
        if not wanted:
            return  # (a kernel without GPU tensors never imports torch here)
        import torch

        for nbytes in sorted(wanted):
            if nbytes > room:
                break
            try:
                buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinning_works())
            except RuntimeError:  # no room to pin: the next snapshot holds it again
                break
            room -= nbytes
            with self._lock:
                self._free.append(buffer)

    def clear(self) -> None:
        """Let the free buffers go (the notebook paused: it holds no copy of its state)."""
        with self._lock:
            self._free, self._wanted = [], []

    @property
    def kept(self) -> int:
        """Bytes held, lent or free."""
        with self._lock:
            return self._bytes()


PINNED = PinnedPool(tensor_io.STAGING.limit)
# Storages of these device types are snapshotted as a GPU's are (pinned staging on their
# stream, or held and copied out by the writer); a check of that path on a machine without a
# GPU adds "cpu".
DEVICE_TYPES = ("cuda",)


def on_device(storage: Any) -> bool:
    """Whether ``storage`` is snapshotted as a device's."""
    return bool(storage.device.type in DEVICE_TYPES)


def _event_after_current_work(device: Any) -> Any:
    """An event on ``device``'s current stream, after what was queued on it so far (None off
    CUDA, where work is done when queued)."""
    if device.type != "cuda":
        return None
    import torch

    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


def snapshot_device_storage(storage: Any, unchanged: Callable[[], bool] | None) -> store.Staged:
    """A device storage's bytes as they are at the cell's end, without the cell waiting.

    With a warm pinned buffer: copied into it on the device's current stream, the one the cell
    wrote on, so the copy runs after the cell's work and before any work queued later (a later
    in-place change); the writer waits on its event. Without one (the first snapshot of that
    size, or after a pause): held where it is when ``unchanged`` can tell a later change (its
    tensors' version counters), and copied out by the writer after an event of this point of
    the stream, then written only if still unchanged (else the next snapshot writes it); the
    writer pins a buffer for next time. A storage whose tensors count no versions (inference
    tensors) is copied now, into pinned memory made for it.
    """
    import torch

    nbytes = int(storage.nbytes())
    buffer = PINNED.take(nbytes)
    if buffer is None:
        PINNED.want(nbytes)
        if unchanged is not None:
            return store.Staged(storage, nbytes, valid=unchanged, keep=storage, on_device=True,
                                after=_event_after_current_work(storage.device))
        buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinning_works())
        release = None
    else:
        release = functools.partial(PINNED.give, buffer)
    host = buffer[:nbytes]
    source = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
    host.copy_(source, non_blocking=storage.device.type == "cuda")
    done = _event_after_current_work(storage.device)
    return store.Staged(host, nbytes, ready=None if done is None else done.synchronize,
                        release=release)


_writer_ring: Ring | None = None


def write_from_device(fh: Any, staged: store.Staged,
                      progress: Callable[[int], None] | None) -> None:
    """Write a storage held on its device (see :func:`snapshot_device_storage`): a chunk at a
    time copied through a small ring of pinned buffers on a stream of the writer's own, after
    the snapshot's event; a chunk changed since the snapshot stops it (:class:`store.Torn`)."""
    import torch

    global _writer_ring
    with _ring_lock:
        if _writer_ring is None:
            _writer_ring = Ring(count=2, pinned=pinning_works())
        ring = _writer_ring
    storage = staged.data
    source = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
    side = None
    if storage.device.type == "cuda":
        side = torch.cuda.Stream(device=storage.device)
        if staged.after is not None:
            side.wait_event(staged.after)
    for offset in range(0, staged.nbytes, ring.chunk):
        length = min(ring.chunk, staged.nbytes - offset)
        index, buffer = ring.take()
        try:
            if side is not None:
                with torch.cuda.stream(side):
                    buffer[:length].copy_(source[offset:offset + length], non_blocking=True)
                side.synchronize()
            else:
                buffer[:length].copy_(source[offset:offset + length])
            store.check_held(staged)  # changed meanwhile: these bytes may be torn
            store.write_all(fh, tensor_io.host_view(buffer.untyped_storage())[:length], progress)
        finally:
            ring.give(index, None)
