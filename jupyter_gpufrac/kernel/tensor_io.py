"""Raw tensor storage bytes to and from files, without copies on the CPU and without numpy."""

from __future__ import annotations

import ctypes
import os
from pathlib import Path
from typing import Any

from jupyter_gpufrac.kernel import store


def host_view(storage: Any) -> memoryview:
    """The bytes of a host storage, without a copy (raw I/O reads and writes through it)."""
    # The storage must outlive the view: callers keep a reference while the view is in use.
    nbytes = int(storage.nbytes())
    array = (ctypes.c_ubyte * nbytes).from_address(int(storage.data_ptr()))
    return memoryview(array).cast("B")


def write_storage(root: store.CheckpointDir | Path, storage: Any) -> tuple[str, int, Path]:
    """Write an untyped storage's bytes as a new blob; returns (blob name, bytes, path).

    No fsync here: the caller syncs all new blobs at once before it commits the checkpoint
    that names them (:meth:`store.CheckpointDir.sync_blobs`). A blob is written under its
    final, fresh name: until a committed checkpoint names it, a half-written one is garbage
    that the next checkpoint deletes (:meth:`store.CheckpointDir.unreferenced_blobs`).
    """
    if storage.device.type != "cpu":
        storage = storage.cpu()
    nbytes = int(storage.nbytes())
    name = store.new_blob_name()
    with store.opened(root) as folder, folder.create(name, blob=True) as fh:
        if nbytes:
            view = host_view(storage)
            done = 0
            while done < nbytes:
                done += fh.write(view[done:]) or 0
    return name, nbytes, folder.path / store.BLOB_DIR / name


def read_storage(folder: store.CheckpointDir, name: str, nbytes: int, device: str) -> Any:
    """Read blob ``name`` of ``folder`` into a fresh untyped storage on ``device``."""
    import torch

    with folder.open_read(name, blob=True) as fh:
        size = os.fstat(fh.fileno()).st_size
        if size != nbytes:
            raise OSError(f"blob {name} holds {size} bytes, the checkpoint expects {nbytes}")
        buffer = torch.empty(nbytes, dtype=torch.uint8)
        storage = buffer.untyped_storage()
        if nbytes:
            view = host_view(storage)
            done = 0
            while done < nbytes:
                got = fh.readinto(view[done:])
                if not got:
                    raise OSError(f"blob {name} ended after {done} of {nbytes} bytes")
                done += got
    if device != "cpu":
        return buffer.to(device).untyped_storage()
    return storage
