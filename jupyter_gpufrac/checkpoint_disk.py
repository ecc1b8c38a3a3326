"""What kernels' checkpoints take on disk, and the marker a shut-down kernel's folder carries."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import stat
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from jupyter_gpufrac import contract
from jupyter_gpufrac.kernel import store

# Written by the server into the folder of a kernel its user shut down (not at a restart, not
# at a server stop): from then the folder is kept for c.GpuFrac.checkpoint_keep_seconds.
SHUTDOWN_MARKER = "shutdown.json"
# A checkpoint folder is two levels deep (blobs/); deeper is not ours and not followed.
MAX_DEPTH = 8
# A measure stops after this many entries (then it says "at least"): %gpu must stay cheap.
MAX_ENTRIES = 200_000

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# The root is the configured path: it may be a link (like its parents), what is in it may not.
ROOT_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC


@dataclass(frozen=True)
class Marker:
    """When a kernel was shut down, and until when its server meant to keep its checkpoint."""

    time: float
    keep_until: float | None = None


def _is_own_dir(st: os.stat_result) -> bool:
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid()


def write_marker(folder: Path, when: float, keep_until: float) -> bool:
    """Mark ``folder`` as its kernel's user shut it down; False when there is no such folder.

    Written atomically through the folder's descriptor by the checkpoint store (a link or a
    folder that is not ours alone is refused with ``UnsafeCheckpointError``).
    """
    try:
        if not _is_own_dir(os.lstat(folder)):
            return False
    except FileNotFoundError:
        return False  # never launched: nothing to keep
    data = json.dumps({"time": when, "keep_until": keep_until}).encode()
    store.write_file(Path(folder), SHUTDOWN_MARKER, data)
    return True


def clear_marker(folder: Path) -> None:
    """Take the marker away (its kernel is launched again); nothing happens if there is none."""
    with contextlib.suppress(FileNotFoundError, NotADirectoryError):
        fd = os.open(folder, DIR_FLAGS)
        try:
            os.unlink(SHUTDOWN_MARKER, dir_fd=fd)
        finally:
            os.close(fd)


def read_marker(folder: Path) -> Marker | None:
    """The folder's shutdown marker, or None (none, unreadable, a link, not ours, malformed)."""
    with _opened(folder, None) as fd:
        return None if fd is None else marker_in(fd)


def marker_in(folder_fd: int) -> Marker | None:
    """:func:`read_marker` of a folder held open (not looked up again by its path)."""
    try:
        fd = os.open(SHUTDOWN_MARKER, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                     dir_fd=folder_fd)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or \
                st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            return None
        data = json.loads(os.read(fd, 65536))
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)
    if not isinstance(data, dict):
        return None
    when, until = data.get("time"), data.get("keep_until")
    if not isinstance(when, int | float) or isinstance(when, bool):
        return None
    if not isinstance(until, int | float) or isinstance(until, bool):
        until = None
    return Marker(float(when), None if until is None else float(until))


# The remembered %gpu requests beside the kernel folders.
REQUEST_FILES = contract.LAST_REQUEST_FILE.split("{", 1)[0]
# What only a kernel's checkpoint folder holds: a folder without one of them is not one.
KERNEL_FOLDER_SIGNS = (store.BLOB_DIR, store.STATE_FILE, store.CELLS_FILE, SHUTDOWN_MARKER)


def is_kernel_folder(folder_fd: int) -> bool:
    """Whether the open folder is a kernel's checkpoint folder, as this project makes them."""
    for name in KERNEL_FOLDER_SIGNS:
        try:
            st = os.stat(name, dir_fd=folder_fd, follow_symlinks=False)
        except OSError:
            continue
        if (stat.S_ISDIR(st.st_mode) if name == store.BLOB_DIR else stat.S_ISREG(st.st_mode)) \
                and st.st_uid == os.geteuid():
            return True
    return False


def adopt_root(root_fd: int, shown: Path) -> bool:
    """Mark an open, checked checkpoint root that an earlier version made without a mark,
    when all it holds is what this project puts there (kernel folders, the shared blobs, the
    remembered requests); False when it holds anything else (then it is never swept)."""
    if store.root_marked(root_fd):
        return True
    for name in os.listdir(root_fd):
        if name in (store.CONTENT_DIR, store.ROOT_MARK) or name.startswith(REQUEST_FILES):
            continue
        with _opened(name, root_fd) as fd:
            if fd is None or not is_kernel_folder(fd):
                return False
    store.mark_root(root_fd, shown)
    return True
def remove_tree(parent_fd: int, name: str, depth: int = 0) -> int:
    """Remove directory ``name`` of ``parent_fd`` and everything in it through descriptors,
    never following a link (a link is unlinked, its target left alone) and never entering a
    folder that is not the user's (it stays, and so does every folder above it); the bytes
    freed."""
    freed = 0
    fd = os.open(name, DIR_FLAGS, dir_fd=parent_fd)
    try:
        if os.fstat(fd).st_uid != os.geteuid():
            raise OSError(errno.EPERM, "not yours: left alone", name)
        for entry in os.listdir(fd):
            try:
                st = os.stat(entry, dir_fd=fd, follow_symlinks=False)
            except FileNotFoundError:
                continue
            if stat.S_ISDIR(st.st_mode):
                if depth >= MAX_DEPTH:
                    raise OSError(errno.ELOOP, "too deep", entry)
                freed += remove_tree(fd, entry, depth + 1)
                continue
            with contextlib.suppress(FileNotFoundError):
                os.unlink(entry, dir_fd=fd)
                if st.st_nlink <= 1:  # a hard link's blocks stay with the other name
                    freed += st.st_blocks * 512
        freed += os.fstat(fd).st_blocks * 512
    finally:
        os.close(fd)
    os.rmdir(name, dir_fd=parent_fd)
    return freed


@dataclass
class Tree:
    """What a folder holds: bytes on disk (allocated blocks), its newest write, entries seen."""

    bytes: int = 0
    last_write: float = 0.0
    entries: int = 0
    complete: bool = True
    # Files of several names (blobs linked from the user's shared store), by (device, inode),
    # shared by the trees of one measure; ``repeated`` counts the bytes of names seen again.
    linked: set[tuple[int, int]] = field(default_factory=set)
    repeated: int = 0


def walk(dir_fd: int, tree: Tree, depth: int = 0, limit: int = MAX_ENTRIES) -> Tree:
    """Add what the open directory ``dir_fd`` holds to ``tree``: stat only, links not followed,
    nothing read."""
    tree.last_write = max(tree.last_write, os.fstat(dir_fd).st_mtime)
    for name in os.listdir(dir_fd):
        if tree.entries >= limit:
            tree.complete = False
            return tree
        tree.entries += 1
        try:
            st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            continue  # removed meanwhile (a checkpoint's temporary)
        tree.bytes += st.st_blocks * 512
        tree.last_write = max(tree.last_write, st.st_mtime)
        if st.st_nlink > 1 and not stat.S_ISDIR(st.st_mode):
            if (st.st_dev, st.st_ino) in tree.linked:
                tree.repeated += st.st_blocks * 512
            tree.linked.add((st.st_dev, st.st_ino))
        if stat.S_ISDIR(st.st_mode):
            if depth >= MAX_DEPTH:
                tree.complete = False
                continue
            with _opened(name, dir_fd) as sub:
                if sub is not None:
                    walk(sub, tree, depth + 1, limit)
    return tree


@contextlib.contextmanager
def _opened(name: str | Path, dir_fd: int | None, flags: int = DIR_FLAGS) -> Iterator[int | None]:
    """``name`` opened as a directory without following a link, or None when it cannot be."""
    try:
        fd = os.open(name, flags, dir_fd=dir_fd)
    except OSError:  # gone, a link, not a directory, not ours to read
        yield None
        return
    try:
        yield fd
    finally:
        os.close(fd)


@dataclass(frozen=True)
class Folder:
    """One kernel's checkpoint folder under the root."""

    name: str
    bytes: int
    last_write: float
    marker: Marker | None


@dataclass
class Usage:
    """Every kernel folder of the root that is the user's own."""

    folders: list[Folder] = field(default_factory=list)
    complete: bool = True
    shared: int = 0  # the store of blobs the kernels share (store.CONTENT_DIR)
    repeated: int = 0  # bytes of files counted under more than one name

    @property
    def total(self) -> int:
        """Bytes on disk, each file once whatever links it."""
        return sum(folder.bytes for folder in self.folders) + self.shared - self.repeated

    def of(self, name: str) -> Folder | None:
        return next((folder for folder in self.folders if folder.name == name), None)

    def kept(self, now: float) -> list[Folder]:
        """Folders of kernels shut down by their user and still kept."""
        return [folder for folder in self.folders if folder.marker is not None
                and (folder.marker.keep_until is None or folder.marker.keep_until > now)]

    def model(self, kernel: str | None, now: float) -> dict[str, object]:
        """The REST model's ``checkpoint_disk`` (docs/server-api.md)."""
        mine = self.of(kernel) if kernel is not None else None
        kept = self.kept(now)
        untils = [f.marker.keep_until for f in kept if f.marker and f.marker.keep_until]
        return {
            "kernel_bytes": None if mine is None else mine.bytes,
            "all_bytes": self.total,
            "folders": len(self.folders),
            "kept_after_shutdown": len(kept),
            "kept_until": max(untils) if untils else None,
            "complete": self.complete,
        }


def measure(root: Path, limit: int = MAX_ENTRIES) -> Usage:
    """What each kernel folder under ``root`` takes on disk (an absent root: nothing)."""
    usage = Usage()
    with _opened(root, None, ROOT_FLAGS) as root_fd:
        if root_fd is None or os.fstat(root_fd).st_uid != os.geteuid():
            return usage
        entries = 0
        linked: set[tuple[int, int]] = set()
        for name in sorted(os.listdir(root_fd)):
            try:
                st = os.stat(name, dir_fd=root_fd, follow_symlinks=False)
            except FileNotFoundError:
                continue
            if not _is_own_dir(st):
                continue  # files (the remembered request), links, other users' folders
            with _opened(name, root_fd) as fd:
                if fd is None:
                    continue
                tree = walk(fd, Tree(bytes=st.st_blocks * 512, linked=linked),
                            limit=max(limit - entries, 0))
                marker = marker_in(fd)
            entries += tree.entries
            usage.complete = usage.complete and tree.complete
            usage.repeated += tree.repeated
            if name == store.CONTENT_DIR:
                usage.shared += tree.bytes
                continue
            usage.folders.append(Folder(name, tree.bytes, tree.last_write, marker))
    return usage


def free_disk(root: Path) -> int:
    """Bytes free on the disk that holds ``root`` (or would: its nearest existing parent)."""
    for folder in (Path(root), *Path(root).parents):
        try:
            return shutil.disk_usage(folder).free
        except OSError:  # not there yet
            continue
    return 0
