"""Checkpoints of kernels that are gone: marked at shutdown, kept a while, then removed."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import socket
import stat
import time
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

from jupyter_gpufrac import contract
from jupyter_gpufrac.checkpoint_disk import (
    DIR_FLAGS,
    ROOT_FLAGS,
    Marker,
    is_kernel_folder,
    marker_in,
    remove_tree,
    write_marker,
)
from jupyter_gpufrac.kernel.store import CONTENT_DIR, ROOT_MARK, UnsafeCheckpointError, root_marked
from node_agent.quantities import format_bytes


@dataclass(frozen=True)
class Removed:
    """A kernel folder the sweep removed, and the bytes on disk that gave back."""

    name: str
    freed: int
    why: str


def mark_shut_down(root: str, kernel_id: str, keep_s: float, log: logging.Logger,
                   now: float | None = None) -> None:
    """The user shut kernel ``kernel_id`` down: its checkpoint is kept ``keep_s`` from now."""
    now = time.time() if now is None else now
    folder = Path(root) / kernel_id
    try:
        if write_marker(folder, now, now + keep_s):
            log.info("kernel %s: shut down; its checkpoint in %s is kept until %s", kernel_id,
                     folder, time.strftime("%Y-%m-%d %H:%M", time.localtime(now + keep_s)))
    except (OSError, UnsafeCheckpointError, OverflowError, ValueError) as err:
        # A shutdown goes on whatever happens here (a keep time past the calendar's end,
        # too): the user asked for it, and its lease is given back already.
        log.warning("kernel %s: could not mark its checkpoint as shut down: %s", kernel_id, err)


def touch(root_fd: int, name: str) -> None:
    """Say the kernel of folder ``name`` still runs (its mtime is the orphan clock)."""
    with contextlib.suppress(OSError):
        fd = os.open(name, DIR_FLAGS, dir_fd=root_fd)
        try:
            os.utime(fd)
        finally:
            os.close(fd)


def listening(folder_fd: int) -> bool:
    """Whether a kernel listens on the wake socket in the folder: it runs, under this server or
    another one sharing the data folder. Uncertain answers count as yes (keep)."""
    try:
        st = os.stat(contract.WAKE_SOCKET, dir_fd=folder_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    if not stat.S_ISSOCK(st.st_mode):
        return False
    # Through the folder's descriptor: the name is not looked up again, and any path length fits.
    address = f"/proc/self/fd/{folder_fd}/{contract.WAKE_SOCKET}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect(address)  # nothing is sent: the kernel is not woken
        except OSError as err:
            return err.errno not in (errno.ECONNREFUSED, errno.ENOENT)
    return True


def _newest_write(folder_fd: int) -> float:
    """The newest mtime of the folder and what it holds directly (a kernel writes there)."""
    newest = os.fstat(folder_fd).st_mtime
    for name in os.listdir(folder_fd):
        with contextlib.suppress(FileNotFoundError):
            newest = max(newest, os.stat(name, dir_fd=folder_fd, follow_symlinks=False).st_mtime)
    return newest


def root_problem(root_fd: int) -> str | None:
    """Why nothing may be removed from the open checkpoint root, or None: it must be the
    user's alone, and marked as made by this project (never a folder someone swapped in)."""
    st = os.fstat(root_fd)
    if st.st_uid != os.geteuid():
        return f"it belongs to uid {st.st_uid}, not to you"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return (f"it is writable by group or others (mode {stat.S_IMODE(st.st_mode):04o}), so "
                "what is in it may not be what your kernels wrote")
    if not root_marked(root_fd):
        return (f"it has no {ROOT_MARK} file, which jupyter-gpufrac leaves in the checkpoint "
                "folders it makes: it may be another folder of yours put in its place")
    return None


def _expired(marker: Marker | None, last_write: float, now: float, keep_s: float,
             orphan_after_s: float) -> str | None:
    """Why the folder may go, or None."""
    if marker is not None:
        if now - marker.time >= keep_s:
            return "shut down at " + time.strftime("%Y-%m-%d %H:%M", time.localtime(marker.time))
        return None
    if now - last_write >= max(keep_s, orphan_after_s):
        return ("no kernel uses it; last written "
                + time.strftime("%Y-%m-%d %H:%M", time.localtime(last_write)))
    return None


def sweep(root: str, keep_s: float, running: Collection[str], orphan_after_s: float,
          log: logging.Logger, now: float | None = None) -> list[Removed]:
    """Remove the expired kernel folders under ``root``; touch those of ``running`` kernels.

    A folder goes when its kernel was shut down ``keep_s`` ago (the marker says when), or,
    without a marker, when nothing was written in it for ``max(keep_s, orphan_after_s)``. Never
    a folder of a kernel in ``running`` (this server's) nor one whose wake socket answers (a
    kernel of another server of this user sharing the folder), never a link, never another
    user's folder, never a folder that is not a kernel's checkpoint; and nothing at all unless
    ``root`` itself is the user's alone and marked as this project's (:func:`root_problem`).
    """
    now = time.time() if now is None else now
    removed: list[Removed] = []
    try:
        # Opened once, not followed if a link; everything below is reached from this
        # descriptor: a root renamed or replaced meanwhile is never what is swept.
        root_fd = os.open(root, DIR_FLAGS)
    except FileNotFoundError:
        return removed
    except OSError as err:
        log.warning("gpufrac: checkpoint folder %s was not swept: %s (a symbolic link or not a "
                    "folder is never followed)", root, err.strerror)
        return removed
    try:
        problem = root_problem(root_fd)
        if problem is not None:
            log.warning("gpufrac: checkpoint folder %s was not swept: %s", root, problem)
            return removed
        for name in sorted(os.listdir(root_fd)):
            if name == CONTENT_DIR:
                continue
            if name in running:
                touch(root_fd, name)
                continue
            done = _sweep_one(root, root_fd, name, keep_s, orphan_after_s, now, log)
            if done is not None:
                removed.append(done)
        _sweep_content(root, root_fd, log)
    finally:
        os.close(root_fd)
    if removed:
        log.info("gpufrac: removed %d expired checkpoint folders from %s, freeing %s",
                 len(removed), root, format_bytes(sum(r.freed for r in removed)))
    return removed


def _sweep_content(root: str, root_fd: int, log: logging.Logger) -> None:
    """Remove the shared blobs that no kernel folder links any more (``st_nlink`` 1: the
    store's own name is the last)."""
    try:
        fd = os.open(CONTENT_DIR, DIR_FLAGS, dir_fd=root_fd)
    except OSError:
        return  # none, or a link: never followed
    freed = count = 0
    try:
        if os.fstat(fd).st_uid != os.geteuid():
            return
        for entry in os.listdir(fd):
            with contextlib.suppress(FileNotFoundError):
                st = os.stat(entry, dir_fd=fd, follow_symlinks=False)
                if stat.S_ISREG(st.st_mode) and st.st_nlink == 1:
                    os.unlink(entry, dir_fd=fd)
                    freed += st.st_blocks * 512
                    count += 1
    finally:
        os.close(fd)
    if count:
        log.info("gpufrac: removed %d shared blobs that no checkpoint in %s links any more, "
                 "freeing %s", count, root, format_bytes(freed))


def _sweep_one(root: str, root_fd: int, name: str, keep_s: float, orphan_after_s: float,
               now: float, log: logging.Logger) -> Removed | None:
    try:
        st = os.stat(name, dir_fd=root_fd, follow_symlinks=False)
    except FileNotFoundError:
        return None
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
        return None  # a file (the remembered request), a link, another user's folder
    try:
        fd = os.open(name, DIR_FLAGS, dir_fd=root_fd)
    except OSError:
        return None  # replaced by a link since, or gone
    try:
        # Checked on the descriptor: what is judged is what is removed. Only a kernel's
        # folder, the user's alone, goes.
        held = os.fstat(fd)
        if held.st_ino != st.st_ino or held.st_mode & (stat.S_IWGRP | stat.S_IWOTH) \
                or not is_kernel_folder(fd) or listening(fd):
            return None
        why = _expired(marker_in(fd), _newest_write(fd), now, keep_s, orphan_after_s)
    finally:
        os.close(fd)
    if why is None:
        return None
    try:
        freed = remove_tree(root_fd, name)
    except OSError as err:
        log.warning("gpufrac: could not remove expired checkpoint %s: %s", Path(root) / name, err)
        return None
    log.info("gpufrac: removed the checkpoint of kernel %s (%s), freeing %s", name, why,
             format_bytes(freed))
    return Removed(name, freed, why)


def hard_links_refused(root: str) -> str | None:
    """Why the file system of checkpoint root ``root`` refuses hard links (some network file
    systems do), or None when it makes them: a file linked and both names removed."""
    try:
        root_fd = os.open(root, ROOT_FLAGS)
    except OSError:
        return None  # no root yet: nothing is stored, nothing is said
    probe = f".gpufrac-link-probe-{os.getpid()}"
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600,
                         dir_fd=root_fd))
        try:
            os.link(probe, probe + ".2", src_dir_fd=root_fd, dst_dir_fd=root_fd,
                    follow_symlinks=False)
        except OSError as err:
            return err.strerror or str(err)
        with contextlib.suppress(OSError):
            os.unlink(probe + ".2", dir_fd=root_fd)
        return None
    except OSError:
        return None  # not even a file could be made: other messages say why
    finally:
        with contextlib.suppress(OSError):
            os.unlink(probe, dir_fd=root_fd)
        os.close(root_fd)
