"""Take and load incremental namespace checkpoints in a private directory."""

from __future__ import annotations

import importlib
import io
import json
import logging
import os
import pickle
import struct
import sys
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any, TypeVar

from jupyter_gpufrac.kernel import namespace, pickling, rng, store, torch_adapter

log = logging.getLogger(__name__)

MAGIC = b"GPUFRAC-CKPT-1\n"
# 2: variables saved per group of shared references, each group a content-addressed blob.
FORMAT = 2
_TRAILER = struct.Struct(">Q")  # header length, after the JSON header, before the end magic
MAX_ATTEMPTS = 3
T = TypeVar("T")


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
    bytes_written: int  # tensor (storage) bytes written: unchanged tensors cost nothing
    blobs_written: int
    execution_count: int | None = None
    group_bytes_written: int = 0  # pickled variables written: unchanged groups cost nothing
    groups_written: int = 0

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
    # Variables left on disk because they did not fit the budget: name -> bytes.
    deferred: dict[str, int] = field(default_factory=dict)


class Checkpointer:
    """Checkpoints one namespace into one directory, reusing blobs of unchanged tensors."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.cache = pickling.IncrementalCache()
        self._lock = threading.Lock()
        self.last: CheckpointResult | None = None
        self._gc: threading.Thread | None = None
        # Groups a budgeted restore left on disk: every checkpoint keeps them until they are
        # loaded (``load_deferred``) or their names are bound anew.
        self.deferred: list[dict[str, Any]] = []

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
            folder = store.CheckpointDir.open(self.root, create=True)
        except (OSError, store.UnsafeCheckpointError) as exc:
            raise CheckpointError(f"cannot use checkpoint directory {self.root}: {exc}") from exc
        with folder:
            folder.remove_stale_tmp()
            if full:
                self.cache.clear()
            selection = namespace.select(ns, hidden)
            lost: dict[str, str] = {name: "a module object that is not importable"
                                    for name in selection.skipped}
            blobs = pickling.BlobWriter(folder, self.cache)
            groups: list[dict[str, Any]] = []
            try:
                for names in group_names(selection.values, blobs, ns):
                    saved = self._save_group(names, selection.values, blobs, ns, lost)
                    if saved is not None:
                        groups.append(saved)
                groups += self._carry_deferred(ns, blobs)
                rng_blob = blobs.group_blob(pickle.dumps(rng.capture(), pickle.HIGHEST_PROTOCOL))
                # Blobs durable first, then the state file that names them: a kill or crash
                # in between leaves the previous state whole, and its blobs untouched.
                folder.sync_blobs(blobs.new_blobs)
                names = sorted(name for group in groups for name in group["names"])
                header: dict[str, Any] = {
                    "format": FORMAT,
                    "time": time.time(),
                    "execution_count": execution_count,
                    "names": names,
                    "modules": selection.modules,
                    "lost": lost,
                    "groups": groups,
                    "rng": rng_blob,
                    "matplotlib_backend": _matplotlib_backend(),
                    "blobs": blobs.referenced,
                    "tensors_bytes": blobs.tensor_bytes,
                    "pid": os.getpid(),
                    **dict(extra),
                }
                with folder.atomic_writer(store.STATE_FILE) as fh:
                    fh.write(MAGIC)
                    _write_trailer(fh, header)
            except OSError as exc:
                raise CheckpointError(f"writing the checkpoint to {self.root} failed: {exc}") from exc
            self._collect_garbage(folder, set(blobs.referenced))
        result = CheckpointResult(
            path=str(self.state_path),
            time=header["time"],
            seconds=time.monotonic() - started,
            names=names,
            modules=selection.modules,
            lost=lost,
            tensors_bytes=blobs.tensor_bytes,
            bytes_written=blobs.bytes_written,
            blobs_written=blobs.blobs_written,
            execution_count=execution_count,
            group_bytes_written=blobs.group_bytes_written,
            groups_written=blobs.groups_written,
        )
        self.last = result
        return result

    def _save_group(
        self, names: list[str], values: Mapping[str, Any], blobs: pickling.BlobWriter,
        ns: dict[str, Any], lost: dict[str, str],
    ) -> dict[str, Any] | None:
        """Pickle variables that share references as one unit; members that fail are dropped."""
        members = {name: values[name] for name in names}
        for _attempt in range(MAX_ATTEMPTS):
            buffer = io.BytesIO()
            mark = blobs.mark()
            blobs.reached = {}
            try:
                pickling.NamespacePickler(buffer, blobs, ns).dump(members)
            except Exception as exc:
                blobs.rollback(mark)
                bad = {name: reason for name, value in members.items()
                       if (reason := pickling.unpicklable_reason(name, value, blobs, ns))}
                # Nothing alone fails, yet the whole does: say so for every member.
                why = f"{type(exc).__name__}: {exc}"[:300]
                for name, reason in (bad or dict.fromkeys(members, why)).items():
                    members.pop(name, None)
                    lost[name] = reason
                if not members:
                    return None
                continue
            data = buffer.getvalue()
            tensors = {blob: nbytes for blob, (nbytes, _) in blobs.reached.items()}
            on_gpu = sorted(blob for blob, (_, device) in blobs.reached.items() if device != "cpu")
            return {"names": sorted(members), "blob": blobs.group_blob(data), "pickle": len(data),
                    "tensors": tensors, "gpu": on_gpu}
        for name in members:
            lost[name] = "pickling kept failing for the variables it shares objects with"
        return None

    def _carry_deferred(self, ns: Mapping[str, Any], blobs: pickling.BlobWriter) -> list[dict[str, Any]]:
        """The deferred groups, for names the notebook has not bound anew; their blobs kept."""
        carried = []
        for group in self.deferred:
            names = [name for name in group["names"] if name not in ns]
            if not names:
                continue
            carried.append({**group, "names": names})
            for blob, nbytes in {group["blob"]: 0, **group.get("tensors", {})}.items():
                blobs.referenced.setdefault(blob, int(nbytes))
        self.deferred = carried
        return carried

    def _collect_garbage(self, folder: store.CheckpointDir, keep: set[str]) -> None:
        # Replaced blobs are deleted off the critical path: unlinking gigabytes takes a while.
        # The cache forgets them first, so no later checkpoint can name a blob being deleted.
        stale = folder.unreferenced_blobs(keep)
        if not stale:
            return
        self.cache.forget_blobs(set(stale))
        self._gc = threading.Thread(target=_remove_blobs, args=(folder.dup(), stale),
                                    name="gpufrac-checkpoint-gc", daemon=True)
        self._gc.start()

    def wait_for_cleanup(self) -> None:
        """Wait until blobs replaced by the last checkpoint are deleted."""
        if self._gc is not None:
            self._gc.join()
            self._gc = None

    def load(
        self, ns: dict[str, Any], *, device: str | None = None, budget: int | None = None,
        measure: str = "gpu_bytes",
    ) -> LoadResult:
        """Restore the committed checkpoint into ``ns``; tensors from a GPU land on ``device``
        (by default the kernel's CUDA device, asked once torch is loaded, else the CPU).

        With a ``budget`` (bytes, counted by each group's ``measure``: ``gpu_bytes`` or
        ``bytes``), the largest variables are left on disk until the rest fits; they are
        named in ``deferred`` and :meth:`load_deferred` brings them back.
        """
        with self._lock, self._open() as folder:
            return self._load(folder, ns, device, budget, measure)

    def load_deferred(
        self, ns: dict[str, Any], names: Sequence[str] = (), *, device: str | None = None
    ) -> tuple[list[str], dict[str, str]]:
        """Load deferred variables (those named, or all): (restored names, lost with why).

        A name bound anew since the restore keeps its new value.
        """
        with self._lock:
            wanted = [g for g in self.deferred if not names or set(names) & set(g["names"])]
            unknown = sorted(set(names) - {n for g in self.deferred for n in g["names"]})
            if unknown:
                raise CheckpointError(f"not kept on disk: {', '.join(unknown)}")
            with self._open() as folder:
                values, lost, tensors, _ = self._load_groups(folder, wanted, ns, device)
            restored = sorted(name for name in values if name not in ns)
            ns.update({name: values[name] for name in restored})
            for tensor, blob in tensors:
                self.cache.remember(tensor, blob)
            self.deferred = [g for g in self.deferred if g not in wanted]
            return restored, lost

    def _open(self) -> store.CheckpointDir:
        """The checkpoint directory, opened and checked once for one restore."""
        try:
            return store.CheckpointDir.open(self.root)
        except store.UnsafeCheckpointError as exc:
            raise CheckpointError(str(exc)) from exc
        except FileNotFoundError as exc:
            raise CheckpointError(f"there is no checkpoint in {self.root}") from exc

    def _load_groups(
        self, folder: store.CheckpointDir, groups: list[dict[str, Any]], ns: dict[str, Any],
        device: str | None,
    ) -> tuple[dict[str, Any], dict[str, str], list[tuple[Any, str]], int]:
        """Unpickle ``groups``: (values, lost with why, restored tensors with blobs, bytes
        moved to the host)."""
        restored_tensors: list[tuple[Any, str]] = []
        storages: dict[tuple[str, str], Any] = {}
        target: dict[str, Any] = {}
        lost: dict[str, str] = {}
        moved_to_cpu = 0
        for group in groups:
            names = [str(name) for name in group.get("names", [])]
            try:
                data = folder.read_bytes(str(group["blob"]), blob=True)
                unpickler = pickling.NamespaceUnpickler(
                    io.BytesIO(data), folder, ns, device,
                    lambda t, b: restored_tensors.append((t, b)), storages,
                )
                values = unpickler.load()
                moved_to_cpu += unpickler.moved_to_cpu_bytes
            except store.UnsafeCheckpointError as exc:
                raise CheckpointError(str(exc)) from exc
            except oom_types() as exc:
                # Out of GPU memory is about where tensors go, not about this group: the
                # caller retries on the host rather than losing the variables.
                raise CheckpointError(f"out of GPU memory while restoring {names}") from exc
            except Exception as exc:
                # One group that cannot be rebuilt costs only its own variables.
                why = f"could not be loaded: {type(exc).__name__}: {exc}"[:300]
                lost.update(dict.fromkeys(names, why))
                continue
            # A carried group names only the members not bound anew since it was deferred.
            target.update({name: value for name, value in values.items() if name in names})
        return target, lost, restored_tensors, moved_to_cpu

    def _load(
        self, folder: store.CheckpointDir, ns: dict[str, Any], device: str | None,
        budget: int | None, measure: str,
    ) -> LoadResult:
        try:
            data = folder.read_bytes(store.STATE_FILE)
        except store.UnsafeCheckpointError as exc:
            raise CheckpointError(str(exc)) from exc
        except FileNotFoundError as exc:
            raise CheckpointError(f"there is no checkpoint in {self.root}") from exc
        header, _ = _read_trailer(io.BytesIO(data), self.state_path)
        if header.get("format") != FORMAT:
            raise CheckpointError(f"the checkpoint in {self.root} has format "
                                  f"{header.get('format')!r}; this version reads {FORMAT}")
        groups = [g for g in header.get("groups", []) if isinstance(g, dict)]
        deferred = defer(groups, budget, measure) if budget is not None else []
        target, lost, restored_tensors, moved_to_cpu = self._load_groups(
            folder, [g for g in groups if g not in deferred], ns, device)
        lost = {**header.get("lost", {}), **lost}
        self.deferred = deferred
        rng_state: dict[str, Any] = {}
        if header.get("rng"):
            try:
                rng_state = pickle.loads(folder.read_bytes(str(header["rng"]), blob=True))
            except store.UnsafeCheckpointError as exc:
                raise CheckpointError(str(exc)) from exc
            except Exception as exc:
                log.warning("gpufrac: the random generators' state could not be read: %s", exc)
        _use_matplotlib_backend(header.get("matplotlib_backend"))
        modules: list[str] = []
        for name, module_name in header.get("modules", {}).items():
            try:
                target[name] = importlib.import_module(module_name)
                modules.append(name)
            except Exception as exc:
                lost[name] = f"import {module_name} failed: {type(exc).__name__}: {exc}"
        ns.update(target)
        rng_done = rng.restore(rng_state)
        for tensor, blob in restored_tensors:
            self.cache.remember(tensor, blob)
        return LoadResult(
            checkpoint_time=float(header.get("time", 0.0)),
            execution_count=header.get("execution_count"),
            restored=sorted(name for name in target if name not in modules),
            lost=lost,
            modules=sorted(modules),
            rng=rng_done,
            moved_to_cpu_bytes=moved_to_cpu,
            header=header,
            rng_state=rng_state,
            deferred={name: group_size([g], measure) for g in deferred for name in g["names"]},
        )

    def read_header(self) -> dict[str, Any] | None:
        """The committed checkpoint's JSON header (no unpickling), or None when there is none
        or it is not ours alone."""
        try:
            with store.CheckpointDir.open(self.root) as folder:
                data = folder.read_bytes(store.STATE_FILE)
            return _read_trailer(io.BytesIO(data), self.state_path)[0]
        except (OSError, CheckpointError, store.UnsafeCheckpointError):
            return None


def _remove_blobs(folder: store.CheckpointDir, names: list[str]) -> None:
    with folder:
        folder.remove_blobs(names)


def components(items: Iterable[T], joined: Iterable[tuple[T, T]]) -> list[list[T]]:
    """``items`` split into the sets that the ``joined`` pairs connect, in first-seen order."""
    parent: dict[T, T] = {item: item for item in items}

    def find(item: T) -> T:
        while parent[item] != item:
            parent[item] = parent[parent[item]]
            item = parent[item]
        return item

    for a, b in joined:
        parent[find(a)] = find(b)
    found: dict[T, list[T]] = {}
    for item in parent:
        found.setdefault(find(item), []).append(item)
    return list(found.values())


def group_size(groups: list[dict[str, Any]], measure: str) -> int:
    """Bytes ``groups`` take once loaded: ``bytes`` (pickles and storages, each storage once)
    or ``gpu_bytes`` (storages that go to the GPU)."""
    tensors: dict[str, int] = {}
    on_gpu: set[str] = set()
    for group in groups:
        tensors.update(group.get("tensors", {}))
        on_gpu.update(group.get("gpu", []))
    if measure == "gpu_bytes":
        return sum(int(n) for blob, n in tensors.items() if blob in on_gpu)
    return sum(int(g.get("pickle", 0)) for g in groups) + sum(int(n) for n in tensors.values())


def defer(groups: list[dict[str, Any]], budget: int, measure: str) -> list[dict[str, Any]]:
    """The groups to leave on disk so that the rest, counted by ``measure``, fits ``budget``.

    Groups that share a tensor storage go together (a view must stay a view of its base); the
    largest go first, so the fewest variables wait.
    """
    holder: dict[str, int] = {}
    joined = [(i, holder.setdefault(blob, i))
              for i, group in enumerate(groups) for blob in group.get("tensors", {})]
    units = components(range(len(groups)), joined)

    def size(unit: list[int]) -> int:
        return group_size([groups[i] for i in unit], measure)

    total = sum(size(unit) for unit in units)
    chosen: list[int] = []
    for unit in sorted(units, key=size, reverse=True):
        if total <= budget:
            break
        if size(unit) > 0:
            chosen += unit
            total -= size(unit)
    return [groups[i] for i in sorted(chosen)]


def group_names(
    values: Mapping[str, Any], blobs: pickling.BlobWriter, ns: dict[str, Any]
) -> list[list[str]]:
    """Names whose values share objects (aliases, a model and its optimizer, an instance and its
    cell class), grouped: each group is pickled as one unit so they stay shared after a restore.

    Each value is pickled alone, without writing anything, to learn what it reaches; a value
    that cannot be pickled alone is its own group (its failure is reported when it is saved).
    """
    owner: dict[int, str] = {}
    joined: list[tuple[str, str]] = []
    dry = pickling.BlobWriter(blobs.folder, blobs.cache, dry=True)
    # Everything each pickling met stays alive until the grouping is done: a temporary freed
    # after one variable's pickling could lend its id to an object of the next one.
    alive: list[Any] = []
    for name, value in values.items():
        pickler = pickling.NamespacePickler(pickling.NullSink(), dry, ns)
        wrapper = {name: value}
        try:
            pickler.dump(wrapper)
        except Exception:
            continue
        alive.append(pickler.memo.copy())
        joined += [(name, owner.setdefault(key, name))
                   for key in pickler.shared_ids() - {id(wrapper)}]
    return [sorted(names) for names in components(values, joined)]


def _matplotlib_backend() -> str | None:
    """The plotting backend the notebook chose (``matplotlib.use``, ``%matplotlib``), if loaded."""
    matplotlib = sys.modules.get("matplotlib")
    try:
        return None if matplotlib is None else str(matplotlib.get_backend())
    except Exception:  # a broken backend must not cost the checkpoint
        return None


def _use_matplotlib_backend(backend: object) -> None:
    # Before pyplot is imported again: a fresh kernel would otherwise pick its default backend,
    # and a notebook that plotted off-screen would start showing every figure.
    if not isinstance(backend, str) or not backend:
        return
    try:
        matplotlib = importlib.import_module("matplotlib")
        matplotlib.use(backend)
    except Exception as exc:
        log.warning("gpufrac: matplotlib backend %s not restored: %s", backend, exc)


def oom_types() -> tuple[type[BaseException], ...]:
    """PyTorch's out-of-memory errors, once torch is loaded."""
    return torch_adapter.oom_exception_types()


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
