"""Raw buffers to and from blob files: tensor storages (no copies on the CPU, no numpy) and
content-addressed buffers (pickle protocol 5's out-of-band buffers)."""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import mmap
import os
import threading
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from jupyter_gpufrac.kernel import store

CONTENT_PREFIX = "r-"
PACK_PREFIX = "g-"
# A blob whose name starts with this holds its bytes compressed with zlib (level 1); the rest
# of the name is that of the same bytes uncompressed.
COMPRESSED = "z"
_CHUNK = 8 * 1024 * 1024
_SAMPLES = 4
_SAMPLE = 16 * 1024


def digest(data: memoryview | bytes) -> str:
    """The content address of ``data`` (hex): equal bytes, equal name."""
    return hashlib.blake2b(data, digest_size=20).hexdigest()


def content_name(hex_digest: str) -> str:
    """The blob name of a content-addressed buffer."""
    return f"{CONTENT_PREFIX}{hex_digest}.bin"


def content_addressed(blob: str) -> bool:
    """Whether ``blob`` is named by its bytes (a buffer or a pack, compressed or not): equal
    names, equal bytes, whichever kernel wrote them."""
    core = blob[len(COMPRESSED):] if blob.startswith(COMPRESSED) else blob
    return core.startswith((CONTENT_PREFIX, PACK_PREFIX))


def pays(view: memoryview) -> bool:
    """Whether zlib halves samples of ``view``: compression is kept to data it clearly pays for
    (counters, timestamps, codes, zeros), not floats, where it costs time and saves little."""
    step = max(view.nbytes // _SAMPLES, _SAMPLE)
    samples = [view[start:start + _SAMPLE] for start in range(0, view.nbytes, step)]
    size = sum(len(sample) for sample in samples)
    return size >= 4096 and sum(len(zlib.compress(sample, 1)) for sample in samples) * 2 <= size


def store_bytes(folder: store.CheckpointDir, data: memoryview | bytes, prefix: str = CONTENT_PREFIX,
                have: Callable[[str], str | None] = lambda _name: None,
                later: Callable[[str, Callable[[], int]], None] | None = None) -> tuple[str, int]:
    """Store ``data`` as a content-addressed blob, compressed where that pays: (blob name, bytes
    written, 0 when ``have`` knows a blob of the same bytes).

    What is hashed is exactly what is stored, even if the buffer changes meanwhile (another
    thread of the notebook): it is copied first (a large buffer stored as it is, in chunks as
    it is written). No fsync here, as for storages. With ``later``, a blob to compress is
    handed to it as (name, a function that compresses and writes it, returning the bytes
    written) and 0 is returned: zlib lets go of the GIL, so another core compresses while
    the checkpoint goes on.
    """
    view = memoryview(data).cast("B")
    if isinstance(folder, store.StagingDir):
        return _stage_bytes(folder, view, prefix, have, later)
    if view.nbytes <= _CHUNK or pays(view):
        copy = bytes(view)
        name = f"{prefix}{digest(copy)}.bin"
        found = have(name)
        if found is not None:
            return found, 0
        if pays(memoryview(copy)):
            blob = COMPRESSED + name

            def write() -> int:
                return _publish(folder, blob, zlib.compress(copy, 1))

            if later is None:
                return blob, write()
            later(blob, write)
            return blob, 0
        return name, _publish(folder, name, copy)
    hasher = hashlib.blake2b(digest_size=20)
    tmp, fh = folder.create_tmp(blob=True)
    try:
        with fh:
            chunk = bytearray(_CHUNK)
            for start in range(0, view.nbytes, _CHUNK):
                part = memoryview(chunk)[:min(_CHUNK, view.nbytes - start)]
                part[:] = view[start:start + len(part)]
                hasher.update(part)
                _write_all(fh, part)
        name = f"{prefix}{hasher.hexdigest()}.bin"
        found = have(name)
        if found is None:
            folder.publish(tmp, name, blob=True)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp, dir_fd=folder.blobs_fd)
        raise
    if found is not None:
        os.unlink(tmp, dir_fd=folder.blobs_fd)
        return found, 0
    return name, view.nbytes


def _stage_bytes(folder: store.StagingDir, view: memoryview, prefix: str,
                 have: Callable[[str], str | None],
                 later: Callable[[str, Callable[[], int]], None] | None) -> tuple[str, int]:
    """:func:`store_bytes` while a snapshot is taken: the bytes are copied (as they are now) and
    named; compressing and writing them are left to the snapshot's writer."""
    if view.nbytes <= _CHUNK or pays(view):
        copy = bytes(view)
        name = f"{prefix}{digest(copy)}.bin"
        found = have(name)
        if found is not None:
            return found, 0
        if not pays(memoryview(copy)):
            folder.stage(name, store.Staged(copy, len(copy), pack=prefix == PACK_PREFIX))
            return name, len(copy)
        blob = COMPRESSED + name

        def stage() -> int:
            # Counted once compressed and written (see writer.Job.written).
            folder.stage(blob, store.Staged(copy, len(copy), compress=True,
                                            pack=prefix == PACK_PREFIX))
            return 0

        if later is None:
            return blob, stage()
        later(blob, stage)
        return blob, 0
    staged = copy_host(view)
    name = f"{prefix}{digest(staged_view(staged))}.bin"
    found = have(name)
    if found is not None:
        if staged.release is not None:
            staged.release()
        return found, 0
    staged.pack = prefix == PACK_PREFIX
    folder.stage(name, staged)
    return name, view.nbytes


class StagingPool:
    """Host buffers for snapshots, kept for the next one a while: memory the process touches
    for the first time costs page faults, which cost more than the copy itself (a copy of
    1 GiB into fresh memory took 1.0-3.4 s on a 2-core VM, 0.25-0.55 s into memory touched
    before). At most ``limit`` bytes are kept; :meth:`clear` lets all of them go."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._free: list[mmap.mmap] = []
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> mmap.mmap:
        """A buffer of at least ``nbytes`` (at most twice that)."""
        with self._lock:
            fits = [b for b in self._free if nbytes <= len(b) <= 2 * nbytes]
            if fits:
                buffer = min(fits, key=len)
                self._free.remove(buffer)
                return buffer
        buffer = mmap.mmap(-1, nbytes)
        with contextlib.suppress(AttributeError, OSError):
            buffer.madvise(mmap.MADV_HUGEPAGE)  # fewer faults where the kernel allows it
        return buffer

    def give(self, buffer: mmap.mmap) -> None:
        """Keep ``buffer`` for another snapshot, or let it go when the pool is full."""
        with self._lock:
            kept = sum(len(b) for b in self._free)
            if kept + len(buffer) <= self.limit:
                self._free.append(buffer)
                return
        with contextlib.suppress(BufferError):  # a view still held: freed with the last one
            buffer.close()

    def clear(self) -> None:
        """Let every kept buffer go."""
        with self._lock:
            free, self._free = self._free, []
        for buffer in free:
            with contextlib.suppress(BufferError):
                buffer.close()

    @property
    def kept(self) -> int:
        """Bytes held for later snapshots."""
        with self._lock:
            return sum(len(b) for b in self._free)


def _pool_limit() -> int:
    """What a snapshot may copy unless told otherwise: c.GpuFrac.checkpoint_staging_budget's
    default share of the host's RAM (a kernel given a budget keeps that much; see
    :attr:`Snapshots.staging_budget`). A pool that kept less would let the largest snapshot's
    buffer go after each write, and the next one would copy into fresh memory."""
    try:
        return max(0, os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 4)
    except (ValueError, OSError):
        return 1 << 30


STAGING = StagingPool(_pool_limit())
_SMALL_COPY = 1024 * 1024  # a copy below this is a plain bytes object


def copy_host(view: memoryview) -> store.Staged:
    """A private copy of host bytes ``view`` for a snapshot."""
    if view.nbytes < _SMALL_COPY:
        return store.Staged(bytes(view), view.nbytes)
    buffer = STAGING.take(view.nbytes)
    with memoryview(buffer) as target:
        target[:view.nbytes] = view
    return store.Staged(buffer, view.nbytes, release=lambda: STAGING.give(buffer))


def held(view: memoryview, owner: Any, valid: Callable[[], bool]) -> store.Staged:
    """Bytes a snapshot does not copy: written from the notebook's own memory, and good only
    while ``valid()`` says the notebook has not written them since (``owner`` kept alive)."""
    return store.Staged(view, view.nbytes, valid=valid, keep=owner)


def snapshot_storage(storage: Any, unchanged: Callable[[], bool] | None = None) -> store.Staged:
    """A storage's bytes as they are now, for a snapshot. A host storage is copied at once; a
    GPU storage's copy is ordered on its stream, the notebook never waiting for it (see
    :func:`stream.snapshot_device_storage`; ``unchanged`` tells whether its tensors were written
    since, where their version counters can)."""
    from jupyter_gpufrac.kernel import stream

    nbytes = int(storage.nbytes())
    if stream.on_device(storage):
        return stream.snapshot_device_storage(storage, unchanged)
    if not nbytes:
        return store.Staged(b"", 0)
    return copy_host(host_view(storage))


def staged_digest(staged: store.Staged, pause: Callable[[], None] | None = None) -> str:
    """The content digest of a staged copy's bytes, hashed a chunk at a time (``pause`` between
    chunks: the writer keeps out of a running cell's way)."""
    if staged.ready is not None:
        staged.ready()
    view = staged_view(staged)
    hasher = hashlib.blake2b(digest_size=20)
    for start in range(0, view.nbytes, _CHUNK):
        hasher.update(view[start:start + _CHUNK])
        if pause is not None:
            pause()
    return hasher.hexdigest()


def staged_view(staged: store.Staged) -> memoryview:
    """The bytes of a staged copy (the caller keeps ``staged`` while it uses them)."""
    data = staged.data
    if hasattr(data, "untyped_storage"):
        return host_view(data.untyped_storage()) if staged.nbytes else memoryview(b"")
    return memoryview(data).cast("B")[:staged.nbytes]


def write_staged(folder: store.CheckpointDir, name: str, staged: store.Staged,
                 progress: Callable[[int], None] | None = None,
                 hurried: Callable[[], bool] = lambda: False) -> int:
    """Write a staged blob under ``name`` (a temporary renamed into place: a blob left by a
    failed attempt is replaced), past the page cache while ``hurried()`` (see
    :func:`store.write_direct`); returns the bytes written. The caller syncs it."""
    if staged.ready is not None:
        staged.ready()
    data: memoryview | bytes = b"" if staged.on_device else staged_view(staged)
    if staged.compress:
        data = zlib.compress(data, 1)
        store.check_held(staged)
    tmp, fh = folder.create_tmp(blob=True)
    try:
        with fh:
            if staged.on_device:
                from jupyter_gpufrac.kernel import stream

                stream.write_from_device(fh, staged, store.held_progress(staged, progress))
            else:
                store.write_direct(fh, data, None if staged.compress else store.held_progress(
                    staged, progress), hurried)
        folder.publish(tmp, name, blob=True)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp, dir_fd=folder.blobs_fd)
        raise
    if staged.compress and progress is not None:
        progress(staged.nbytes)
    return staged.nbytes if staged.on_device else len(data)


def _publish(folder: store.CheckpointDir, name: str, data: bytes) -> int:
    tmp, fh = folder.create_tmp(blob=True)
    try:
        with fh:
            _write_all(fh, memoryview(data))
        folder.publish(tmp, name, blob=True)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp, dir_fd=folder.blobs_fd)
        raise
    return len(data)


def _write_all(fh: Any, data: memoryview) -> None:
    store.write_all(fh, data)


def read_buffer(folder: store.CheckpointDir, name: str, nbytes: int) -> bytearray | mmap.mmap:
    """Blob ``name`` as a new writable buffer (arrays rebuilt on it are writable)."""
    if name.startswith(COMPRESSED):
        return bytearray(_decompressed(folder, name, nbytes))
    # Anonymous memory comes zeroed by the kernel as it is touched: unlike a bytearray, it is
    # not cleared once more before the read fills it.
    buffer = mmap.mmap(-1, nbytes) if nbytes else bytearray()
    with folder.open_read(name, blob=True) as fh:
        _read_exactly(fh, name, memoryview(buffer))
    return buffer


def read_pack(folder: store.CheckpointDir, name: str) -> bytes:
    """The bytes of a pack of pickles."""
    if name.startswith(COMPRESSED):
        return _decompressed(folder, name, None)
    return folder.read_bytes(name, blob=True)


def _decompressed(folder: store.CheckpointDir, name: str, nbytes: int | None) -> bytes:
    inflate = zlib.decompressobj()
    data = inflate.decompress(folder.read_bytes(name, blob=True), nbytes or 0)
    if not inflate.eof or inflate.unconsumed_tail or (nbytes is not None and len(data) != nbytes):
        raise OSError(f"blob {name} does not hold the {nbytes} bytes the checkpoint expects")
    return data


def host_view(storage: Any) -> memoryview:
    """The bytes of a host storage, without a copy (raw I/O reads and writes through it)."""
    # The storage must outlive the view: callers keep a reference while the view is in use.
    nbytes = int(storage.nbytes())
    array = (ctypes.c_ubyte * nbytes).from_address(int(storage.data_ptr()))
    return memoryview(array).cast("B")


def write_storage(root: store.CheckpointDir | Path, storage: Any,
                  name: str | None = None) -> tuple[str, int, Path]:
    """Write an untyped storage's bytes as a new blob, named ``name`` (one from
    :func:`store.new_blob_name`) or a fresh name; returns (blob name, bytes, path).

    No fsync here: the caller syncs all new blobs at once before it commits the checkpoint
    that names them (:meth:`store.CheckpointDir.commit`). A blob is written under its
    final, fresh name: until a committed checkpoint names it, a half-written one is garbage
    that the next checkpoint deletes (:meth:`store.CheckpointDir.unreferenced_blobs`).
    """
    if isinstance(root, store.StagingDir):
        name = name or store.new_blob_name()
        root.stage(name, snapshot_storage(storage))
        return name, int(storage.nbytes()), root.path / store.BLOB_DIR / name
    if storage.device.type != "cpu":
        storage = storage.cpu()
    nbytes = int(storage.nbytes())
    name = name or store.new_blob_name()
    with store.opened(root) as folder, folder.create(name, blob=True) as fh:
        if nbytes:
            _write_all(fh, host_view(storage))
    return name, nbytes, folder.path / store.BLOB_DIR / name


def storage_digest(storage: Any) -> str:
    """The content address of a storage's bytes (a GPU storage is copied to the host first)."""
    if storage.device.type != "cpu":
        storage = storage.cpu()
    return digest(host_view(storage) if storage.nbytes() else b"")


def _read_exactly(fh: Any, name: str, view: memoryview) -> None:
    size = os.fstat(fh.fileno()).st_size
    if size != view.nbytes:
        raise OSError(f"blob {name} holds {size} bytes, the checkpoint expects {view.nbytes}")
    done = 0
    while done < view.nbytes:
        got = fh.readinto(view[done:])
        if not got:
            raise OSError(f"blob {name} ended after {done} of {view.nbytes} bytes")
        done += got

