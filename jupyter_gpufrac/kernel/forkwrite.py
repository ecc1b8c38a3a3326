"""Snapshot bytes written by a forked child from its copy-on-write view of the notebook's memory."""

from __future__ import annotations

import bisect
import contextlib
import ctypes
import errno
import hashlib
import logging
import mmap
import os
import select
import signal
import struct
import sys
import threading
import time
import uuid
import warnings
from collections.abc import Callable, Mapping
from typing import Any, NoReturn

from jupyter_gpufrac.kernel import store

log = logging.getLogger(__name__)

# "fork" (the default, where it works) or "copy": how host bytes of a snapshot are kept as
# they were at the cell's end (read at each snapshot, so tests and benchmarks can switch).
MODE_ENV = "GPUFRAC_SNAPSHOT"
# Children alive at once. Each holds its snapshot's pages until written, and every page the
# notebook writes meanwhile is copied once by the kernel: two children cost at most what two
# staged copies did (one job written, one waiting). The writer writes one job at a time, so a
# third child would only wait behind them; that snapshot copies instead.
MAX_CHILDREN = 2
_STATUS = struct.Struct("q")  # the child's last word: 0, an errno, or _CHANGED
_CHANGED = -1  # content-addressed bytes changed between their hashing and the fork
_POLL_S = 0.25  # how often the writer reads a child's progress while it waits
_PR_SET_PDEATHSIG = 1

_lock = threading.Lock()
_children: set[Child] = set()
_forking: set[str] = set()  # names of the child being forked, before it is one of _children
_broken: str | None = None  # why forking stopped in this process (a child died of a signal)


def wanted() -> bool:
    """Whether this snapshot's host bytes go to a forked child instead of being copied."""
    if os.environ.get(MODE_ENV, "fork").strip().lower() == "copy":
        return False
    return _broken is None and hasattr(os, "fork") and sys.platform.startswith("linux")


# PyTorch's switch for its host allocator: large tensors in 2 MiB pages (MADV_HUGEPAGE), as
# NumPy does for large arrays. A fork then copies 512 times fewer page table entries (50 ms
# per 512 MiB of 4 KiB pages on a 2-core VM, 9 ms in huge pages), and the next cell's writes
# take no fault per 4 KiB page once the child is gone (280 ms against 21 ms).
THP_ENV = "THP_MEM_ALLOC_ENABLE"
_MADV_POPULATE_WRITE = 23  # Linux 5.14


def prefer_huge_pages() -> None:
    """Ask PyTorch for huge pages, unless the user said otherwise or it is loaded already
    (its allocator reads the switch once)."""
    if wanted() and "torch" not in sys.modules:
        os.environ.setdefault(THP_ENV, "1")


_libc_handle: Any = None


def _libc() -> Any:
    global _libc_handle
    if _libc_handle is None:
        _libc_handle = ctypes.CDLL(None, use_errno=True)
        _libc_handle.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong,
                                       ctypes.c_ulong, ctypes.c_ulong]
        _libc_handle.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return _libc_handle


def _writable_again(held: list[tuple[Any, int, int]]) -> None:
    """Make the notebook's pages that a child shared writable again in one call each: after a
    fork every page is write-protected, and the first write to each would fault (the child is
    gone, so nothing is copied; where the kernel lacks the call, the faults stay)."""
    page = mmap.PAGESIZE
    for _owner, address, nbytes in held:
        start_at = address - address % page
        _libc().madvise(start_at, address + nbytes - start_at, _MADV_POPULATE_WRITE)


def _readable(fd: int, timeout_s: float) -> bool:
    """Whether ``fd`` has data or its end (poll: descriptors past 1024 are fine)."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(timeout_s * 1000))


def _die_with_parent() -> Any:
    """prctl from libc, looked up in the parent: the child must not load libraries (the loader's
    lock may have been held by another thread at the fork)."""
    return _libc().prctl


class Child:
    """One forked child writing blobs ``names`` (name -> its temporary) into a blob folder."""

    def __init__(self, pid: int, status_fd: int, counter: mmap.mmap, blobs_fd: int,
                 names: dict[str, str], held: list[tuple[Any, int, int]]) -> None:
        self.pid = pid
        # The owners of the bytes (address, length) it writes, kept alive until it is gone: no
        # other object may take their memory while its pages are made writable again.
        self._held = held
        self._status_fd = status_fd
        self._counter = counter
        self._blobs_fd = blobs_fd
        self.names = names
        self._wanted = set(names)
        self._lock = threading.Lock()
        self._error: OSError | None = None
        self._reaped = False
        self._reported = 0

    def running(self) -> bool:
        """Whether the child has not said its last word yet (it does not block)."""
        with self._lock:
            if self._reaped:
                return False
            return not _readable(self._status_fd, 0)

    def wait(self, progress: Callable[[int], None] | None = None) -> None:
        """Return once the child wrote and synced its blobs; raise OSError when it did not
        (again for every later call: its bytes are gone with it)."""
        # Unlocked: only the job holding the child's blobs waits for it, and nobody drops it
        # meanwhile (a job holding a blob wants it); the lock stays free for running().
        status = b""
        while not self._reaped:
            readable = _readable(self._status_fd, _POLL_S)
            self._progress(progress)
            if readable:
                got = os.read(self._status_fd, _STATUS.size)
                if not got:
                    break
                status += got
        with self._lock:
            if not self._reaped:
                self._reap(status)
            if self._error is not None:
                raise self._error

    def settle(self) -> None:
        """Once it is gone: make the pages it shared writable again and let their owners go
        (in the writer's thread after the commit, not in the cell that would write next)."""
        with self._lock:
            if not self._reaped:
                return
            held, self._held = self._held, []
        _writable_again(held)

    def _progress(self, progress: Callable[[int], None] | None) -> None:
        (done,) = _STATUS.unpack_from(self._counter, 0)
        if progress is not None and done > self._reported:
            progress(done - self._reported)
        self._reported = max(self._reported, done)

    def drop(self, name: str) -> None:
        """Blob ``name`` is needed no more: once none is, a child still writing is killed."""
        with self._lock:
            self._wanted.discard(name)
            if self._wanted or self._reaped:
                return
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
            self._reap(b"")
            self._held = []

    def _reap(self, status: bytes) -> None:
        """Collect the child's exit (it has exited or is killed) and close what it used."""
        global _broken
        _, code = os.waitpid(self.pid, 0)
        self._reaped = True
        with _lock:
            _children.discard(self)
        if len(status) == _STATUS.size:
            (err,) = _STATUS.unpack(status)
            if err == _CHANGED:
                self._error = OSError(errno.EIO, "a buffer changed while the snapshot was taken")
            elif err:
                self._error = OSError(err, os.strerror(err))
        elif os.WIFSIGNALED(code) and os.WTERMSIG(code) != signal.SIGKILL:
            # Memory the child could not read (a mapping not inherited): copy from now on.
            _broken = f"the snapshot's writer died of signal {os.WTERMSIG(code)}"
            # Not a warning: this thread's output would land in whatever cell runs; the
            # failed write is told to the notebook by the hook.
            log.info("gpufrac: %s; checkpoints copy their bytes from now on", _broken)
            self._error = OSError(errno.EIO, _broken)
        else:
            self._error = OSError(errno.EIO, "the process writing the snapshot ended early")
        if self._error is not None:
            # A child killed or failed mid-write may leave a temporary; the whole blobs it wrote
            # are named by no state, and the writer deletes them after its next commit.
            for tmp in self.names.values():
                with contextlib.suppress(OSError):
                    os.unlink(tmp, dir_fd=self._blobs_fd)
        for fd in (self._status_fd, self._blobs_fd):
            os.close(fd)
        self._counter.close()


def writing() -> set[str]:
    """Blobs that children not yet waited for write: no sweep of unnamed blobs may take them
    (a later snapshot's child writes while the writer commits an earlier one)."""
    with _lock:
        return {name for child in _children for name in child.names} | _forking


def live() -> int:
    """Children still writing."""
    with _lock:
        children = list(_children)
    return sum(child.running() for child in children)


def _private_ranges() -> tuple[list[int], list[int]]:
    """Starts and ends of this process's private mappings (runs of adjacent ones merged): what
    a child sees as it was at the fork. A shared mapping (a memory-mapped file opened for
    writing, shared memory) keeps changing under the child, so its bytes are copied."""
    starts: list[int] = []
    ends: list[int] = []
    with open("/proc/self/maps", "rb") as fh:
        for line in fh:
            span, perms = line.split(b" ", 2)[:2]
            if perms[3:4] != b"p" or perms[:1] != b"r":
                continue
            low, high = (int(part, 16) for part in span.split(b"-"))
            if ends and ends[-1] == low:
                ends[-1] = high
            else:
                starts.append(low)
                ends.append(high)
    return starts, ends


def _inherited(address: int, nbytes: int, ranges: tuple[list[int], list[int]]) -> bool:
    starts, ends = ranges
    at = bisect.bisect_right(starts, address) - 1
    return at >= 0 and address + nbytes <= ends[at]


def start(staged: Mapping[str, store.Staged], folder: store.CheckpointDir) -> list[str]:
    """Fork one child to write the blobs of ``staged`` that are held by address; returns the
    names of those it cannot take (the caller copies them), all of them when it cannot fork."""
    items = {name: item for name, item in staged.items() if item.address}
    if not items:
        return []
    if not wanted() or live() >= MAX_CHILDREN:
        return list(items)
    try:
        ranges = _private_ranges()
    except OSError:
        return list(items)
    refused = [name for name, item in items.items()
               if not _inherited(item.address, item.nbytes, ranges)]
    for name in refused:
        del items[name]
    if not items:
        return refused
    tmps = {name: f"{uuid.uuid4().hex}{store.TMP_SUFFIX}" for name in items}
    plan = [(item.address, item.nbytes, tmps[name], name, item.digest)
            for name, item in items.items()]
    # The disk-full seam counts in the parent: a child's count would be lost with it.
    allowed = store.allowance(sum(item.nbytes for item in items.values()))
    prctl = _die_with_parent()
    parent = os.getpid()
    opened: list[int] = []
    counter = mmap.mmap(-1, _STATUS.size)  # shared: the child's progress
    with _lock:
        _forking.update(tmps)
    try:
        opened.append(os.dup(folder.blobs_fd))
        opened += os.pipe()
        blobs_fd, read_fd, write_fd = opened
        with warnings.catch_warnings():
            # Python 3.12 warns about fork in a threaded process: the child runs no code that
            # takes a lock another thread could hold (no logging, torch, zmq or our own locks),
            # only system calls on memory and descriptors, and leaves by os._exit.
            warnings.filterwarnings("ignore", category=DeprecationWarning,
                                    message=r".*multi-threaded.*fork\(\)")
            pid = os.fork()
    except OSError as exc:  # ENOMEM, EAGAIN, EMFILE: copy instead
        with _lock:
            _forking.clear()
        log.info("gpufrac: fork for a snapshot failed (%s); copying its bytes", exc)
        for fd in opened:
            os.close(fd)
        counter.close()
        return [*items, *refused]
    if pid == 0:
        _child(plan, blobs_fd, write_fd, counter, allowed, parent, prctl)
    os.close(write_fd)
    child = Child(pid, read_fd, counter, blobs_fd, tmps,
                  [(item.data, item.address, item.nbytes) for item in items.values()])
    with _lock:
        _children.add(child)
        _forking.clear()
    for name, item in items.items():
        item.child = child
        item.data = None  # the child holds their owner (see Child)
        item.release = _dropper(child, name)
    return refused


def _dropper(child: Child, name: str) -> Callable[[], None]:
    return lambda: child.drop(name)


def _child(plan: list[tuple[int, int, str, str, str | None]], blobs_fd: int, status_fd: int,
           counter: mmap.mmap, allowed: int, parent: int, prctl: Any) -> NoReturn:
    """Write ``plan``'s bytes (address, length, temporary, name, digest): each into its
    temporary, synced, renamed; then the folder synced; say how it went and leave."""
    code = 0
    tmp = ""
    try:
        # A kernel killed with SIGKILL must leave no writer behind.
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:
            os._exit(1)
        done = 0
        for address, nbytes, tmp, name, digest in plan:
            view = memoryview((ctypes.c_char * nbytes).from_address(address)).cast("B")
            hasher = hashlib.blake2b(digest_size=20) if digest is not None else None
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                         0o600, dir_fd=blobs_fd)
            try:
                for start_at in range(0, nbytes, store.WRITE_CHUNK):
                    chunk = view[start_at:start_at + store.WRITE_CHUNK]
                    if store.SLOW_WRITE_S and len(chunk) >= 1024 * 1024:
                        time.sleep(store.SLOW_WRITE_S)
                    if hasher is not None:
                        hasher.update(chunk)
                    if allowed < len(chunk):
                        raise OSError(errno.ENOSPC, "no space")
                    allowed -= len(chunk)
                    written = 0
                    while written < len(chunk):
                        written += os.write(fd, chunk[written:])
                    done += len(chunk)
                    _STATUS.pack_into(counter, 0, done)
                os.fsync(fd)
            finally:
                os.close(fd)
            if hasher is not None and hasher.hexdigest() != digest:
                code = _CHANGED
                break
            os.replace(tmp, name, src_dir_fd=blobs_fd, dst_dir_fd=blobs_fd)
            tmp = ""
        if not code:
            os.fsync(blobs_fd)
    except OSError as exc:
        code = exc.errno or errno.EIO
    except BaseException:
        code = errno.EIO
    if tmp:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=blobs_fd)
    with contextlib.suppress(OSError):
        os.write(status_fd, _STATUS.pack(code))
    os._exit(0)
