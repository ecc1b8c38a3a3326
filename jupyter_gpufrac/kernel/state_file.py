"""The committed state file: its format, its header read without unpickling, and its generation."""

from __future__ import annotations

import io
import json
import os
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any

from jupyter_gpufrac.kernel import store, tensor_io

MAGIC = b"GPUFRAC-CKPT-1\n"
# 3: groups of shared references pickled with protocol 5, packed into content-addressed blobs
# (offset, length); large out-of-band buffers in content-addressed blobs of their own.
FORMAT = 3
# What a restore reads: 2 is what the previous release writes (each group's pickle a whole blob,
# tensors, storages and the namespace as persistent ids): a kernel checkpointed before an
# upgrade and restored after it keeps its variables.
READS = (2, 3)
_TRAILER = struct.Struct(">Q")  # header length, after the JSON header, before the end magic


class CheckpointError(Exception):
    """A checkpoint could not be written or read; the message is for people."""


def current_header(folder: store.CheckpointDir) -> dict[str, Any]:
    """The state file's header, with when and after which cell it was last found current."""
    data = folder.read_bytes(store.STATE_FILE)
    header, _ = read_trailer(io.BytesIO(data), folder.path / store.STATE_FILE)
    try:
        seen = json.loads(folder.read_bytes(store.SEEN_FILE))
    except (FileNotFoundError, ValueError):
        return header
    if isinstance(seen, dict) and seen.get("state") == tensor_io.digest(data):
        header.update(time=seen.get("time"), execution_count=seen.get("execution_count"))
    return header


def recovery_point(root: Path) -> dict[str, Any] | None:
    """What a restore of ``root`` would bring back, from its header (nothing unpickled): the
    cell and time of the committed checkpoint, its generation, and the variables it left out
    to stay within the disk budget with why, and the packages its kernel had imported; None
    when there is none or it is not ours."""
    try:
        with store.CheckpointDir.open(Path(root)) as folder:
            if not folder.exists(store.STATE_FILE):
                return None
            header = current_header(folder)
    except (OSError, ValueError, CheckpointError, store.UnsafeCheckpointError):
        return None
    cell, when = header.get("execution_count"), header.get("time")
    unprotected = header.get("unprotected")
    imports = header.get("imports")
    return {
        "durable_cell": cell if isinstance(cell, int) and not isinstance(cell, bool) else None,
        "durable_time": float(when) if isinstance(when, int | float) else None,
        "durable_generation": header_generation(header),
        "unprotected": ({str(k): int(v) for k, v in unprotected.items()
                         if isinstance(v, int)} if isinstance(unprotected, dict) else {}),
        "unprotected_why": (str(header["unprotected_why"])[:1000]
                            if header.get("unprotected_why") else None),
        "imports": ([str(name) for name in imports if isinstance(name, str)]
                    if isinstance(imports, list) else []),
    }


def header_generation(header: Mapping[str, Any]) -> int:
    """The generation a state's header names (0: none, written before generations)."""
    found = header.get("generation")
    return found if isinstance(found, int) and not isinstance(found, bool) and found > 0 else 0


def disk_generation(folder: store.CheckpointDir) -> int:
    """The generation of the state committed in ``folder`` (0: none, or unreadable)."""
    try:
        header, _ = read_trailer(io.BytesIO(folder.read_bytes(store.STATE_FILE)), folder.path)
    except (OSError, ValueError, CheckpointError, store.UnsafeCheckpointError):
        return 0
    return header_generation(header) if isinstance(header, dict) else 0


def committed_generation(root: Path) -> int | None:
    """The generation of the checkpoint committed in ``root``, read through checked
    descriptors without unpickling anything; None when there is none or it is not ours."""
    try:
        with store.CheckpointDir.open(Path(root)) as folder:
            if not folder.exists(store.STATE_FILE):
                return None
            return disk_generation(folder)
    except (OSError, store.UnsafeCheckpointError):
        return None


def check_format(header: Mapping[str, Any], root: Path, outcome: str) -> None:
    """Refuse a checkpoint this version cannot read, saying why and what to do."""
    found = header.get("format")
    if found in READS:
        return
    reads = " and ".join(map(str, READS))
    if isinstance(found, int) and found > FORMAT:
        raise CheckpointError(
            f"the checkpoint in {root} has format {found}, written by a newer jupyter-gpufrac "
            f"(this version reads formats {reads}); {outcome}. Install that newer version in "
            f"this kernel's environment and restart the kernel to restore it, or move {root} "
            f"away to start afresh.")
    raise CheckpointError(f"the checkpoint in {root} has format {found!r}, which this version "
                          f"of jupyter-gpufrac does not read (it reads formats {reads}); {outcome}.")


def durable_blobs(folder: store.CheckpointDir) -> set[str]:
    """The blobs the committed state on disk names: its writer synced them before committing.

    A state of a newer format is refused: writing over it would delete the variables it holds,
    which a newer version could still restore.
    """
    try:
        header, _ = read_trailer(io.BytesIO(folder.read_bytes(store.STATE_FILE)), folder.path)
    except (OSError, ValueError, CheckpointError, store.UnsafeCheckpointError):
        return set()  # none, or not ours alone: nothing is taken as synced
    found = header.get("format")
    if isinstance(found, int) and found > FORMAT:
        check_format(header, folder.path, "it was not overwritten")
    blobs = header.get("blobs")
    return {str(name) for name in blobs} if isinstance(blobs, dict) else set()


def trailer(header: dict[str, Any]) -> bytes:
    data = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    return data + _TRAILER.pack(len(data)) + MAGIC


def read_trailer(fh: IO[bytes], path: Path) -> tuple[dict[str, Any], int]:
    fh.seek(0, os.SEEK_END)
    size = fh.tell()
    tail = len(MAGIC) + _TRAILER.size
    if size < len(MAGIC) + tail:
        raise CheckpointError(f"{path} is not a gpufrac checkpoint (too short)")
    fh.seek(0)
    if fh.read(len(MAGIC)) != MAGIC:
        raise CheckpointError(f"{path} is not a gpufrac checkpoint")
    fh.seek(size - tail)
    (length,) = _TRAILER.unpack(fh.read(_TRAILER.size))
    if fh.read(len(MAGIC)) != MAGIC or length > size - len(MAGIC) - tail:
        raise CheckpointError(f"{path} is incomplete or damaged")
    fh.seek(size - tail - length)
    header = json.loads(fh.read(length))
    return header, size - tail - length
