"""Take and load incremental namespace checkpoints in a private directory."""

from __future__ import annotations

import importlib
import json
import logging
import os
import struct
import threading
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any

from jupyter_gpufrac.kernel import namespace, pickling, rng, store, tensor_io, torch_adapter

log = logging.getLogger(__name__)

MAGIC = b"GPUFRAC-CKPT-1\n"
_TRAILER = struct.Struct(">Q")  # header length, after the JSON header, before the end magic
MAX_ATTEMPTS = 3


class CheckpointError(Exception):
    """A checkpoint could not be written or read; the message is for people."""


@dataclass
class CheckpointResult:
    """What a checkpoint holds and what it cost."""

    path: str
    time: float
    seconds: float
    names: list[str]
    modules: dict[str, str]
    lost: dict[str, str]
    tensors_bytes: int
    bytes_written: int
    blobs_written: int
    execution_count: int | None = None

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return asdict(self)


@dataclass
class LoadResult:
    """What came back from a checkpoint and what did not."""

    checkpoint_time: float
    execution_count: int | None
    restored: list[str]
    lost: dict[str, str]
    modules: list[str]
    rng: list[str]
    moved_to_cpu_bytes: int = 0
    header: dict[str, Any] = field(default_factory=dict)
    # The generators as saved, to apply again right before the next cell (start-up draws).
    rng_state: dict[str, Any] = field(default_factory=dict)


class Checkpointer:
    """Checkpoints one namespace into one directory, reusing blobs of unchanged tensors."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.cache = pickling.IncrementalCache()
        self._lock = threading.Lock()
        self.last: CheckpointResult | None = None
        self._gc: threading.Thread | None = None

    @property
    def state_path(self) -> Path:
        """The committed checkpoint file."""
        return self.root / store.STATE_FILE

    def take(
        self,
        ns: dict[str, Any],
        *,
        hidden: Mapping[str, object] | None = None,
        full: bool = False,
        execution_count: int | None = None,
        extra: Mapping[str, Any] | None = None,
    ) -> CheckpointResult:
        """Checkpoint ``ns`` (the notebook's globals); unpicklable variables are listed, not fatal."""
        with self._lock:
            return self._take(ns, hidden, full, execution_count, extra or {})

    def _take(
        self,
        ns: dict[str, Any],
        hidden: Mapping[str, object] | None,
        full: bool,
        execution_count: int | None,
        extra: Mapping[str, Any],
    ) -> CheckpointResult:
        started = time.monotonic()
        self.wait_for_cleanup()
        try:
            store.ensure_private_dir(self.root)
        except (OSError, store.UnsafeCheckpointError) as exc:
            raise CheckpointError(f"cannot use checkpoint directory {self.root}: {exc}") from exc
        store.remove_stale_tmp(self.root)
        if full:
            self.cache.clear()
        selection = namespace.select(ns, hidden)
        values = dict(selection.values)
        lost: dict[str, str] = {name: "a module object that is not importable"
                                for name in selection.skipped}
        blobs = pickling.BlobWriter(self.root, self.cache)
        rng_state = rng.capture()
        header: dict[str, Any] = {}
        try:
            with store.atomic_writer(self.state_path) as fh:
                attempts = 0
                while True:
                    fh.seek(0)
                    fh.truncate()
                    fh.write(MAGIC)
                    blobs.start_pass()
                    try:
                        pickling.NamespacePickler(fh, blobs, ns).dump(
                            {"values": values, "rng": rng_state}
                        )
                        break
                    except Exception as exc:
                        attempts += 1
                        if not values:
                            raise CheckpointError(
                                f"pickling failed with no variables left: {exc}"
                            ) from exc
                        bad = self._find_unpicklable(values, blobs, ns)
                        if not bad or attempts >= MAX_ATTEMPTS:
                            # Nothing alone fails, yet the whole does: say so for every name.
                            why = f"{type(exc).__name__}: {exc}"[:300]
                            bad = bad or {name: why for name in values}
                        for name, reason in bad.items():
                            values.pop(name, None)
                            lost[name] = reason
                # Blobs durable first, then the state file that names them: a kill or crash
                # in between leaves the previous state whole, and its blobs untouched.
                tensor_io.sync_files(blobs.new_paths)
                store.fsync_dir(self.root / store.BLOB_DIR)
                now = time.time()
                header = {
                    "format": 1,
                    "time": now,
                    "execution_count": execution_count,
                    "names": sorted(values),
                    "modules": selection.modules,
                    "lost": lost,
                    "blobs": blobs.referenced,
                    "tensors_bytes": blobs.tensor_bytes,
                    "pid": os.getpid(),
                    **dict(extra),
                }
                _write_trailer(fh, header)
        except OSError as exc:
            raise CheckpointError(f"writing the checkpoint to {self.root} failed: {exc}") from exc
        self._collect_garbage(set(blobs.referenced))
        result = CheckpointResult(
            path=str(self.state_path),
            time=header["time"],
            seconds=time.monotonic() - started,
            names=header["names"],
            modules=selection.modules,
            lost=lost,
            tensors_bytes=blobs.tensor_bytes,
            bytes_written=blobs.bytes_written,
            blobs_written=blobs.blobs_written,
            execution_count=execution_count,
        )
        self.last = result
        return result

    def _collect_garbage(self, keep: set[str]) -> None:
        # Replaced blobs are deleted off the critical path: unlinking gigabytes takes a while.
        # The cache forgets them first, so no later checkpoint can name a blob being deleted.
        stale = store.unreferenced_blobs(self.root, keep)
        if not stale:
            return
        self.cache.forget_blobs({p.name for p in stale})
        self._gc = threading.Thread(target=store.remove_files, args=(stale,),
                                    name="gpufrac-checkpoint-gc", daemon=True)
        self._gc.start()

    def wait_for_cleanup(self) -> None:
        """Wait until blobs replaced by the last checkpoint are deleted."""
        if self._gc is not None:
            self._gc.join()
            self._gc = None

    def _find_unpicklable(
        self, values: dict[str, Any], blobs: pickling.BlobWriter, ns: dict[str, Any]
    ) -> dict[str, str]:
        bad: dict[str, str] = {}
        for name, value in values.items():
            reason = pickling.unpicklable_reason(name, value, blobs, ns)
            if reason is not None:
                bad[name] = reason
        return bad

    def load(self, ns: dict[str, Any], *, device: str | None = None) -> LoadResult:
        """Restore the committed checkpoint into ``ns``; tensors from a GPU land on ``device``."""
        with self._lock:
            return self._load(ns, device or torch_adapter.current_device())

    def _load(self, ns: dict[str, Any], device: str) -> LoadResult:
        path = self.state_path
        try:
            store.check_private(self.root, directory=True)
            if not path.exists():
                raise CheckpointError(f"there is no checkpoint in {self.root}")
            store.check_private(path, directory=False)
            store.check_private(self.root / store.BLOB_DIR, directory=True)
        except store.UnsafeCheckpointError as exc:
            raise CheckpointError(str(exc)) from exc
        except FileNotFoundError as exc:
            raise CheckpointError(f"there is no checkpoint in {self.root}") from exc
        with open(path, "rb") as fh:
            header, payload_end = _read_trailer(fh, path)
            fh.seek(len(MAGIC))
            limited = _Limited(fh, payload_end)
            restored_tensors: list[tuple[Any, str]] = []
            target: dict[str, Any] = {}
            unpickler = pickling.NamespaceUnpickler(
                limited, self.root, ns, device, lambda t, b: restored_tensors.append((t, b))
            )
            try:
                payload = unpickler.load()
            except store.UnsafeCheckpointError as exc:
                raise CheckpointError(str(exc)) from exc
            except Exception as exc:
                raise CheckpointError(
                    f"the checkpoint in {self.root} could not be read: {type(exc).__name__}: {exc}"
                ) from exc
        target.update(payload["values"])
        lost = dict(header.get("lost", {}))
        modules: list[str] = []
        for name, module_name in header.get("modules", {}).items():
            try:
                target[name] = importlib.import_module(module_name)
                modules.append(name)
            except Exception as exc:
                lost[name] = f"import {module_name} failed: {type(exc).__name__}: {exc}"
        ns.update(target)
        rng_done = rng.restore(payload.get("rng", {}))
        for tensor, blob in restored_tensors:
            self.cache.remember(tensor, blob)
        return LoadResult(
            checkpoint_time=float(header.get("time", 0.0)),
            execution_count=header.get("execution_count"),
            restored=sorted(payload["values"]),
            lost=lost,
            modules=sorted(modules),
            rng=rng_done,
            moved_to_cpu_bytes=unpickler.moved_to_cpu_bytes,
            header=header,
            rng_state=dict(payload.get("rng", {})),
        )

    def read_header(self) -> dict[str, Any] | None:
        """The committed checkpoint's JSON header (no unpickling), or None when there is none."""
        try:
            with open(self.state_path, "rb") as fh:
                return _read_trailer(fh, self.state_path)[0]
        except (OSError, CheckpointError):
            return None


def _write_trailer(fh: IO[bytes], header: dict[str, Any]) -> None:
    data = json.dumps(header, sort_keys=True).encode()
    fh.write(data)
    fh.write(_TRAILER.pack(len(data)))
    fh.write(MAGIC)


def _read_trailer(fh: IO[bytes], path: Path) -> tuple[dict[str, Any], int]:
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


class _Limited:
    """A read-only view of a file up to ``end``, so the unpickler cannot run into the header."""

    def __init__(self, fh: IO[bytes], end: int) -> None:
        self._fh = fh
        self._end = end

    def read(self, n: int = -1) -> bytes:
        left = self._end - self._fh.tell()
        if n < 0 or n > left:
            n = max(left, 0)
        return self._fh.read(n)

    def readline(self) -> bytes:
        left = self._end - self._fh.tell()
        return self._fh.readline(max(left, 0))

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        data = self.read(len(view))
        view[: len(data)] = data
        return len(data)
