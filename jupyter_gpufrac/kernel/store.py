"""On-disk checkpoint store: owner-only directories, atomic files and tensor blobs."""

from __future__ import annotations

import contextlib
import os
import stat
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import IO

STATE_FILE = "checkpoint.gfc"
RESTORE_FILE = "restore-report.json"  # the server reads it (kernel_checkpoint.py)
CELLS_FILE = "cells.json"
BLOB_DIR = "blobs"
TMP_SUFFIX = ".tmp"


class UnsafeCheckpointError(Exception):
    """A checkpoint path that another user could have written: loading it would run their code."""


def _describe(st: os.stat_result) -> str:
    return f"owner uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):04o}"


def check_private(path: Path, *, directory: bool) -> None:
    """Refuse a path that is a symlink, is not ours, or is group/other-writable.

    Unpickling runs code, so a file that someone else could have put there is never trusted.
    """
    st = os.lstat(path)
    kind = "directory" if directory else "file"
    if stat.S_ISLNK(st.st_mode):
        raise UnsafeCheckpointError(f"refusing checkpoint {kind} {path}: it is a symbolic link")
    if directory != stat.S_ISDIR(st.st_mode) or (not directory and not stat.S_ISREG(st.st_mode)):
        raise UnsafeCheckpointError(f"refusing checkpoint {kind} {path}: not a regular {kind}")
    uid = os.geteuid()
    if st.st_uid != uid:
        raise UnsafeCheckpointError(
            f"refusing checkpoint {kind} {path}: it belongs to uid {st.st_uid}, not to you "
            f"(uid {uid}); unpickling it would run code that another user could have written"
        )
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise UnsafeCheckpointError(
            f"refusing checkpoint {kind} {path}: it is writable by group or others "
            f"({_describe(st)}); fix it with `chmod go-w {path}` if you trust its contents"
        )


def ensure_private_dir(path: Path) -> Path:
    """Create ``path`` (and the blob folder) owner-only (0700) or check an existing one."""
    created = False
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileExistsError):
            path.mkdir(mode=0o700)
            created = True
    if created:
        # mkdir's mode is filtered by the umask; say exactly what we want.
        os.chmod(path, 0o700)
    check_private(path, directory=True)
    blobs = path / BLOB_DIR
    if not blobs.exists():
        with contextlib.suppress(FileExistsError):
            blobs.mkdir(mode=0o700)
            os.chmod(blobs, 0o700)
    check_private(blobs, directory=True)
    return path


def fsync_dir(path: Path) -> None:
    """Make a rename inside ``path`` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_writer(
    path: Path, *, durable: bool = True, sync_dir: bool = True
) -> Iterator[IO[bytes]]:
    """Write to a temporary sibling, then rename over ``path``: readers see old or new, never half.

    A kill mid-write leaves only a ``*.tmp`` file behind, which :func:`remove_stale_tmp` cleans.
    ``sync_dir=False`` lets a caller writing many files fsync their folder once at the end.
    """
    tmp = path.with_name(f"{path.name}.{uuid.uuid4().hex[:8]}{TMP_SUFFIX}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb", buffering=1024 * 1024) as fh:
            yield fh
            fh.flush()
            if durable:
                os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    if durable and sync_dir:
        fsync_dir(path.parent)


def write_bytes_atomic(path: Path, data: bytes, *, durable: bool = True) -> None:
    """Replace ``path`` with ``data`` atomically."""
    with atomic_writer(path, durable=durable) as fh:
        fh.write(data)


def new_blob_name() -> str:
    """A fresh blob name; blobs are immutable once named, so names are never reused."""
    return uuid.uuid4().hex + ".bin"


def blob_path(root: Path, name: str) -> Path:
    """Where blob ``name`` lives; rejects names that would escape the blob folder."""
    if "/" in name or name.startswith(".") or not name.endswith(".bin"):
        raise UnsafeCheckpointError(f"refusing blob name {name!r} in the checkpoint")
    return root / BLOB_DIR / name


def remove_stale_tmp(root: Path) -> None:
    """Delete temporaries left by a writer that was killed."""
    for folder in (root, root / BLOB_DIR):
        with contextlib.suppress(FileNotFoundError):
            for entry in os.scandir(folder):
                if entry.name.endswith(TMP_SUFFIX):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(entry.path)


def unreferenced_blobs(root: Path, keep: set[str]) -> list[Path]:
    """Blobs that the committed checkpoint does not name (replaced, or left by a killed writer)."""
    stale: list[Path] = []
    with contextlib.suppress(FileNotFoundError):
        for entry in os.scandir(root / BLOB_DIR):
            if entry.name.endswith(".bin") and entry.name not in keep:
                stale.append(Path(entry.path))
    return stale


def remove_files(paths: list[Path]) -> int:
    """Unlink ``paths``, ignoring those already gone; returns how many were removed."""
    removed = 0
    for path in paths:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
            removed += 1
    return removed
