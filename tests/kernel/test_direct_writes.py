"""A checkpoint someone waits for is written past the page cache; one nobody waits for is not."""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import time
from collections.abc import Iterator
from pathlib import Path

import numpy
import pytest

from jupyter_gpufrac.kernel import store
from jupyter_gpufrac.kernel.checkpoint import Checkpointer

PAGE = os.sysconf("SC_PAGE_SIZE")
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                       ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]


def resident(path: Path, start: int = 0, end: int | None = None) -> float:
    """The share of the file's pages in [start, end) that sit in the page cache (mincore)."""
    size = path.stat().st_size
    end = size if end is None else end
    pages = (size + PAGE - 1) // PAGE
    vec = (ctypes.c_ubyte * pages)()
    fd = os.open(path, os.O_RDONLY)
    try:
        address = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if address in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), "mmap")
        try:
            if _libc.mincore(address, size, vec) != 0:
                raise OSError(ctypes.get_errno(), "mincore")
        finally:
            _libc.munmap(address, size)
    finally:
        os.close(fd)
    first, last = start // PAGE, (end + PAGE - 1) // PAGE
    return sum(vec[i] & 1 for i in range(first, last)) / max(1, last - first)


def direct_io(folder: Path) -> bool:
    """Whether the file system under ``folder`` takes direct I/O (tmpfs before Linux 6.6 not)."""
    fd = os.open(folder / "probe", os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        import fcntl

        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_DIRECT)
        return True
    except OSError as exc:
        assert exc.errno == errno.EINVAL
        return False
    finally:
        os.close(fd)
        os.unlink(folder / "probe")


@pytest.fixture
def enospc() -> Iterator[None]:
    yield
    store.inject_enospc_after(None)


def test_a_hurried_write_bypasses_the_page_cache_from_the_chunk_it_is_hurried_on(
        tmp_path: Path) -> None:
    chunk = store.WRITE_CHUNK
    # Not a whole number of blocks: the tail goes through the page cache.
    data = numpy.random.default_rng(0).bytes(store.DIRECT_MIN + 2 * chunk + 1234)
    asked: list[int] = []

    def hurried() -> bool:
        asked.append(1)
        return len(asked) > 1  # the first chunk is written before anyone waits

    path = tmp_path / "blob"
    with open(path, "wb", buffering=0) as fh:
        store.write_direct(fh, data, None, hurried=hurried)
        # The descriptor is as it was: what follows (fsync, close) is unchanged.
        import fcntl

        assert not fcntl.fcntl(fh.fileno(), fcntl.F_GETFL) & os.O_DIRECT
        os.fsync(fh.fileno())
    if direct_io(tmp_path):
        assert resident(path, 0, chunk) == 1.0  # written before the hurry: cached
        assert resident(path, chunk, len(data) - PAGE) < 0.05  # past the cache
    assert len(asked) == len(data) // chunk  # asked before each whole chunk
    assert path.read_bytes() == data


def test_a_write_nobody_waits_for_goes_through_the_page_cache(tmp_path: Path) -> None:
    data = numpy.random.default_rng(1).bytes(store.DIRECT_MIN + 5000)
    path = tmp_path / "blob"
    with open(path, "wb", buffering=0) as fh:
        store.write_direct(fh, data, None, hurried=lambda: False)
    assert resident(path) == 1.0
    assert path.read_bytes() == data


def test_a_disk_that_fills_during_a_hurried_write_says_so(tmp_path: Path, enospc: None) -> None:
    data = bytes(store.DIRECT_MIN + store.WRITE_CHUNK)
    store.inject_enospc_after(store.WRITE_CHUNK + 100)
    with open(tmp_path / "blob", "wb", buffering=0) as fh, pytest.raises(OSError) as raised:
        store.write_direct(fh, data, None, hurried=lambda: True)
    assert raised.value.errno == errno.ENOSPC


def test_a_snapshot_flushed_while_it_is_written_goes_on_past_the_page_cache(
        ckdir: Path) -> None:
    """A move or a park waits for the snapshot the last cell left: from then on its blobs are
    not throttled to what writeback has cleaned. Restored, every byte is back."""
    array = numpy.random.default_rng(2).random((store.DIRECT_MIN * 4) // 8)
    ck = Checkpointer(ckdir)
    ck.writer.cell(True)  # a cell runs: the writer pauses after its first chunk
    try:
        job = ck.begin({"array": array}, execution_count=1)
        deadline = time.monotonic() + 30
        while job.bytes_done == 0:  # paused after its first chunk, until someone waits
            assert time.monotonic() < deadline, "the writer never began"
            time.sleep(0.01)
        assert ck.flush(60)
    finally:
        ck.writer.cell(False)
    blob = max((ckdir / store.BLOB_DIR).iterdir(), key=lambda p: p.stat().st_size)
    assert blob.stat().st_size >= array.nbytes
    if direct_io(ckdir):
        assert resident(blob) < 0.5, "most of the blob was written past the page cache"
    ns: dict[str, object] = {}
    Checkpointer(ckdir).load(ns)
    assert numpy.array_equal(ns["array"], array)
