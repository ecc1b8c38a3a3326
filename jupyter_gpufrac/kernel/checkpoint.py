"""Take and load incremental namespace checkpoints in a private directory."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import gc
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
import zlib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any, TypeVar

from jupyter_gpufrac.kernel import (
    budget,
    forkwrite,
    namespace,
    rng,
    snapshot,
    store,
    tensor_io,
    torch_adapter,
)
from jupyter_gpufrac.kernel.blobs import BlobWriteError, BlobWriter, IncrementalCache, PandasGuard
from jupyter_gpufrac.kernel.fingerprints import Fingerprint, Fingerprints, FingerprintSession
from jupyter_gpufrac.kernel.pickler import NamespacePickler, NullSink, unpicklable_reason
from jupyter_gpufrac.kernel.unpickler import NamespaceUnpickler
from node_agent.quantities import format_bytes

log = logging.getLogger(__name__)

MAGIC = b"GPUFRAC-CKPT-1\n"
# 3: groups of shared references pickled with protocol 5, packed into content-addressed blobs
# (offset, length); large out-of-band buffers in content-addressed blobs of their own.
FORMAT = 3
# What a restore reads: 2 is what the previous release writes (each group's pickle a whole blob,
# tensors, storages and the namespace as persistent ids): a kernel checkpointed before an
# upgrade and restored after it keeps its variables.
READS = (2, 3)
_TRAILER = struct.Struct(">Q")  # header length, after the JSON header, before the end magic
MAX_ATTEMPTS = 3
PACK_BYTES = 64 * 1024  # a pack holds small pickles up to about this size
PACK_SPREAD = 128  # about this many small groups per pack
READ_THREADS = 4
READ_AHEAD = 512 * 1024 * 1024
T = TypeVar("T")


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """The cyclic garbage collector off, during a checkpoint or a restore. A checkpoint makes
    many short-lived objects and no cycles, and each collection it set off walked the young
    objects of the namespace (0.7 ms a checkpoint with 1,000 variables). A restore makes
    objects that all live on, and collections over ever more of them made restoring a list
    of a million small records take 2.57 s instead of 1.17 s (one collection is left, when
    the collector is back on)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


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
    bytes_written: int  # storage and buffer bytes written: unchanged ones cost nothing
    blobs_written: int
    execution_count: int | None = None
    group_bytes_written: int = 0  # packs of pickled variables written
    groups_written: int = 0  # groups pickled anew: unchanged ones cost nothing
    buffers_bytes: int = 0  # out-of-band buffers (arrays, columns) the checkpoint holds
    durable: bool = False  # written and synced (else a snapshot on its way to the disk)
    # Counts this kernel's committed states: a restore of a lower one goes back in time.
    generation: int = 0
    # Variables left out to stay within the disk budget (name -> bytes), and which budget.
    unprotected: dict[str, int] = field(default_factory=dict)
    unprotected_why: str | None = None

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


@dataclass
class _Packs:
    """Where groups were packed: pack blob -> bytes, and which pickles each pack holds."""

    sizes: dict[str, int]
    composition: dict[tuple[int, ...], str]


@dataclass
class _Group:
    """A group as the last checkpoint saved it: its header record and, unless it fills a pack
    of its own, its pickle (to pack it again with its neighbours without re-pickling it)."""

    record: dict[str, Any]
    data: bytes | None


@dataclass
class _Saved:
    """What this process last committed, to write only what changed since."""

    fingerprints: Fingerprints
    groups: dict[tuple[str, ...], _Group]
    packs: _Packs
    rest: str  # the header less groups and when, as JSON
    blobs: dict[str, int]  # every blob the state names
    header: dict[str, Any]
    state: tuple[int, int, int, int] | None  # unused: the writer knows the file it wrote
    digest: str  # of the state file's bytes, which the SEEN_FILE names


class Checkpointer:
    """Checkpoints one namespace into one directory, writing only what changed."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.cache = IncrementalCache()
        self._guard = PandasGuard()
        self._lock = threading.Lock()
        # The last durable checkpoint this process wrote, and the last snapshot it took.
        self.last: CheckpointResult | None = None
        self.taken: CheckpointResult | None = None
        self.writer = snapshot.Writer(self.root, self._committed)
        self._stale_lock = threading.Lock()
        self._stale: set[str] = set()  # blobs the writer deleted, for the caches to forget
        self._identity: tuple[int, int, int, int] | None = None  # of the state file it wrote
        # The last snapshot taken (written, or on its way): the next one writes what changed
        # since, naming its blobs (the writer writes them in order).
        self._saved: _Saved | None = None
        # The last grouping and what it was computed from (see _group_names).
        self._grouped: tuple[dict[str, tuple[int, ...]], list[list[str]]] | None = None
        self._cleaned = False  # leftovers of a killed writer are removed once per process
        # Groups a budgeted restore left on disk: every checkpoint keeps them until they are
        # loaded (``load_deferred``) or their names are bound anew.
        self.deferred: list[dict[str, Any]] = []
        # The newest generation known (committed here, loaded, on disk, or the server's): the
        # next state written is one more, so generations only grow whatever was restored.
        self.generation = 0
        # The disk budgets each checkpoint stays within (None: unbounded).
        self.limits: budget.DiskLimits | None = None
        # The memory a snapshot may copy at a cell's end (None: unbounded).
        self.staging_budget: int | None = None

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
        """Checkpoint ``ns`` (the notebook's globals) and return once it is durable; unpicklable
        variables are listed, not fatal.

        Only variables whose fingerprint changed are pickled again; ``full`` re-pickles and
        re-writes everything (after writes no fingerprint sees, see :mod:`blobs`).
        """
        started = time.monotonic()
        job = self.begin(ns, hidden=hidden, full=full, execution_count=execution_count,
                         extra=extra)
        try:
            written = job.wait()
        except snapshot.WriteError as exc:
            raise CheckpointError(str(exc)) from exc
        result = dataclasses.replace(job.result, seconds=time.monotonic() - started,
                                     durable=True)
        if written is not job:  # superseded: the snapshot written is a later one
            result = dataclasses.replace(written.result, seconds=result.seconds, durable=True)
        return result

    def begin(
        self,
        ns: dict[str, Any],
        *,
        hidden: Mapping[str, object] | None = None,
        full: bool = False,
        execution_count: int | None = None,
        extra: Mapping[str, Any] | None = None,
    ) -> snapshot.Job:
        """Take a snapshot of ``ns`` as it is now and queue it to be written in the background:
        in this thread only what changed is found, pickled, and its tensors' and buffers' bytes
        kept as they are (copied, or left to a forked child, see :mod:`snapshot`);
        :meth:`snapshot.Job.wait` waits for it to be durable."""
        with self._lock, collector_paused():
            job = self._take(ns, hidden, full, execution_count, extra or {})
        self.writer.submit(job)
        return job

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every snapshot taken is written (or failed); False on timeout."""
        return self.writer.flush(timeout)

    def status(self) -> dict[str, Any]:
        """The last durable checkpoint (its cell and time) and the one being written, if any,
        with its progress: what a restore now would load, and what is on its way."""
        durable = self.writer.durable
        cell: int | None
        when: float | None
        generation: int | None
        if durable is not None:
            cell, when = durable.cell, durable.time
            generation = getattr(durable.result, "generation", None)
        else:
            header = self.read_header()
            cell = header.get("execution_count") if header else None
            when = header.get("time") if header else None
            generation = header_generation(header) if header else None
        # What the newest snapshot left out (a restore lacks them once it is written); before
        # any in this process, what the committed one left out.
        newest = self.taken or self.last
        if newest is not None:
            unprotected, why = newest.unprotected, newest.unprotected_why
        else:
            found = self.read_header() or {}
            unprotected, why = dict(found.get("unprotected") or {}), found.get("unprotected_why")
        return {"durable_cell": cell, "durable_time": when, "writing": self.writer.writing(),
                "error": self.writer.error, "durable_generation": generation,
                "unprotected": unprotected, "unprotected_why": why}

    def _committed(self, job: snapshot.Job, stale: list[str]) -> None:
        """The writer made ``job`` durable (its thread); ``stale`` blobs are deleted next."""
        with self._stale_lock:
            self._stale.update(stale)
            if job.identity is not None:
                self._identity = job.identity
        if job.result is not None:
            self.last = dataclasses.replace(job.result, durable=True)

    def _take(
        self,
        ns: dict[str, Any],
        hidden: Mapping[str, object] | None,
        full: bool,
        execution_count: int | None,
        extra: Mapping[str, Any],
    ) -> snapshot.Job:
        started = time.monotonic()
        try:
            folder = store.CheckpointDir.open(self.root, create=True)
        except (OSError, store.UnsafeCheckpointError) as exc:
            raise CheckpointError(f"cannot use checkpoint directory {self.root}: {exc}") from exc
        with self._stale_lock:
            stale, self._stale = self._stale, set()
            identity = self._identity
        if stale:
            # Deleted by the writer: the caches forget them, so no later snapshot names them.
            self.cache.forget_blobs(stale)
            self._guard.forget_blobs(stale)
        with folder:
            if self.writer.reset:
                self.writer.reset = False
                self._saved = None
            if full:
                self.cache.clear()
                self._guard.clear()
                self._saved = None
            elif (self._saved is not None and not self.writer.busy()
                  and folder.identity(store.STATE_FILE) != identity):
                # Not the file this process wrote (removed, replaced): nothing it names is
                # trusted to be there; blobs are looked for again before they are reused.
                self._saved = None
            if self._saved is None and self.writer.busy():
                # What is on disk is the base: it must not change while it is read.
                self.writer.flush()
            try:
                if not self._cleaned:
                    folder.remove_stale_tmp()
                job = self._write(folder, ns, hidden, execution_count, extra)
            except (OSError, store.UnsafeCheckpointError) as exc:
                self._guard.abandon()
                raise CheckpointError(f"writing the checkpoint to {self.root} failed: {exc}") from exc
            except BaseException:
                self._guard.abandon()
                raise
            self._guard.commit()
            self._cleaned = True
        job.result.seconds = time.monotonic() - started
        self.taken = job.result
        return job

    def _write(
        self, folder: store.CheckpointDir, ns: dict[str, Any], hidden: Mapping[str, object] | None,
        execution_count: int | None, extra: Mapping[str, Any],
    ) -> snapshot.Job:
        """:meth:`_save` into a staging folder: blobs are staged (copied, or held for a forked
        child), written later by the writer."""
        saved = self._saved
        selection = namespace.select(ns, hidden)
        lost: dict[str, str] = {name: "a module object that is not importable"
                                for name in selection.skipped}
        staging = store.StagingDir(folder.path)
        if saved is None:
            # What is on disk may be newer than anything this process knows of.
            self.generation = max(self.generation, _disk_generation(folder))
        blobs = BlobWriter(staging, self.cache, guard=self._guard,
                                    trusted=saved.blobs.keys() if saved else _durable(folder))
        try:
            job = self._save(staging, ns, selection, lost, blobs, execution_count, extra)
            tensor_io.finish_snapshot(job.staged, folder)
            return job
        except BaseException:
            for staged in staging.staged.values():
                if staged.release is not None:
                    staged.release()
            raise
        finally:
            blobs.close()

    def _save(
        self, staging: store.StagingDir, ns: dict[str, Any], selection: namespace.Selection,
        lost: dict[str, str], blobs: BlobWriter, execution_count: int | None,
        extra: Mapping[str, Any],
    ) -> snapshot.Job:
        """Snapshot what changed: the job that writes it, and commits the state naming it."""
        saved = self._saved
        room = self.limits.room() if self.limits is not None else None
        # A tensor or an array alone larger than the budget is left out before its bytes are
        # copied: a budget must not cost the copy of what it cannot protect, at every cell.
        early: dict[str, int] = {}
        if room is not None:
            early = {name: size for name, value in selection.values.items()
                     if (size := budget.least_bytes(value)) > room.bytes}
            for name, size in early.items():
                del selection.values[name]
                lost[name] = _unprotected_reason(size, room)
        session = FingerprintSession(blobs, ns)
        try:
            taken = session.fingerprint_all(selection.values,
                                            saved.fingerprints if saved else None)
        finally:
            session.close()
        prints = taken.by_name
        over = self._over_staging(selection.values, prints, lost)
        if (saved is not None and prints == saved.fingerprints.by_name
                and None not in prints.values()):
            # Every variable is as the last checkpoint saved it (a cell that printed, plotted).
            groups, pickled, packs = saved.groups, 0, saved.packs
            # And what it could not pickle it still cannot (a fingerprint can be taken of what
            # does not pickle, a generator): it stays reported, or a restore would not say so.
            # So do the ones that did not fit the budget.
            lost.update((name, why) for name, why in saved.header["lost"].items() if name in prints)
            unprotected = {name: int(size) for name, size
                           in saved.header.get("unprotected", {}).items() if name in prints}
            why = saved.header.get("unprotected_why") if unprotected else None
            carried = self._carry_deferred(ns)
        else:
            changed, pickled = self._save_changed(selection.values, prints, blobs, ns, lost)
            carried = self._carry_deferred(ns)
            groups, unprotected, why = self._within_budget(changed, carried, lost, room)
            packs = pack_groups(list(groups.values()), blobs,
                                saved.packs.composition if saved else {})
        if early and room is not None:
            unprotected, why = {**early, **unprotected}, room.why
        if over and self.staging_budget is not None:
            staging_why = budget.staging_room(self.staging_budget).why
            unprotected = {**over, **unprotected}
            why = staging_why if why in (None, staging_why) else f"{why}; {staging_why}"
        rng_data = pickle.dumps(rng.capture(), pickle.HIGHEST_PROTOCOL)
        rest: dict[str, Any] = {
            "format": FORMAT, "modules": selection.modules, "lost": lost,
            "rng": blobs.pack_blob(rng_data), "matplotlib_backend": _matplotlib_backend(),
            "unprotected": unprotected, "unprotected_why": why,
            **dict(extra),
        }
        rest_key = json.dumps([rest, carried], sort_keys=True)
        now = time.time()
        if (saved is not None and groups is saved.groups and rest_key == saved.rest
                and not blobs.new_blobs):
            # Nothing the checkpoint holds changed: the state stays as it is, and only when,
            # and after which cell, it was last found current is noted.
            self._saved = dataclasses.replace(saved, fingerprints=taken)
            result = self._result(saved.header, now, execution_count, blobs, pickled)
            return snapshot.Job(execution_count, now, None, saved.digest,
                                frozenset(saved.blobs), {}, result)
        records = [g.record for g in groups.values()] + carried
        referenced = referenced_blobs(records, packs)
        referenced[rest["rng"]] = len(rng_data)
        # Each new state is one generation on (a superseded one leaves a gap): the writer
        # commits states in the order taken, so committed generations only grow.
        self.generation += 1
        header: dict[str, Any] = {
            **rest,
            "names": sorted(name for record in records for name in record["names"]),
            "groups": records,
            "blobs": referenced,
            "tensors_bytes": sum({b: n for r in records
                                  for b, n in r.get("tensors", {}).items()}.values()),
            "buffers_bytes": sum({b: n for r in records for b, n in r.get("buffers", [])}.values()),
            "time": now, "execution_count": execution_count, "pid": os.getpid(),
            "generation": self.generation,
        }
        data = MAGIC + _trailer(header)
        digest = tensor_io.digest(data)
        self._saved = _Saved(taken, groups, packs, rest_key, referenced, header, None, digest)
        staged = {name: item for name, item in staging.staged.items() if name in referenced}
        for name, item in staging.staged.items():
            if name not in referenced and item.release is not None:
                item.release()
        result = self._result(header, now, execution_count, blobs, pickled)
        return snapshot.Job(execution_count, now, data, digest, frozenset(referenced), staged,
                            result, state_cell=execution_count)

    def _over_staging(self, values: dict[str, Any],
                      prints: dict[str, Fingerprint | None],
                      lost: dict[str, str]) -> dict[str, int]:
        """The changed variables whose bytes this snapshot would copy into memory beyond the
        staging budget (smallest kept first, as on disk): taken out of ``values`` and ``prints``
        before anything is copied, and ``lost``, so a restore says they were not protected."""
        if self.staging_budget is None:
            return {}
        before = self._saved.fingerprints.by_name if self._saved is not None else {}
        # Two children still writing: this snapshot copies its host bytes too.
        forked = forkwrite.wanted() and forkwrite.live() < forkwrite.MAX_CHILDREN
        changed = [name for name, found in prints.items()
                   if found is None or before.get(name) != found]
        sizes = [budget.staged_bytes(values[name], forked) for name in changed]
        kept = set(budget.protect(sizes, self.staging_budget))
        over = {changed[i]: sizes[i] for i in range(len(changed)) if i not in kept}
        room = budget.staging_room(self.staging_budget)
        for name, size in over.items():
            del values[name], prints[name]
            lost[name] = _unprotected_reason(size, room)
        return over

    def _within_budget(
        self, groups: dict[tuple[str, ...], _Group], carried: list[dict[str, Any]],
        lost: dict[str, str], room: budget.Room | None,
    ) -> tuple[dict[tuple[str, ...], _Group], dict[str, int], str | None]:
        """The groups :func:`budget.protect` keeps under the disk budget (groups that share a
        storage kept or left out together), and the names left out with their bytes; those
        are also ``lost``, so a restore says they were not protected."""
        if room is None:
            return groups, {}, None
        records = [g.record for g in groups.values()]
        units = _sharing(records)
        sizes = [group_size([records[i] for i in unit], "bytes") for unit in units]
        left = max(0, room.bytes - group_size(carried, "bytes"))
        kept = {i for chosen in budget.protect(sizes, left) for i in units[chosen]}
        unprotected: dict[str, int] = {}
        for i, record in enumerate(records):
            if i not in kept:
                size = group_size([record], "bytes")
                for name in record["names"]:
                    unprotected[name] = size
                    lost[name] = _unprotected_reason(size, room)
        if not unprotected:
            return groups, {}, None
        return ({key: g for i, (key, g) in enumerate(groups.items()) if i in kept},
                unprotected, room.why)

    def _save_changed(
        self, values: Mapping[str, Any], prints: Mapping[str, Fingerprint | None],
        blobs: BlobWriter, ns: dict[str, Any], lost: dict[str, str],
    ) -> tuple[dict[tuple[str, ...], _Group], int]:
        """The groups of the namespace, each reused when its members' fingerprints did not change
        since the last checkpoint, else pickled; (groups by names, how many were pickled)."""
        saved = self._saved
        groups: dict[tuple[str, ...], _Group] = {}
        pickled = 0
        for names in self._group_names(values, prints, blobs, ns):
            old = saved.groups.get(tuple(names)) if saved else None
            if old is not None and saved is not None and all(
                prints[name] is not None and saved.fingerprints.by_name.get(name) == prints[name]
                for name in names
            ):
                groups[tuple(names)] = old
                continue
            pickled += 1
            group = self._save_group(names, values, blobs, ns, lost)
            if group is not None:
                groups[tuple(group.record["names"])] = group
        return groups, pickled

    def _group_names(
        self, values: Mapping[str, Any], prints: Mapping[str, Fingerprint | None],
        blobs: BlobWriter, ns: dict[str, Any],
    ) -> list[list[str]]:
        """:func:`group_names`, remembered: it depends only on the shareable objects each
        variable reaches, so while every variable reaches the same ones, it is the same."""
        reached = {name: found[1] for name, found in prints.items() if found is not None}
        if len(reached) < len(prints):
            self._grouped = None  # a variable without a fingerprint is learned by pickling it
            return group_names(values, prints, blobs, ns)
        if self._grouped is None or self._grouped[0] != reached:
            self._grouped = (reached, group_names(values, prints, blobs, ns))
        return self._grouped[1]

    def _result(self, header: Mapping[str, Any], now: float, execution_count: int | None,
                blobs: BlobWriter, pickled: int) -> CheckpointResult:
        return CheckpointResult(
            path=str(self.state_path), time=now, seconds=0.0, names=header["names"],
            modules=header["modules"], lost=header["lost"], tensors_bytes=header["tensors_bytes"],
            bytes_written=blobs.bytes_written, blobs_written=blobs.blobs_written,
            execution_count=execution_count, group_bytes_written=blobs.group_bytes_written,
            groups_written=pickled, buffers_bytes=header["buffers_bytes"],
            generation=header_generation(header),
            unprotected=dict(header.get("unprotected") or {}),
            unprotected_why=header.get("unprotected_why"),
        )

    def _save_group(
        self, names: list[str], values: Mapping[str, Any], blobs: BlobWriter,
        ns: dict[str, Any], lost: dict[str, str],
    ) -> _Group | None:
        """Pickle variables that share references as one unit; members that fail are dropped."""
        members = {name: values[name] for name in names}
        for _attempt in range(MAX_ATTEMPTS):
            buffer = io.BytesIO()
            blobs.start_group()
            try:
                NamespacePickler(buffer, blobs, ns).dump(members)
            except BlobWriteError:
                raise  # the disk, not the variables: the last good checkpoint stays
            except Exception as exc:
                bad = {name: reason for name, value in members.items()
                       if (reason := unpicklable_reason(name, value, blobs, ns))}
                # Nothing alone fails, yet the whole does: say so for every member.
                why = f"{type(exc).__name__}: {exc}"[:300]
                for name, reason in (bad or dict.fromkeys(members, why)).items():
                    members.pop(name, None)
                    lost[name] = reason
                if not members:
                    return None
                continue
            data = buffer.getvalue()
            record: dict[str, Any] = {"names": sorted(members), "pickle": len(data)}
            # Only what the group has: a namespace of many small variables has a small header.
            if blobs.reached:
                record["tensors"] = {blob: n for blob, (n, _) in blobs.reached.items()}
                record["gpu"] = sorted(b for b, (_, device) in blobs.reached.items()
                                       if device != "cpu")
            if blobs.buffers:
                record["buffers"] = blobs.buffers
            return _Group(record, data)
        for name in members:
            lost[name] = "pickling kept failing for the variables it shares objects with"
        return None

    def _carry_deferred(self, ns: Mapping[str, Any]) -> list[dict[str, Any]]:
        """The deferred groups, for names the notebook has not bound anew; their blobs kept."""
        carried = []
        for group in self.deferred:
            names = [name for name in group["names"] if name not in ns]
            if names:
                carried.append({**group, "names": names})
        self.deferred = carried
        return carried

    def wait_for_cleanup(self) -> None:
        """Wait until every snapshot taken is written and the blobs it replaced are deleted."""
        self.writer.flush()

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
        self.flush()  # what is on disk must not change while it is read
        with self._lock, self._open() as folder, collector_paused():
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
            with self._open() as folder, collector_paused():
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
        with _ReadAhead(folder, groups) as ahead:
            for group in groups:
                names = [str(name) for name in group.get("names", [])]
                try:
                    data = _group_pickle(group, ahead)
                    unpickler = NamespaceUnpickler(
                        io.BytesIO(data), folder, ns, device,
                        lambda t, b: restored_tensors.append((t, b)), storages,
                        buffers=(ahead.buffer(str(blob), int(n))
                                 for blob, n in group.get("buffers", [])),
                        fetch=ahead.storage,
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
            header = self._header(folder)
        except store.UnsafeCheckpointError as exc:
            raise CheckpointError(str(exc)) from exc
        except FileNotFoundError as exc:
            raise CheckpointError(f"there is no checkpoint in {self.root}") from exc
        _check_format(header, self.root, "nothing was loaded")
        self.generation = max(self.generation, header_generation(header))
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
                return self._header(folder)
        except (OSError, CheckpointError, store.UnsafeCheckpointError):
            return None

    def _header(self, folder: store.CheckpointDir) -> dict[str, Any]:
        return _current_header(folder)


def _current_header(folder: store.CheckpointDir) -> dict[str, Any]:
    """The state file's header, with when and after which cell it was last found current."""
    data = folder.read_bytes(store.STATE_FILE)
    header, _ = _read_trailer(io.BytesIO(data), folder.path / store.STATE_FILE)
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
    to stay within the disk budget with why; None when there is none or it is not ours."""
    try:
        with store.CheckpointDir.open(Path(root)) as folder:
            if not folder.exists(store.STATE_FILE):
                return None
            header = _current_header(folder)
    except (OSError, ValueError, CheckpointError, store.UnsafeCheckpointError):
        return None
    cell, when = header.get("execution_count"), header.get("time")
    unprotected = header.get("unprotected")
    return {
        "durable_cell": cell if isinstance(cell, int) and not isinstance(cell, bool) else None,
        "durable_time": float(when) if isinstance(when, int | float) else None,
        "durable_generation": header_generation(header),
        "unprotected": ({str(k): int(v) for k, v in unprotected.items()
                         if isinstance(v, int)} if isinstance(unprotected, dict) else {}),
        "unprotected_why": (str(header["unprotected_why"])[:1000]
                            if header.get("unprotected_why") else None),
    }


def header_generation(header: Mapping[str, Any]) -> int:
    """The generation a state's header names (0: none, written before generations)."""
    found = header.get("generation")
    return found if isinstance(found, int) and not isinstance(found, bool) and found > 0 else 0


def _disk_generation(folder: store.CheckpointDir) -> int:
    """The generation of the state committed in ``folder`` (0: none, or unreadable)."""
    try:
        header, _ = _read_trailer(io.BytesIO(folder.read_bytes(store.STATE_FILE)), folder.path)
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
            return _disk_generation(folder)
    except (OSError, store.UnsafeCheckpointError):
        return None


def _check_format(header: Mapping[str, Any], root: Path, outcome: str) -> None:
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


def _durable(folder: store.CheckpointDir) -> set[str]:
    """The blobs the committed state on disk names: its writer synced them before committing.

    A state of a newer format is refused: writing over it would delete the variables it holds,
    which a newer version could still restore.
    """
    try:
        header, _ = _read_trailer(io.BytesIO(folder.read_bytes(store.STATE_FILE)), folder.path)
    except (OSError, ValueError, CheckpointError, store.UnsafeCheckpointError):
        return set()  # none, or not ours alone: nothing is taken as synced
    found = header.get("format")
    if isinstance(found, int) and found > FORMAT:
        _check_format(header, folder.path, "it was not overwritten")
    blobs = header.get("blobs")
    return {str(name) for name in blobs} if isinstance(blobs, dict) else set()


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
    """Bytes ``groups`` take once loaded: ``bytes`` (pickles, buffers and storages, each storage
    once) or ``gpu_bytes`` (storages that go to the GPU)."""
    tensors: dict[str, int] = {}
    on_gpu: set[str] = set()
    for group in groups:
        tensors.update(group.get("tensors", {}))
        on_gpu.update(group.get("gpu", []))
    if measure == "gpu_bytes":
        return sum(int(n) for blob, n in tensors.items() if blob in on_gpu)
    buffers = sum(int(n) for group in groups for _, n in group.get("buffers", []))
    return (sum(int(g.get("pickle", 0)) for g in groups) + sum(int(n) for n in tensors.values())
            + buffers)


def _unprotected_reason(size: int, room: budget.Room) -> str:
    """What a restore says of a variable the budget left out."""
    return f"not protected: it takes {format_bytes(size)}, {room.why}"


def _sharing(groups: list[dict[str, Any]]) -> list[list[int]]:
    """Indexes of ``groups`` in sets that share a tensor storage (a view stays a view of its
    base only while the two are saved and loaded together)."""
    holder: dict[str, int] = {}
    joined = [(i, holder.setdefault(blob, i))
              for i, group in enumerate(groups) for blob in group.get("tensors", {})]
    return components(range(len(groups)), joined)


def defer(groups: list[dict[str, Any]], budget: int, measure: str) -> list[dict[str, Any]]:
    """The groups to leave on disk so that the rest, counted by ``measure``, fits ``budget``.

    Groups that share a tensor storage go together (a view must stay a view of its base); the
    largest go first, so the fewest variables wait.
    """
    units = _sharing(groups)

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
    values: Mapping[str, Any], prints: Mapping[str, Fingerprint | None],
    blobs: BlobWriter, ns: dict[str, Any],
) -> list[list[str]]:
    """Names whose values share objects (aliases, a model and its optimizer, an instance and its
    cell class), grouped: each group is pickled as one unit so they stay shared after a restore.

    A fingerprint says what each value reaches; a value without one is pickled alone, without
    writing anything, to learn it. A value that cannot be pickled alone is its own group (its
    failure is reported when it is saved).
    """
    owner: dict[int, str] = {}
    joined: list[tuple[str, str]] = []
    dry = BlobWriter(blobs.folder, blobs.cache, dry=True)
    # Everything each dry pickling met stays alive until the grouping is done: a temporary
    # freed after one variable's pickling could lend its id to an object of the next one.
    alive: list[Any] = []
    for name, value in values.items():
        found = prints[name]
        if found is not None:
            shared: Iterable[int] = found[1]
        else:
            pickler = NamespacePickler(NullSink(), dry, ns)
            wrapper = {name: value}
            try:
                pickler.dump(wrapper)
            except Exception:
                continue
            alive.append(pickler.memo.copy())
            shared = pickler.shared_ids() - {id(wrapper)}
        joined += [(name, owner.setdefault(key, name)) for key in shared]
    return [sorted(names) for names in components(values, joined)]


def pack_groups(
    groups: list[_Group], blobs: BlobWriter, known: Mapping[tuple[int, ...], str]
) -> _Packs:
    """Put the groups' pickles into content-addressed packs and set each record's place.

    Small pickles share packs, so a namespace of many small variables is a few files; which
    pack a group joins depends on the names alone (a pack ends after a group whose first name
    hashes to 0 modulo PACK_SPREAD, or once it holds PACK_BYTES), so a change rewrites one
    pack of about PACK_SPREAD groups and a new variable moves no others. ``known`` maps packs
    by the pickles they hold, to skip hashing a pack that did not change.
    """
    small = sorted((g for g in groups if g.data is not None and len(g.data) < PACK_BYTES),
                   key=lambda g: g.record["names"][0])
    runs: list[list[_Group]] = [[]]
    size = 0
    for group in small:
        runs[-1].append(group)
        size += len(group.data or b"")
        if size >= PACK_BYTES or zlib.crc32(group.record["names"][0].encode()) % PACK_SPREAD == 0:
            runs.append([])
            size = 0
    packs = _Packs({}, {})
    for run in filter(None, runs):
        pickles = [g.data or b"" for g in run]
        # The pickles are held by the groups as long as this key is kept: ids stay theirs.
        key = tuple(id(data) for data in pickles)
        name = known.get(key)
        if name is None or blobs.found(name) is None:
            name = blobs.pack_blob(b"".join(pickles))
        packs.composition[key] = name
        _place(run, name, packs)
    for group in groups:
        if group.data is not None and len(group.data) >= PACK_BYTES:
            # A pack of its own, reused whole while the group is; its pickle is not kept.
            _place([group], blobs.pack_blob(group.data), packs)
            group.data = None
        elif group.data is None:
            packs.sizes[group.record["blob"]] = int(group.record["pickle"])
    return packs


def _place(run: list[_Group], name: str, packs: _Packs) -> None:
    offset = 0
    for group in run:
        group.record.update(blob=name, offset=offset)
        offset += len(group.data or b"")
    packs.sizes[name] = offset


def referenced_blobs(records: list[dict[str, Any]], packs: _Packs) -> dict[str, int]:
    """Every blob the records name, with its size."""
    found: dict[str, int] = {}
    for record in records:
        blob = str(record["blob"])
        found[blob] = packs.sizes.get(blob, int(record.get("offset", 0)) + int(record["pickle"]))
        found.update(record.get("tensors", {}))
        found.update((str(b), int(n)) for b, n in record.get("buffers", []))
    return found


def _group_pickle(group: Mapping[str, Any], ahead: _ReadAhead) -> memoryview:
    """The pickle of one group, cut out of its pack."""
    pack = ahead.pack(str(group["blob"]))
    offset, length = int(group.get("offset", 0)), int(group["pickle"])
    if offset < 0 or length < 0 or offset + length > len(pack):
        raise ValueError(f"pack {group['blob']} is shorter than the checkpoint says")
    return memoryview(pack)[offset:offset + length]


class _ReadAhead:
    """Reads the storages and buffers a restore needs ahead of the unpickling, several at once
    (the disk sees a queue, and reading overlaps unpickling), at most READ_AHEAD bytes ahead.

    A storage is read once (groups that view one storage share it); a buffer once per use
    (two arrays must not share memory because their bytes are equal).
    """

    def __init__(self, folder: store.CheckpointDir, groups: list[dict[str, Any]]) -> None:
        self._folder = folder
        self._plan: list[tuple[str, str, int]] = []
        planned: set[str] = set()
        for group in groups:
            once = [("pack", str(group.get("blob")), int(group.get("pickle", 0)))] + [
                ("storage", str(b), int(n)) for b, n in group.get("tensors", {}).items()]
            for kind, blob, nbytes in once:
                if blob not in planned:
                    planned.add(blob)
                    self._plan.append((kind, blob, nbytes))
            self._plan += [("buffer", str(b), int(n)) for b, n in group.get("buffers", [])]
        if any(kind == "storage" for kind, _, _ in self._plan):
            # Here, not in a reading thread: torch's first import is not safe to run in two
            # threads at once (the unpickler may import it meanwhile).
            import torch  # noqa: F401
        self._pool = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="gpufrac-restore")
        self._pending: dict[tuple[str, str], collections.deque[Future[Any]]] = {}
        self._next = 0
        self._ahead = 0
        self._packs: dict[str, bytes] = {}

    def __enter__(self) -> _ReadAhead:
        self._fill()
        return self

    def __exit__(self, *exc: object) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    def _fill(self) -> None:
        while self._next < len(self._plan) and (self._ahead < READ_AHEAD or not self._pending):
            kind, blob, nbytes = self._plan[self._next]
            self._next += 1
            future = self._pool.submit(self._read, kind, blob, nbytes)
            self._pending.setdefault((kind, blob), collections.deque()).append(future)
            self._ahead += nbytes

    def _read(self, kind: str, blob: str, nbytes: int) -> Any:
        if kind == "pack":
            return tensor_io.read_pack(self._folder, blob)
        if kind == "storage":
            return tensor_io.read_storage(self._folder, blob, nbytes, "cpu")
        return tensor_io.read_buffer(self._folder, blob, nbytes)

    def _take(self, kind: str, blob: str, nbytes: int) -> Any:
        queue = self._pending.get((kind, blob))
        if not queue:
            return self._read(kind, blob, nbytes)  # not planned (a damaged header): read now
        future = queue.popleft()
        if not queue:
            del self._pending[(kind, blob)]
        self._ahead -= nbytes
        self._fill()
        return future.result()

    def pack(self, blob: str) -> bytes:
        """Pack ``blob``'s bytes (read once: the groups in it share them)."""
        if blob not in self._packs:
            self._packs[blob] = self._take("pack", blob, 0)
        return self._packs[blob]

    def storage(self, blob: str, nbytes: int) -> Any:
        """Storage ``blob`` in host memory."""
        return self._take("storage", blob, nbytes)

    def buffer(self, blob: str, nbytes: int) -> Any:
        """A new writable buffer holding ``blob``."""
        return self._take("buffer", blob, nbytes)


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


def _trailer(header: dict[str, Any]) -> bytes:
    data = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    return data + _TRAILER.pack(len(data)) + MAGIC


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
