"""Raw tensor storage bytes to and from files, without copies on the CPU and without numpy."""

from __future__ import annotations

import ctypes
import os
from pathlib import Path
from typing import Any

from jupyter_gpufrac.kernel import store


def _host_view(storage: Any) -> memoryview:
    # The storage must outlive the view: callers keep a reference while the view is in use.
    nbytes = int(storage.nbytes())
    array = (ctypes.c_ubyte * nbytes).from_address(int(storage.data_ptr()))
    return memoryview(array).cast("B")


def write_storage(root: Path, storage: Any) -> tuple[str, int, Path]:
    """Write an untyped storage's bytes as a new blob; returns (blob name, bytes, path).

    No fsync here: the caller syncs all new blobs at once before it commits the checkpoint
    that names them (one flush of many files beats a flush per file). A blob is written under
    its final, fresh name: until a committed checkpoint names it, a half-written one is garbage
    that the next checkpoint deletes (:func:`store.unreferenced_blobs`).
    """
    if storage.device.type != "cpu":
        storage = storage.cpu()
    nbytes = int(storage.nbytes())
    name = store.new_blob_name()
    path = store.blob_path(root, name)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb", buffering=0) as fh:
        if nbytes:
            view = _host_view(storage)
            done = 0
            while done < nbytes:
                done += fh.write(view[done:]) or 0
    return name, nbytes, path


def sync_files(paths: list[Path]) -> None:
    """fsync files written earlier (the kernel flushes their dirty pages in one go)."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def read_storage(path: Path, nbytes: int, device: str) -> Any:
    """Read a blob into a fresh untyped storage on ``device``."""
    import torch

    size = os.path.getsize(path)
    if size != nbytes:
        raise OSError(f"blob {path.name} holds {size} bytes, the checkpoint expects {nbytes}")
    buffer = torch.empty(nbytes, dtype=torch.uint8)
    storage = buffer.untyped_storage()
    if nbytes:
        view = _host_view(storage)
        with open(path, "rb", buffering=0) as fh:
            done = 0
            while done < nbytes:
                got = fh.readinto(view[done:])
                if not got:
                    raise OSError(f"blob {path.name} ended after {done} of {nbytes} bytes")
                done += got
    if device != "cpu":
        return buffer.to(device).untyped_storage()
    return storage
