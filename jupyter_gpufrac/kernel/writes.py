"""Which of the notebook's buffers were written since last looked at, as the kernel tracks pages."""

from __future__ import annotations

import bisect
import contextlib
import ctypes
import errno
import logging
import mmap
import os
import threading

log = logging.getLogger(__name__)

# Set to "off" to track nothing (the checkpoint then hashes buffers to find what changed).
MODE_ENV = "GPUFRAC_WRITE_WATCH"

# Userfaultfd write-protection in its asynchronous mode, read back with PAGEMAP_SCAN: Linux's
# uapi (include/uapi/linux/userfaultfd.h, fs.h); both came with Linux 6.7
# (Documentation/admin-guide/mm/userfaultfd.rst and pagemap.rst).
_SYSCALL = {"x86_64": 323, "aarch64": 282}
_UFFD_USER_MODE_ONLY = 1  # needs no privilege (vm.unprivileged_userfaultfd = 0 allows it)
_UFFD_API = 0xAA
_FEATURE_WP_UNPOPULATED = 1 << 13
_FEATURE_WP_ASYNC = 1 << 15
_REGISTER_MODE_WP = 1 << 1
_WRITEPROTECT_MODE_WP = 1 << 0
_PM_SCAN_WP_MATCHING = 1 << 0
_PM_SCAN_CHECK_WPASYNC = 1 << 1
_PAGE_IS_WRITTEN = 1 << 1
_REGIONS = 256  # page ranges read back per PAGEMAP_SCAN call
_MADV_COLLAPSE = 25  # include/uapi/asm-generic/mman-common.h
_HUGE = 2 * 1024 * 1024  # a PMD's huge page on x86_64 and arm64 with 4 KiB pages


def _ioc(direction: int, kind: int, number: int, size: int) -> int:
    """An ioctl request number, as <asm-generic/ioctl.h> builds it (2: read, 3: read and write)."""
    return (direction << 30) | (size << 16) | (kind << 8) | number


_UFFDIO_API = _ioc(3, 0xAA, 0x3F, 24)
_UFFDIO_REGISTER = _ioc(3, 0xAA, 0x00, 32)
_UFFDIO_UNREGISTER = _ioc(2, 0xAA, 0x01, 16)
_UFFDIO_WRITEPROTECT = _ioc(3, 0xAA, 0x06, 24)
_PAGEMAP_SCAN = _ioc(3, ord("f"), 16, 96)


class _Range(ctypes.Structure):
    _fields_ = [("start", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _Api(ctypes.Structure):
    _fields_ = [("api", ctypes.c_uint64), ("features", ctypes.c_uint64),
                ("ioctls", ctypes.c_uint64)]


class _Register(ctypes.Structure):
    _fields_ = [("range", _Range), ("mode", ctypes.c_uint64), ("ioctls", ctypes.c_uint64)]


class _WriteProtect(ctypes.Structure):
    _fields_ = [("range", _Range), ("mode", ctypes.c_uint64)]


class _Region(ctypes.Structure):
    _fields_ = [("start", ctypes.c_uint64), ("end", ctypes.c_uint64),
                ("categories", ctypes.c_uint64)]


class _Scan(ctypes.Structure):
    _fields_ = [("size", ctypes.c_uint64), ("flags", ctypes.c_uint64),
                ("start", ctypes.c_uint64), ("end", ctypes.c_uint64),
                ("walk_end", ctypes.c_uint64), ("vec", ctypes.c_uint64),
                ("vec_len", ctypes.c_uint64), ("max_pages", ctypes.c_uint64),
                ("category_inverted", ctypes.c_uint64), ("category_mask", ctypes.c_uint64),
                ("category_anyof_mask", ctypes.c_uint64), ("return_mask", ctypes.c_uint64)]


def _pages(address: int, nbytes: int) -> tuple[int, int]:
    """The whole pages that hold ``nbytes`` at ``address`` (start, length)."""
    page = mmap.PAGESIZE
    start = address - address % page
    end = -(-(address + nbytes) // page) * page
    return start, end - start


class Anonymous:
    """This process's private anonymous mappings (runs of adjacent ones merged), as read once
    from /proc/self/maps: only there is every write one of this process's own. A file or shared
    mapping (``numpy.memmap``, shared memory, a tensor moved to shared memory) can be written
    by another process or through the file, which no page mark of ours sees."""

    def __init__(self) -> None:
        self.starts: list[int] = []
        self.ends: list[int] = []
        with open("/proc/self/maps", "rb") as fh:
            for line in fh:
                fields = line.split(maxsplit=5)
                if len(fields) < 5 or fields[1][3:4] != b"p" or fields[4] != b"0":
                    continue
                low, high = (int(part, 16) for part in fields[0].split(b"-"))
                if self.ends and self.ends[-1] == low:
                    self.ends[-1] = high
                else:
                    self.starts.append(low)
                    self.ends.append(high)

    def holds(self, address: int, nbytes: int) -> bool:
        """Whether the pages of ``nbytes`` at ``address`` are all private and anonymous."""
        start, length = _pages(address, nbytes)
        at = bisect.bisect_right(self.starts, start) - 1
        return at >= 0 and start + length <= self.ends[at]


class WriteWatch:
    """Buffers the kernel tracks writes to, page by page.

    A watched buffer's pages are write-protected; the first write to each page after that is
    let through by the kernel at once (no thread of ours handles it: the asynchronous mode) and
    marks the page written, at the cost of one page fault. :meth:`written` reads the marks back
    and, asked to, protects the written pages again, in one call that no write can slip between.
    Pages are whole: a write next to a buffer, in a page it shares, counts as a write to it
    (a change found where there was none costs a copy, never a lost change). Where anything is
    in doubt (the buffer is no longer watched, its memory was moved or unmapped) the answer is
    None, never "not written".
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tried = False
        self._uffd = -1
        self._pagemap = -1
        self.why_not: str | None = None  # why nothing is tracked, once tried
        self._libc: ctypes.CDLL | None = None

    def usable(self) -> bool:
        """Whether this process can track writes (tried once)."""
        with self._lock:
            if not self._tried:
                self._tried = True
                self.why_not = self._open()
                if self.why_not is not None:
                    log.info("gpufrac: writes to buffers are not tracked (%s); checkpoints hash "
                             "them to find what changed", self.why_not)
            return self.why_not is None

    def _open(self) -> str | None:
        if os.environ.get(MODE_ENV, "").strip().lower() == "off":
            return f"{MODE_ENV}=off"
        number = _SYSCALL.get(os.uname().machine)
        if number is None:
            return f"not on {os.uname().machine}"
        libc = ctypes.CDLL(None, use_errno=True)
        libc.syscall.restype = ctypes.c_long
        libc.ioctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p]
        libc.ioctl.restype = ctypes.c_int
        self._libc = libc
        fd = int(libc.syscall(number, os.O_CLOEXEC | os.O_NONBLOCK | _UFFD_USER_MODE_ONLY))
        if fd < 0:
            return f"userfaultfd: {os.strerror(ctypes.get_errno())}"
        wanted = _FEATURE_WP_ASYNC | _FEATURE_WP_UNPOPULATED
        api = _Api(_UFFD_API, wanted, 0)
        if libc.ioctl(fd, _UFFDIO_API, ctypes.byref(api)) != 0 or api.features & wanted != wanted:
            err = ctypes.get_errno()
            os.close(fd)
            return f"asynchronous write-protection is not offered ({os.strerror(err)}; Linux 6.7+)"
        try:
            pagemap = os.open("/proc/self/pagemap", os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            os.close(fd)
            return f"/proc/self/pagemap: {exc.strerror}"
        self._uffd, self._pagemap = fd, pagemap
        return None

    def _ioctl(self, fd: int, request: int, arg: ctypes.Structure) -> int:
        assert self._libc is not None
        if self._libc.ioctl(fd, request, ctypes.byref(arg)) == 0:
            return 0
        return ctypes.get_errno() or errno.EIO

    def watch(self, address: int, nbytes: int, anonymous: Anonymous) -> bool:
        """Track writes to the pages of ``nbytes`` at ``address``; False where they cannot be
        (not private anonymous memory, tracked by another, or nothing is tracked here)."""
        if nbytes <= 0 or not anonymous.holds(address, nbytes) or not self.usable():
            return False
        start, length = _pages(address, nbytes)
        register = _Register(_Range(start, length), _REGISTER_MODE_WP, 0)
        if self._ioctl(self._uffd, _UFFDIO_REGISTER, register):
            return False
        if self._ioctl(self._uffd, _UFFDIO_WRITEPROTECT,
                       _WriteProtect(_Range(start, length), _WRITEPROTECT_MODE_WP)):
            self.unwatch(address, nbytes)
            return False
        return True

    def unwatch(self, address: int, nbytes: int) -> None:
        """Stop tracking those pages (their writes cost nothing again)."""
        if nbytes <= 0 or self._uffd < 0:
            return
        start, length = _pages(address, nbytes)
        # ENOMEM or EINVAL: unmapped since, or partly; nothing of it is tracked then.
        self._ioctl(self._uffd, _UFFDIO_UNREGISTER, _Range(start, length))

    def collapse(self, address: int, nbytes: int) -> None:
        """Give the buffer's memory back its huge pages (those whole within it), which a watch
        split: the first write to each protected page makes it a page of its own, and a buffer
        updated cell after cell then runs 1.6x slower here for its TLB misses. Best effort
        (``MADV_COLLAPSE``, Linux 6.1+): where it cannot, the pages stay as they are."""
        if self._libc is None or nbytes < _HUGE:
            return
        start = -(-address // _HUGE) * _HUGE
        end = (address + nbytes) // _HUGE * _HUGE
        if end > start:
            self._libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start),
                               _MADV_COLLAPSE)

    def written(self, address: int, nbytes: int, *, protect_again: bool) -> int | None:
        """How many pages of the buffer were written since it was watched or last protected
        again (without ``protect_again``, 1 stands for "some": the scan stops at the first);
        with ``protect_again`` its written pages are protected again in the same call. None
        when it is not (or no longer wholly) watched."""
        if nbytes <= 0 or self._pagemap < 0:
            return None
        start, length = _pages(address, nbytes)
        end = start + length
        regions = (_Region * _REGIONS)()
        flags = _PM_SCAN_CHECK_WPASYNC | (_PM_SCAN_WP_MATCHING if protect_again else 0)
        pages = 0
        while start < end:
            scan = _Scan(ctypes.sizeof(_Scan), flags, start, end, 0, ctypes.addressof(regions),
                         _REGIONS if protect_again else 1, 0 if protect_again else 1,
                         0, _PAGE_IS_WRITTEN, 0, _PAGE_IS_WRITTEN)
            assert self._libc is not None
            count = self._libc.ioctl(self._pagemap, _PAGEMAP_SCAN, ctypes.byref(scan))
            if count < 0:
                return None  # EPERM: a page not watched (unregistered, remapped, unmapped)
            pages += sum((regions[i].end - regions[i].start) // mmap.PAGESIZE
                         for i in range(count))
            if pages and not protect_again:
                return pages
            if scan.walk_end <= start:
                return None
            start = scan.walk_end
        return pages

    def close(self) -> None:
        """Stop tracking everything (the kernel process ends, or a test is done)."""
        with self._lock:
            for fd in (self._uffd, self._pagemap):
                if fd >= 0:
                    with contextlib.suppress(OSError):
                        os.close(fd)
            self._uffd = self._pagemap = -1
            self._tried = False
            self.why_not = None


WATCH = WriteWatch()
