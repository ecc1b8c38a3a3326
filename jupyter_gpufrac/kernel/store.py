"""On-disk checkpoint store: owner-only directories held open, atomic files and tensor blobs."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import io
import mmap
import os
import stat
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import IO, Any

STATE_FILE = "checkpoint.gfc"
# When or after which cell the committed state was last found current (JSON, not durable).
SEEN_FILE = "checkpoint.seen"
CELLS_FILE = "cells.json"
BLOB_DIR = "blobs"
TMP_SUFFIX = ".tmp"
# Beside the kernel folders of one checkpoint root (one user's): a link to every content-
# addressed blob a kernel wrote, so that another kernel storing the same bytes links them.
CONTENT_DIR = ".gpufrac-content"

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# O_NONBLOCK: opening a FIFO put in place of a file must not hang; it is refused after fstat.
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
_CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_SYNC_THREADS = 8  # fsyncs under way at once (see BlobSync)
WRITE_CHUNK = 8 * 1024 * 1024  # bytes per write call: progress is counted between them

# A test seam: checkpoint writes fail with ENOSPC once this many more bytes have been written
# (a disk that fills mid-write). Set with inject_enospc_after, or by the environment variable
# below for a kernel started by a test. None: never.
ENOSPC_ENV = "GPUFRAC_TEST_ENOSPC_AFTER"
_fault_lock = threading.Lock()
_enospc_left: int | None = None
if os.environ.get(ENOSPC_ENV, "").strip().isdigit():
    _enospc_left = int(os.environ[ENOSPC_ENV])


# Another: each write of a chunk of at least a MiB first sleeps this long (a slow disk, so a
# test can act while a checkpoint is being written).
SLOW_ENV = "GPUFRAC_TEST_SLOW_WRITE_S"
SLOW_WRITE_S = float(os.environ.get(SLOW_ENV, "0") or 0)


def inject_enospc_after(nbytes: int | None) -> None:
    """Make checkpoint writes raise OSError(ENOSPC) after ``nbytes`` more bytes (None: stop)."""
    global _enospc_left
    with _fault_lock:
        _enospc_left = nbytes


def allowance(wanted: int) -> int:
    """How much of ``wanted`` bytes the disk takes (all of them, unless a fault is injected)."""
    global _enospc_left
    if _enospc_left is None:
        return wanted
    with _fault_lock:
        if _enospc_left is None:
            return wanted
        took = min(wanted, _enospc_left)
        _enospc_left -= took
        return took


def write_all(fh: IO[bytes] | io.FileIO, data: memoryview | bytes,
              progress: Callable[[int], None] | None = None) -> None:
    """Write all of ``data`` in chunks (``progress`` told of each); every checkpoint write goes
    through here or :func:`write_direct`, so a test can make the disk fill
    (:func:`inject_enospc_after`)."""
    view = memoryview(data).cast("B")
    while view:
        chunk = view[:WRITE_CHUNK]
        allowed = _admit(len(chunk))
        done = 0
        while done < allowed:
            done += fh.write(chunk[done:allowed]) or 0
        if allowed < len(chunk):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        if progress is not None:
            progress(len(chunk))
        view = view[len(chunk):]


def _admit(size: int) -> int:
    """How much of a chunk of ``size`` bytes to write now: all of it, unless a test slows the
    disk (``SLOW_WRITE_S``) or fills it (:func:`inject_enospc_after`)."""
    if SLOW_WRITE_S and size >= 1024 * 1024:
        time.sleep(SLOW_WRITE_S)
    return allowance(size)


# While someone waits for a checkpoint (a move, a park, a flush), large blobs bypass the page
# cache (O_DIRECT): a GiB through it took 2.5-5x as long here, throttled to what writeback
# had cleaned. Otherwise they go through it: that throttling is what keeps a background write
# out of the notebook's way (direct, a cell making a new 4 GiB tensor beside it ran 1.5-2.5x
# a stock kernel's time, against 1.0-1.4x). Direct writes need aligned offsets, lengths and
# memory: the bytes go through an aligned buffer, and an unaligned tail through the page cache
# (fsync makes both durable).
DIRECT_MIN = 16 * 1024 * 1024
_ALIGN = 4096


def write_direct(fh: io.FileIO, data: memoryview | bytes,
                 progress: Callable[[int], None] | None, hurried: Callable[[], bool]) -> None:
    """:func:`write_all` to an unbuffered file, a chunk at a time bypassing the page cache
    while ``hurried()`` says so and the file system allows it."""
    view = memoryview(data).cast("B")
    if len(view) < DIRECT_MIN:
        write_all(fh, view, progress)
        return
    fd = fh.fileno()
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    direct = refused = False
    try:
        with mmap.mmap(-1, WRITE_CHUNK) as bounce, memoryview(bounce) as buffer:
            while len(view) >= _ALIGN:
                size = min(WRITE_CHUNK, len(view) - len(view) % _ALIGN)
                want = hurried() and not refused
                if want != direct:
                    if _set_flags(fd, flags | os.O_DIRECT if want else flags):
                        direct = want
                    else:
                        refused = True  # a file system without direct I/O
                if not direct:  # whole chunks keep the offset aligned for a later direct one
                    write_all(fh, view[:size], progress)
                    view = view[size:]
                    continue
                if _admit(size) < size:
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                buffer[:size] = view[:size]
                done = 0
                while done < size:  # a short direct write still ends on a block boundary
                    done += os.write(fd, buffer[done:size])
                if progress is not None:
                    progress(size)
                view = view[size:]
    finally:
        if direct:
            _set_flags(fd, flags)
    write_all(fh, view, progress)


def _set_flags(fd: int, flags: int) -> bool:
    """Set a descriptor's status flags; False where the file system refuses (no O_DIRECT)."""
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, flags)
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        return False
    return True


class UnsafeCheckpointError(Exception):
    """A checkpoint path that another user could have written: loading it would run their code."""


def _check(st: os.stat_result, shown: Path, *, directory: bool) -> None:
    """Refuse a file or directory that is not ours alone.

    Unpickling runs code, so a file that someone else could have put there is never trusted.
    """
    kind = "directory" if directory else "file"
    if not (stat.S_ISDIR(st.st_mode) if directory else stat.S_ISREG(st.st_mode)):
        raise UnsafeCheckpointError(f"refusing checkpoint {kind} {shown}: not a regular {kind}")
    uid = os.geteuid()
    if st.st_uid != uid:
        raise UnsafeCheckpointError(
            f"refusing checkpoint {kind} {shown}: it belongs to uid {st.st_uid}, not to you "
            f"(uid {uid}); unpickling it would run code that another user could have written"
        )
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise UnsafeCheckpointError(
            f"refusing checkpoint {kind} {shown}: it is writable by group or others "
            f"(owner uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):04o}); fix it with "
            f"`chmod go-w {shown}` if you trust its contents"
        )


def _open_checked(name: str | Path, flags: int, dir_fd: int | None, shown: Path, *,
                  directory: bool) -> int:
    """Open ``name`` without following a symbolic link in its last component, then check it."""
    try:
        fd = os.open(name, flags, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno not in (errno.ELOOP, errno.ENOTDIR, errno.EACCES):
            raise
        # A link (ELOOP from O_NOFOLLOW, ENOTDIR from O_DIRECTORY) is refused, and so is another
        # user's file we may not open (EACCES). The lstat only words why: it opens nothing.
        kind = "directory" if directory else "file"
        try:
            st: os.stat_result | None = os.lstat(name, dir_fd=dir_fd)
        except OSError:
            st = None
        if st is not None and stat.S_ISLNK(st.st_mode):
            raise UnsafeCheckpointError(
                f"refusing checkpoint {kind} {shown}: it is a symbolic link") from exc
        if st is not None:
            _check(st, shown, directory=directory)
        if exc.errno == errno.EACCES:
            raise  # our own file, unreadable: not an attack
        raise UnsafeCheckpointError(
            f"refusing checkpoint {kind} {shown}: it was a symbolic link or not a {kind} when "
            f"opened (was it replaced just then?)") from exc
    try:
        # On the descriptor: what is checked is what is read, whatever is renamed meanwhile.
        _check(os.fstat(fd), shown, directory=directory)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _blob_name(name: str) -> str:
    # Names come from the state file: none may leave the blob folder or hit a temporary.
    if "/" in name or name.startswith(".") or not name.endswith(".bin"):
        raise UnsafeCheckpointError(f"refusing blob name {name!r} in the checkpoint")
    return name


def _mkdir_private(name: str | Path, dir_fd: int | None) -> bool:
    """Create a 0700 directory; False when it was there already."""
    try:
        os.mkdir(name, 0o700, dir_fd=dir_fd)
    except FileExistsError:
        return False
    return True


def open_private_dir(path: Path, *, create: bool = False) -> int:
    """A descriptor of folder ``path``, checked ours alone (0700 when ``create`` makes it,
    with its parents); raises UnsafeCheckpointError, FileNotFoundError."""
    path = Path(path)
    if not create:
        return _open_checked(path, _DIR_FLAGS, None, path, directory=True)
    parent = make_private_dirs(path.parent)
    try:
        return _made_or_checked(path.name, parent, path)
    finally:
        os.close(parent)


def _made_or_checked(name: str, parent_fd: int, shown: Path) -> int:
    """Folder ``name`` of ``parent_fd``, made 0700 when missing, opened and checked ours
    alone."""
    created = _mkdir_private(name, parent_fd)
    fd = _open_checked(name, _DIR_FLAGS, parent_fd, shown, directory=True)
    if created:
        # mkdir's mode is filtered by the umask (and a setgid parent adds its bit): say
        # exactly what we want.
        try:
            os.fchmod(fd, 0o700)
        except BaseException:
            os.close(fd)
            raise
    return fd


def make_private_dirs(path: Path) -> int:
    """A descriptor of folder ``path``; the folders missing on the way are made 0700 one by
    one, each under its parent's descriptor and opened without following a link, so none can
    be swapped between its making and its use (what exists already is opened as named)."""
    path = Path(os.path.abspath(path))
    missing: list[str] = []
    existing = path
    while not os.path.lexists(existing) and existing != existing.parent:
        missing.append(existing.name)
        existing = existing.parent
    fd = os.open(existing, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    for name in reversed(missing):
        existing = existing / name
        try:
            sub = _made_or_checked(name, fd, existing)
        finally:
            os.close(fd)
        fd = sub
    return fd


def folder_problem(path: Path) -> str | None:
    """Why folder ``path`` must not hold our files, with the fix, for people; None when it is
    ours alone or missing. Only the last component is looked at (not followed if a link)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        return f"{path} cannot be checked ({exc.strerror}); fix its permissions"
    uid = os.geteuid()
    if stat.S_ISLNK(st.st_mode):
        return (f"{path} is a symbolic link, which could lead anywhere; fix: remove the link "
                f"(`rm {path}`) and let the server create the folder")
    if not stat.S_ISDIR(st.st_mode):
        return f"{path} is not a folder; fix: remove it and let the server create the folder"
    if st.st_uid != uid:
        return (f"{path} belongs to another user (uid {st.st_uid}), not to you (uid {uid}); "
                "fix: remove it, another user owns it (ask them or an administrator to), and "
                "let the server create it")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return (f"{path} is writable by group or others (mode "
                f"{stat.S_IMODE(st.st_mode):04o}), so another user could replace what is in "
                f"it; fix: `chmod 700 {path}`")
    return None


class CheckpointDir:
    """A checked checkpoint directory and its blob folder, held open.

    Everything below the root is reached through these descriptors, never by path again: an
    attacker who can rename the root's parents can at most make the open refuse, not redirect a
    read or write that follows a check. Open one per checkpoint or restore, and close it.
    """

    def __init__(self, path: Path, root_fd: int, blobs_fd: int) -> None:
        self.path = path
        self.root_fd = root_fd
        self.blobs_fd = blobs_fd

    @classmethod
    def open(cls, path: Path, *, create: bool = False, blobs: bool = True) -> CheckpointDir:
        """Open and check ``path`` and its blob folder; ``create`` makes missing ones 0700.
        Without ``blobs`` only ``path`` (a folder of small files: no blob may be named).

        Raises UnsafeCheckpointError for a directory that is a link, not ours or writable by
        others, FileNotFoundError for a missing one.
        """
        path = Path(path)
        # A folder with blobs is a kernel's, in a checkpoint root: that root is checked too.
        root = open_kernel_dir(path) if create and blobs else open_private_dir(path, create=create)
        if not blobs:
            return cls(path, root, -1)
        try:
            blobs_created = create and _mkdir_private(BLOB_DIR, root)
            blobs_fd = _open_checked(BLOB_DIR, _DIR_FLAGS, root, path / BLOB_DIR, directory=True)
            if blobs_created:
                os.fchmod(blobs_fd, 0o700)
        except BaseException:
            os.close(root)
            raise
        return cls(path, root, blobs_fd)

    def dup(self) -> CheckpointDir:
        """The same directories under descriptors of their own (for another thread to close)."""
        root = os.dup(self.root_fd)
        try:
            return CheckpointDir(self.path, root,
                                 os.dup(self.blobs_fd) if self.blobs_fd >= 0 else -1)
        except BaseException:
            os.close(root)
            raise

    def close(self) -> None:
        """Close both descriptors."""
        for fd in (self.blobs_fd, self.root_fd):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self.root_fd = self.blobs_fd = -1

    def __enter__(self) -> CheckpointDir:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        self.close()

    def _where(self, name: str, blob: bool) -> tuple[int, Path]:
        if blob:
            return self.blobs_fd, self.path / BLOB_DIR / _blob_name(name)
        return self.root_fd, self.path / name

    def open_read(self, name: str, *, blob: bool = False) -> io.FileIO:
        """``name`` (a blob with ``blob``) opened for reading, checked before any byte is read."""
        dir_fd, shown = self._where(name, blob)
        fd = _open_checked(name, _READ_FLAGS, dir_fd, shown, directory=False)
        return os.fdopen(fd, "rb", buffering=0)

    def read_bytes(self, name: str, *, blob: bool = False) -> bytes:
        """The whole of ``name``, checked first."""
        with self.open_read(name, blob=blob) as fh:
            return fh.readall()

    def create(self, name: str, *, blob: bool = False) -> io.FileIO:
        """A new file ``name`` (0600) open for writing; fails if anything has that name."""
        dir_fd, _ = self._where(name, blob)
        return os.fdopen(os.open(name, _CREATE_FLAGS, 0o600, dir_fd=dir_fd), "wb", buffering=0)

    def exists(self, name: str, *, blob: bool = False) -> bool:
        """Whether something is named ``name`` (a link is not followed)."""
        dir_fd, _ = self._where(name, blob)
        try:
            os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            return False
        return True

    @contextlib.contextmanager
    def atomic_writer(self, name: str, *, blob: bool = False,
                      durable: bool = True) -> Iterator[IO[bytes]]:
        """Write to a temporary sibling, then rename over ``name``: readers see old or new.

        A kill mid-write leaves only a ``*.tmp`` file behind, which :meth:`remove_stale_tmp`
        cleans.
        """
        dir_fd, _ = self._where(name, blob)
        tmp = f"{name}.{uuid.uuid4().hex[:8]}{TMP_SUFFIX}"
        fd = os.open(tmp, _CREATE_FLAGS, 0o600, dir_fd=dir_fd)
        try:
            with os.fdopen(fd, "wb", buffering=1024 * 1024) as fh:
                yield fh
                fh.flush()
                if durable:
                    os.fsync(fh.fileno())
            os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp, dir_fd=dir_fd)
            raise
        if durable:
            os.fsync(dir_fd)

    def write_bytes_atomic(self, name: str, data: bytes, *, blob: bool = False,
                           durable: bool = True) -> None:
        """Replace ``name`` with ``data`` atomically."""
        with self.atomic_writer(name, blob=blob, durable=durable) as fh:
            write_all(fh, data)

    def overwrite(self, name: str, data: bytes) -> None:
        """Write ``data`` over the start of ``name`` in place (created 0600 if missing): no new
        file, no rename, no fsync. For a small note that may be lost or torn, not for state."""
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK,
                     0o600, dir_fd=self.root_fd)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise UnsafeCheckpointError(f"refusing checkpoint file {self.path / name}: "
                                            "not a regular file")
            os.pwrite(fd, data, 0)
        finally:
            os.close(fd)

    def create_tmp(self, *, blob: bool = False) -> tuple[str, io.FileIO]:
        """A new temporary file (0600) open for writing: (its name, the file).

        It becomes a file of the checkpoint only by :meth:`publish`; one left by a killed
        writer is deleted by :meth:`remove_stale_tmp`.
        """
        dir_fd = self.blobs_fd if blob else self.root_fd
        name = f"{uuid.uuid4().hex}{TMP_SUFFIX}"
        return name, os.fdopen(os.open(name, _CREATE_FLAGS, 0o600, dir_fd=dir_fd), "wb",
                               buffering=0)

    def publish(self, tmp: str, name: str, *, blob: bool = False) -> None:
        """Rename temporary ``tmp`` to ``name`` (replacing a file of that name: a content-
        addressed blob left by a writer that never committed it may be incomplete)."""
        dir_fd, _ = self._where(name, blob)
        os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)

    def commit(self, name: str, data: bytes, *, blobs: BlobSync | None = None) -> None:
        """Replace ``name`` with ``data`` atomically and durably, once ``blobs`` are durable.

        The new file is written and synced while the blobs it names finish syncing; only the
        rename makes it the one readers see, and it happens after all of them are on disk.
        """
        tmp, fh = self.create_tmp()
        try:
            with fh:
                write_all(fh, data)
                os.fsync(fh.fileno())
            if blobs is not None:
                blobs.wait()
            os.replace(tmp, name, src_dir_fd=self.root_fd, dst_dir_fd=self.root_fd)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp, dir_fd=self.root_fd)
            raise
        os.fsync(self.root_fd)

    def identity(self, name: str, *, blob: bool = False) -> tuple[int, int, int, int] | None:
        """(device, inode, size, mtime) of ``name``, or None: whether it is still the file
        this process wrote."""
        dir_fd, _ = self._where(name, blob)
        try:
            st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            return None
        return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)

    def remove_stale_tmp(self) -> None:
        """Delete temporaries left by a writer that was killed."""
        for dir_fd in (self.root_fd, self.blobs_fd):
            for name in os.listdir(dir_fd):
                if name.endswith(TMP_SUFFIX):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(name, dir_fd=dir_fd)

    def unreferenced_blobs(self, keep: set[str]) -> list[str]:
        """Blobs that the committed checkpoint does not name (replaced, or left by a killed
        writer)."""
        return [name for name in os.listdir(self.blobs_fd)
                if name.endswith(".bin") and name not in keep]

    def remove_blobs(self, names: Iterable[str]) -> None:
        """Unlink blobs ``names``, ignoring those already gone."""
        for name in names:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(_blob_name(name), dir_fd=self.blobs_fd)


class ContentStore:
    """The content-addressed blobs that one user's kernels share, by hard links.

    A kernel that wrote such a blob and committed a state naming it links it here; a kernel
    about to write a blob of the same name links this one into its own folder instead (the
    bytes are on disk once). The folder is the user's alone (checked as a checkpoint folder
    is), and only regular files of the user's are linked: another user's file is never
    taken. Where linking fails (another filesystem, a filesystem without hard links, a
    policy) each kernel keeps its own copy. A file here that no kernel folder links any more
    (``st_nlink`` 1) is removed by the retention sweep.
    """

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self.fd = fd

    @classmethod
    def open(cls, kernel_dir: Path) -> ContentStore | None:
        """The store of the checkpoint root that holds ``kernel_dir``; None when it cannot be
        used (then nothing is shared)."""
        path = Path(kernel_dir).parent / CONTENT_DIR
        try:
            return cls(path, open_private_dir(path, create=True))
        except (OSError, UnsafeCheckpointError):
            return None

    def close(self) -> None:
        """Close the folder's descriptor."""
        if self.fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self.fd)
        self.fd = -1

    def __enter__(self) -> ContentStore:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        self.close()

    def link_into(self, folder: CheckpointDir, name: str, as_name: str | None = None) -> bool:
        """Make ``folder``'s blob ``as_name`` (by default ``name``) the store's file ``name``
        (a hard link, renamed over whatever ``folder`` held); False when the store has none
        that may be used."""
        target = as_name or name
        try:
            fd = _open_checked(_blob_name(name), _READ_FLAGS, self.fd, self.path / name,
                               directory=False)
        except (OSError, UnsafeCheckpointError):
            return False
        tmp = f"{uuid.uuid4().hex}{TMP_SUFFIX}"
        try:
            checked = os.fstat(fd)
            mine = folder.identity(target, blob=True)
            if mine is not None and mine[:2] == (checked.st_dev, checked.st_ino):
                return True
            os.link(name, tmp, src_dir_fd=self.fd, dst_dir_fd=folder.blobs_fd,
                    follow_symlinks=False)
            linked = os.stat(tmp, dir_fd=folder.blobs_fd, follow_symlinks=False)
            if (linked.st_dev, linked.st_ino) != (checked.st_dev, checked.st_ino):
                raise OSError(errno.EAGAIN, "replaced while it was linked")
            folder.publish(tmp, target, blob=True)
            return True
        except OSError:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=folder.blobs_fd)
            return False
        finally:
            os.close(fd)

    def share(self, folder: CheckpointDir, name: str, stored_as: str | None = None) -> None:
        """Offer ``folder``'s durable blob ``name`` to the other kernels, as the store's file
        ``stored_as`` (by default ``name``); when the store has one already, take that one
        instead (so the bytes are on disk once)."""
        shared = stored_as or name
        try:
            os.link(_blob_name(name), shared, src_dir_fd=folder.blobs_fd, dst_dir_fd=self.fd,
                    follow_symlinks=False)
        except FileExistsError:
            self.link_into(folder, shared, name)
        except OSError:
            pass  # EXDEV, EPERM, no hard links here: the kernel keeps its own copy


@dataclass
class Staged:
    """A blob's bytes as a snapshot holds them until its writer writes them: a private copy
    (``data``), or bytes to compress first (``compress``); ``ready`` waits for a copy still
    under way (a GPU copy ordered on its stream), ``release`` gives the copy's memory back."""

    data: Any
    nbytes: int
    compress: bool = False
    pack: bool = False  # pickles of groups (counted apart from tensors and buffers)
    ready: Callable[[], None] | None = None
    release: Callable[[], None] | None = None
    # Named afresh, but shared with the user's other kernels under its content's name: the
    # writer hashes the bytes (the snapshot did not), links an equal blob instead of writing,
    # and tells ``hashed`` the digest.
    shared: bool = False
    hashed: Callable[[str], None] | None = None
    # Held, not copied: ``data`` is the notebook's own memory (``keep`` its owner), written as
    # it is and good only while ``valid()`` says nothing wrote it since the snapshot.
    valid: Callable[[], bool] | None = None
    keep: Any = None
    # Held on a device (``data`` is a GPU storage): the writer copies it out a chunk at a time
    # once ``after`` (an event of the notebook's stream at the snapshot; None off CUDA) happened.
    on_device: bool = False
    after: Any = None


class Torn(OSError):
    """Bytes written from the notebook's own memory changed before they were all written: the
    snapshot is not committed (the last good one stays) and the next one writes them anew."""


def check_held(staged: Staged) -> None:
    """Raise :class:`Torn` when a held blob's bytes were written since its snapshot."""
    if staged.valid is not None and not staged.valid():
        raise Torn(errno.EAGAIN, "changed while it was written")


def held_progress(staged: Staged, progress: Callable[[int], None] | None
                  ) -> Callable[[int], None] | None:
    """``progress`` for a staged blob being written, checking a held one after each chunk (and
    its pause: a cell may have run meanwhile), so a torn write stops at once."""
    if staged.valid is None:
        return progress

    def step(nbytes: int) -> None:
        if progress is not None:
            progress(nbytes)
        check_held(staged)

    return step


class StagingDir(CheckpointDir):
    """Stands for a checkpoint directory while a snapshot is taken: blobs are not written but
    staged (copied into memory as they are at the cell's end), for a writer thread to write
    (:mod:`writer`). It holds no descriptors: anything that would touch the disk fails."""

    def __init__(self, path: Path) -> None:
        super().__init__(path, -1, -1)
        self.staged: dict[str, Staged] = {}

    def stage(self, name: str, staged: Staged) -> None:
        """Hold ``staged`` as blob ``name`` (a later staging of the same name replaces it)."""
        old = self.staged.get(_blob_name(name))
        self.staged[name] = staged
        if old is not None and old.release is not None and old is not staged:
            old.release()

    @property
    def nbytes(self) -> int:
        """Bytes the staged blobs hold."""
        return sum(s.nbytes for s in self.staged.values())


class BlobSync:
    """fsyncs blobs as they are written, several at once, while the checkpoint goes on: the
    disk writes one blob while the next is pickled and written to memory, and the filesystem
    commits the fsyncs issued together in one journal transaction."""

    def __init__(self, folder: CheckpointDir) -> None:
        self._folder = folder
        # While a snapshot is taken nothing is written: a blob's bytes are staged at once, in
        # the notebook's thread, as they are at the cell's end (see StagingDir).
        self._staging = isinstance(folder, StagingDir)
        self._pool: ThreadPoolExecutor | None = None
        self._pending: list[Future[None]] = []

    def add(self, name: str, write: Callable[[], None] | None = None) -> None:
        """Start syncing blob ``name``; with ``write``, once ``write()`` has written it, in the
        same thread (the checkpoint goes on meanwhile; :meth:`wait` raises what it raised)."""
        if self._staging:
            if write is not None:
                write()  # stages the bytes: nothing to sync before they are written
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(_SYNC_THREADS, thread_name_prefix="gpufrac-fsync")
        self._pending.append(self._pool.submit(self._sync, _blob_name(name), write))

    def _sync(self, name: str, write: Callable[[], None] | None) -> None:
        if write is not None:
            write()
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=self._folder.blobs_fd)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def wait(self) -> None:
        """Return once every blob added and the blob folder are durable (raises what failed)."""
        if self._pool is None or not self._pending:
            return
        pending = [*self._pending, self._pool.submit(os.fsync, self._folder.blobs_fd)]
        self._pending = []
        for future in pending:
            future.result()

    def close(self) -> None:
        """Stop: what is under way finishes, nothing more starts."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None


@contextlib.contextmanager
def opened(root: Path | CheckpointDir) -> Iterator[CheckpointDir]:
    """``root`` when it is open already, else ``root`` opened and checked for the block."""
    if isinstance(root, CheckpointDir):
        yield root
        return
    with CheckpointDir.open(root) as folder:
        yield folder


def ensure_private_dir(path: Path) -> Path:
    """Create ``path`` (and the blob folder) owner-only (0700) or check an existing one."""
    CheckpointDir.open(path, create=True).close()
    return path


def read_file(root: Path, name: str, *, blobs: bool = True) -> bytes:
    """File ``name`` of checkpoint directory ``root``, refused unless both are ours alone
    (``blobs``: ``root`` has a blob folder, checked too)."""
    with CheckpointDir.open(root, blobs=blobs) as folder:
        return folder.read_bytes(name)


def write_file(root: Path, name: str, data: bytes, *, durable: bool = True,
               blobs: bool = True) -> None:
    """Replace file ``name`` of ``root`` (created owner-only if missing) atomically, under an
    exclusive temporary name, never through a link (``blobs``: make the blob folder too)."""
    with CheckpointDir.open(root, create=True, blobs=blobs) as folder:
        folder.write_bytes_atomic(name, data, durable=durable)


def new_blob_name() -> str:
    """A fresh blob name; blobs are immutable once named, so names are never reused."""
    return uuid.uuid4().hex + ".bin"


# In a checkpoint root (the folder of one user's kernel folders) made by this project: the
# retention sweep removes nothing from a folder without it.
ROOT_MARK = ".gpufrac-checkpoints"
ROOT_MARK_TEXT = b'{"made_by": "jupyter-gpufrac", "holds": "kernel checkpoints"}\n'


def open_root(path: Path) -> int:
    """Checkpoint root ``path`` opened without following a link and checked the user's alone;
    when missing (never made, or deleted under running kernels) it is made 0700, its missing
    parents too, and marked (:data:`ROOT_MARK`) — never left with the umask's modes."""
    path = Path(path)
    try:
        return _open_checked(path, _DIR_FLAGS, None, path, directory=True)
    except FileNotFoundError:
        pass
    fd = make_private_dirs(path)
    try:
        mark_root(fd, path)
    except BaseException:
        os.close(fd)
        raise
    return fd


def mark_root(root_fd: int, shown: Path) -> None:
    """Write :data:`ROOT_MARK` into the open, checked root (nothing when it is there)."""
    try:
        fd = os.open(ROOT_MARK, _CREATE_FLAGS, 0o600, dir_fd=root_fd)
    except FileExistsError:
        return
    with os.fdopen(fd, "wb") as fh:
        fh.write(ROOT_MARK_TEXT)


def root_marked(root_fd: int) -> bool:
    """Whether the open root carries :data:`ROOT_MARK`: a regular file of the user's alone."""
    try:
        fd = os.open(ROOT_MARK, _READ_FLAGS, dir_fd=root_fd)
    except OSError:
        return False
    try:
        _check(os.fstat(fd), Path(ROOT_MARK), directory=False)
        return os.read(fd, 4096).startswith(ROOT_MARK_TEXT.rstrip())
    except (OSError, UnsafeCheckpointError):
        return False
    finally:
        os.close(fd)


def open_kernel_dir(path: Path) -> int:
    """Kernel folder ``path`` (made 0700 when missing) under its checkpoint root, which is
    :func:`open_root`'s: checked the user's alone each time, or made again and marked."""
    path = Path(path)
    root = open_root(path.parent)
    try:
        return _made_or_checked(path.name, root, path)
    finally:
        os.close(root)
