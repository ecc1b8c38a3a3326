"""Restoring a checkpoint: its groups unpickled, their blobs read ahead, within a budget or deferred."""

from __future__ import annotations

import collections
import importlib
import io
import logging
import pickle
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jupyter_gpufrac.kernel import rng, store, stream, tensor_io, torch_adapter
from jupyter_gpufrac.kernel.groups import defer, group_size
from jupyter_gpufrac.kernel.snapshot import Snapshots, collector_paused
from jupyter_gpufrac.kernel.state_file import CheckpointError, check_format, current_header, header_generation
from jupyter_gpufrac.kernel.unpickler import NamespaceUnpickler

log = logging.getLogger(__name__)

READ_THREADS = 4
READ_AHEAD = 512 * 1024 * 1024


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


def load(
    state: Snapshots, folder: store.CheckpointDir, ns: dict[str, Any], device: str | None,
    budget: int | None, measure: str,
) -> LoadResult:
    """Restore the state committed in ``folder`` into ``ns`` (see :meth:`Checkpointer.load`);
    ``state`` learns the generation, the groups left on disk and the tensors restored, which
    the next snapshot builds on."""
    try:
        header = current_header(folder)
    except store.UnsafeCheckpointError as exc:
        raise CheckpointError(str(exc)) from exc
    except FileNotFoundError as exc:
        raise CheckpointError(f"there is no checkpoint in {state.root}") from exc
    check_format(header, state.root, "nothing was loaded")
    state.generation = max(state.generation, header_generation(header))
    groups = [g for g in header.get("groups", []) if isinstance(g, dict)]
    deferred = defer(groups, budget, measure) if budget is not None else []
    target, lost, restored_tensors, moved_to_cpu = load_groups(
        folder, [g for g in groups if g not in deferred], ns, device)
    lost = {**header.get("lost", {}), **lost}
    state.deferred = deferred
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
        state.cache.remember(tensor, blob)
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


def load_deferred(
    state: Snapshots, ns: dict[str, Any], names: Sequence[str], device: str | None
) -> tuple[list[str], dict[str, str]]:
    """Load the groups ``state`` left on disk (see :meth:`Checkpointer.load_deferred`)."""
    wanted = [g for g in state.deferred if not names or set(names) & set(g["names"])]
    unknown = sorted(set(names) - {n for g in state.deferred for n in g["names"]})
    if unknown:
        raise CheckpointError(f"not kept on disk: {', '.join(unknown)}")
    with open_folder(state.root) as folder, collector_paused():
        values, lost, tensors, _ = load_groups(folder, wanted, ns, device)
    restored = sorted(name for name in values if name not in ns)
    ns.update({name: values[name] for name in restored})
    for tensor, blob in tensors:
        state.cache.remember(tensor, blob)
    state.deferred = [g for g in state.deferred if g not in wanted]
    return restored, lost


def open_folder(root: Path) -> store.CheckpointDir:
    """The checkpoint directory, opened and checked once for one restore."""
    try:
        return store.CheckpointDir.open(root)
    except store.UnsafeCheckpointError as exc:
        raise CheckpointError(str(exc)) from exc
    except FileNotFoundError as exc:
        raise CheckpointError(f"there is no checkpoint in {root}") from exc


def load_groups(
    folder: store.CheckpointDir, groups: list[dict[str, Any]], ns: dict[str, Any],
    device: str | None,
) -> tuple[dict[str, Any], dict[str, str], list[tuple[Any, str]], int]:
    """Unpickle ``groups``: (values, lost with why, restored tensors with blobs, bytes
    moved to the host)."""
    restored_tensors: list[tuple[Any, str]] = []
    storages: dict[tuple[str, str], Any] = {}
    target: dict[str, Any] = {}
    lost: dict[str, str] = {}
    moved_to_cpu = 0
    with _ReadAhead(folder, groups, device) as ahead:
        for group in groups:
            names = [str(name) for name in group.get("names", [])]
            try:
                data = _group_pickle(group, ahead)
                unpickler = NamespaceUnpickler(
                    io.BytesIO(data), ns, device, ahead.storage,
                    lambda t, b: restored_tensors.append((t, b)), storages,
                    buffers=(ahead.buffer(str(blob), int(n))
                             for blob, n in group.get("buffers", [])),
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


def _group_pickle(group: Mapping[str, Any], ahead: _ReadAhead) -> memoryview:
    """The pickle of one group, cut out of its pack."""
    pack = ahead.pack(str(group["blob"]))
    offset, length = int(group.get("offset", 0)), int(group["pickle"])
    if offset < 0 or length < 0 or offset + length > len(pack):
        raise ValueError(f"pack {group['blob']} is shorter than the checkpoint says")
    return memoryview(pack)[offset:offset + length]


class _ReadAhead:
    """Reads the storages and buffers a restore needs ahead of the unpickling, several at once
    (the disk sees a queue, and reading overlaps unpickling), at most READ_AHEAD bytes of host
    memory ahead.

    A storage is read once (groups that view one storage share it), straight onto the device
    it is restored to (see :class:`stream.Streamer`); a buffer once per use (two arrays must not
    share memory because their bytes are equal).
    """

    def __init__(self, folder: store.CheckpointDir, groups: list[dict[str, Any]],
                 device: str | None) -> None:
        self._folder = folder
        self._plan: list[tuple[str, str, int, str]] = []
        planned: set[str] = set()
        storages = any(group.get("tensors") for group in groups)
        if storages:
            # Here, not in a reading thread: torch's first import is not safe to run in two
            # threads at once (the unpickler may import it meanwhile).
            import torch  # noqa: F401
        gpu = device if device is not None else (torch_adapter.current_device() if storages
                                                 else "cpu")
        for group in groups:
            on_gpu = set(group.get("gpu", []))
            once = [("pack", str(group.get("blob")), int(group.get("pickle", 0)), "cpu")] + [
                ("storage", str(b), int(n), gpu if b in on_gpu else "cpu")
                for b, n in group.get("tensors", {}).items()]
            for kind, blob, nbytes, target in once:
                if blob not in planned:
                    planned.add(blob)
                    self._plan.append((kind, blob, nbytes, target))
            self._plan += [("buffer", str(b), int(n), "cpu") for b, n in group.get("buffers", [])]
        self._pool = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="gpufrac-restore")
        self._streamer = stream.Streamer(folder, self._pool)
        self._pending: dict[tuple[str, str, str], collections.deque[Future[Any]]] = {}
        self._next = 0
        self._ahead = 0
        self._packs: dict[str, bytes] = {}

    def __enter__(self) -> _ReadAhead:
        self._fill()
        return self

    def __exit__(self, *exc: object) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._streamer.close()

    @staticmethod
    def _host_bytes(nbytes: int, target: str) -> int:
        """Host memory an item holds until it is taken (a device storage holds none)."""
        return nbytes if target == "cpu" else 0

    def _fill(self) -> None:
        while self._next < len(self._plan) and (self._ahead < READ_AHEAD or not self._pending):
            kind, blob, nbytes, target = self._plan[self._next]
            self._next += 1
            future = (self._streamer.submit(blob, nbytes, target) if kind == "storage"
                      else self._pool.submit(self._read, kind, blob, nbytes))
            self._pending.setdefault((kind, blob, target), collections.deque()).append(future)
            self._ahead += self._host_bytes(nbytes, target)

    def _read(self, kind: str, blob: str, nbytes: int) -> Any:
        if kind == "pack":
            return tensor_io.read_pack(self._folder, blob)
        return tensor_io.read_buffer(self._folder, blob, nbytes)

    def _take(self, kind: str, blob: str, nbytes: int, target: str = "cpu") -> Any:
        queue = self._pending.get((kind, blob, target))
        if not queue:
            # Not planned (a damaged header): read now.
            if kind == "storage":
                return self._streamer.take(self._streamer.submit(blob, nbytes, target))
            return self._read(kind, blob, nbytes)
        future = queue.popleft()
        if not queue:
            del self._pending[(kind, blob, target)]
        self._ahead -= self._host_bytes(nbytes, target)
        self._fill()
        return self._streamer.take(future) if kind == "storage" else future.result()

    def pack(self, blob: str) -> bytes:
        """Pack ``blob``'s bytes (read once: the groups in it share them)."""
        if blob not in self._packs:
            self._packs[blob] = self._take("pack", blob, 0)
        return self._packs[blob]

    def storage(self, blob: str, nbytes: int, target: str) -> Any:
        """Storage ``blob`` on ``target`` (a device, or ``cpu``)."""
        return self._take("storage", blob, nbytes, target)

    def buffer(self, blob: str, nbytes: int) -> Any:
        """A new writable buffer holding ``blob``."""
        return self._take("buffer", blob, nbytes)


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
