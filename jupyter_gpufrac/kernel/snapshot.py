"""Taking a snapshot at a cell's end: what changed is found, grouped, pickled and staged for the writer."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import io
import json
import os
import pickle
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from jupyter_gpufrac.kernel import budget, namespace, rng, store, stream, tensor_io
from jupyter_gpufrac.kernel.blobs import BlobWriteError, BlobWriter, IncrementalCache, PandasGuard
from jupyter_gpufrac.kernel.buffers import BufferTracker
from jupyter_gpufrac.kernel.fingerprints import Fingerprint, Fingerprints, FingerprintSession
from jupyter_gpufrac.kernel.groups import (
    Group,
    Packs,
    group_names,
    group_size,
    pack_groups,
    referenced_blobs,
    sharing,
)
from jupyter_gpufrac.kernel.imported import imports_now
from jupyter_gpufrac.kernel.pickler import NamespacePickler, unpicklable_reason
from jupyter_gpufrac.kernel.state_file import (
    FORMAT,
    MAGIC,
    CheckpointError,
    disk_generation,
    durable_blobs,
    header_generation,
    trailer,
)
from jupyter_gpufrac.kernel.writer import Job, Writer
from node_agent.quantities import format_bytes

MAX_ATTEMPTS = 3


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
class _Saved:
    """What this process last committed, to write only what changed since."""

    fingerprints: Fingerprints
    groups: dict[tuple[str, ...], Group]
    packs: Packs
    rest: str  # the header less groups and when, as JSON
    blobs: dict[str, int]  # every blob the state names
    header: dict[str, Any]
    state: tuple[int, int, int, int] | None  # unused: the writer knows the file it wrote
    digest: str  # of the state file's bytes, which the SEEN_FILE names


class Snapshots:
    """Takes the snapshots of one namespace into one directory, each writing only what changed.

    The notebook's thread takes the snapshot (:meth:`begin`): what changed is found and pickled,
    and the bytes of changed tensors and buffers are copied as they are at the cell's end into
    staging memory kept warm from one snapshot to the next (a GPU storage into pinned memory,
    on its stream). That is a :class:`Job`: the state file to commit, and the staged blobs it
    needs, which the :class:`Writer` writes while the notebook goes on.

    At most one snapshot's copies are held at a time: a snapshot asked for while the writer is
    still busy with the one before is *owed* (:attr:`owed`) rather than taken, and its caller
    takes it once the writer is done (:meth:`Writer.when_idle`) or at the next cell's end. So
    cells that follow each other faster than the disk writes what they change pay for one copy
    per write, not one per cell, and hold one copy, not two; the recovery point moves on with
    every write. (A forked child writing from a copy-on-write view cost no copy at the cell's
    end, but made the cells that followed fault on every page they wrote: a training step that
    updated 1 GiB in place ran 9x slower while the child wrote.)
    """

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.cache = IncrementalCache()
        self._guard = PandasGuard()
        self._buffers = BufferTracker()
        self._lock = threading.Lock()
        # The last durable checkpoint this process wrote, and the last snapshot it took.
        self.last: CheckpointResult | None = None
        self.taken: CheckpointResult | None = None
        self.writer = Writer(self.root, self._committed)
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
        self._staging_budget: int | None = None
        # The cell whose snapshot waits for the writer (see owe_if_busy), None when none does;
        # since when (monotonic), and what takes it.
        self.owed: int | None = None
        self.owed_since: float | None = None
        self._owed: Callable[[], object] | None = None

    @property
    def staging_budget(self) -> int | None:
        """The memory a snapshot may copy at a cell's end (None: unbounded)."""
        return self._staging_budget

    @staging_budget.setter
    def staging_budget(self, nbytes: int | None) -> None:
        # The staging pools keep what one snapshot copied for the next: as much as it may copy.
        self._staging_budget = nbytes
        if nbytes is not None:
            tensor_io.STAGING.limit = stream.PINNED.limit = nbytes

    @property
    def state_path(self) -> Path:
        """The committed checkpoint file."""
        return self.root / store.STATE_FILE

    def begin(
        self,
        ns: dict[str, Any],
        *,
        hidden: Mapping[str, object] | None = None,
        full: bool = False,
        execution_count: int | None = None,
        extra: Mapping[str, Any] | None = None,
    ) -> Job:
        """Take a snapshot of ``ns`` as it is now and queue it to be written in the background:
        in this thread only what changed is found, pickled, and its tensors' and buffers' bytes
        copied (see :class:`Snapshots`); :meth:`Job.wait` waits for it to be durable."""
        with self._lock:
            job = self._begin(ns, hidden, full, execution_count, extra)
        self.writer.submit(job)
        return job

    def owe_if_busy(self, execution_count: int | None, take: Callable[[], object]) -> bool:
        """While the writer is still busy with an earlier snapshot, owe this one instead of
        taking it (True): ``take`` takes it later (:meth:`take_owed`), once the writer is idle
        (:meth:`Writer.when_idle`) or at the next cell's end."""
        with self._lock:
            if not self.writer.busy():
                return False
            if self._owed is None:
                self.owed_since = time.monotonic()
            self.owed, self._owed = execution_count, take
            return True

    def take_owed(self) -> None:
        """Take the owed snapshot, if one is (in the notebook's thread, between cells)."""
        with self._lock:
            take, self._owed = self._owed, None
        if take is not None:
            take()

    def _begin(self, ns: dict[str, Any], hidden: Mapping[str, object] | None, full: bool,
               execution_count: int | None, extra: Mapping[str, Any] | None) -> Job:
        with collector_paused():
            job = self._take(ns, hidden, full, execution_count, extra or {})
        # What was owed is in this snapshot: it is taken as the namespace is now.
        self.owed = self.owed_since = self._owed = None
        return job

    def _committed(self, job: Job, stale: list[str]) -> None:
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
    ) -> Job:
        started = time.monotonic()
        try:
            folder = store.CheckpointDir.open(self.root, create=True)
        except (OSError, store.UnsafeCheckpointError) as exc:
            raise CheckpointError(f"cannot use checkpoint directory {self.root}: {exc}") from exc
        with self._stale_lock:
            stale, self._stale = self._stale, set()
            identity = self._identity
        if stale:
            # Deleted by the writer: the caches forget them, so no later snapshot names them
            # (a followed buffer whose blob went is staged anew: see BlobWriter.buffer_blob).
            self.cache.forget_blobs(stale)
            self._guard.forget_blobs(stale)
        with folder:
            if self.writer.reset:
                self.writer.reset = False
                self._saved = None
            if full:
                self.cache.clear()
                self._guard.clear()
                self._buffers.clear()
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
                self._buffers.abandon()
                raise CheckpointError(f"writing the checkpoint to {self.root} failed: {exc}") from exc
            except BaseException:
                self._guard.abandon()
                self._buffers.abandon()
                raise
            self._guard.commit()
            self._buffers.commit()
            self._cleaned = True
        job.result.seconds = time.monotonic() - started
        self.taken = job.result
        return job

    def _write(
        self, folder: store.CheckpointDir, ns: dict[str, Any], hidden: Mapping[str, object] | None,
        execution_count: int | None, extra: Mapping[str, Any],
    ) -> Job:
        """:meth:`_save` into a staging folder: blobs are staged (copied), written later by the
        writer."""
        saved = self._saved
        selection = namespace.select(ns, hidden)
        lost: dict[str, str] = {name: "a module object that is not importable"
                                for name in selection.skipped}
        staging = store.StagingDir(folder.path)
        if saved is None:
            # What is on disk may be newer than anything this process knows of.
            self.generation = max(self.generation, disk_generation(folder))
        # Where writes are watched, pandas' frames need no guard (it copies a block on every
        # write through pandas, in the cell): their arrays are followed as any array is.
        guard = None if self._buffers.watching else self._guard
        blobs = BlobWriter(staging, self.cache, guard=guard, tracker=self._buffers,
                                    trusted=saved.blobs.keys() if saved else durable_blobs(folder))
        try:
            return self._save(staging, ns, selection, lost, blobs, execution_count, extra)
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
    ) -> Job:
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
        over, hold = self._over_staging(selection.values, prints, lost)
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
            # What a spare kernel imports before it restores this (see server/spares.py).
            "imports": imports_now(),
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
            return Job(execution_count, now, None, saved.digest,
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
        data = MAGIC + trailer(header)
        digest = tensor_io.digest(data)
        self._saved = _Saved(taken, groups, packs, rest_key, referenced, header, None, digest)
        blobs.stage_pending(referenced, hold)
        staged = {name: item for name, item in staging.staged.items() if name in referenced}
        for name, item in staging.staged.items():
            if name not in referenced and item.release is not None:
                item.release()
        result = self._result(header, now, execution_count, blobs, pickled)
        return Job(execution_count, now, data, digest, frozenset(referenced), staged,
                            result, state_cell=execution_count)

    def _over_staging(self, values: dict[str, Any],
                      prints: dict[str, Fingerprint | None], lost: dict[str, str]
                      ) -> tuple[dict[str, int], Callable[[Any], Callable[[], bool] | None]]:
        """The changed variables whose bytes this snapshot would copy into memory beyond the
        staging budget (smallest kept first, as on disk). A host tensor or a watched array among
        them is held instead of copied (:meth:`_holder`); the others are taken out of
        ``values`` and ``prints`` before anything is copied, and ``lost``, so a restore says
        they were not protected: (those left out with their bytes, the holder)."""
        if self.staging_budget is None:
            return {}, _hold_nothing
        before = self._saved.fingerprints.by_name if self._saved is not None else {}
        changed = [name for name, found in prints.items()
                   if found is None or before.get(name) != found]
        sizes = [budget.staged_bytes(values[name]) for name in changed]
        kept = set(budget.protect(sizes, self.staging_budget))
        over = {changed[i]: sizes[i] for i in range(len(changed)) if i not in kept}
        checks = {}
        for name in list(over):
            check = self._holdable(values[name])
            if check is not None:
                checks[check[0]] = check[1]
                del over[name]
        room = budget.staging_room(self.staging_budget)
        for name, size in over.items():
            del values[name], prints[name]
            lost[name] = _unprotected_reason(size, room)
        return over, lambda owner: checks.get(_held_key(owner))

    def _holdable(self, value: Any) -> tuple[int, Callable[[], bool]] | None:
        """(the key of its bytes, the check that they are as they were) for a variable whose
        bytes a snapshot may hold rather than copy: a host tensor with a version counter (its
        bytes are as they were while its version and place are), or an array the kernel
        watches (while no page of it is marked written)."""
        torch = sys.modules.get("torch")
        if torch is not None and isinstance(value, torch.Tensor):
            if value.device.type != "cpu" or value.is_inference():
                return None
            storage = value.untyped_storage()
            ptr, version, tensor = storage.data_ptr(), value._version, weakref.ref(value)

            def same() -> bool:
                held = tensor()
                return held is None or (held._version == version
                                        and held.untyped_storage().data_ptr() == ptr)

            return _held_key(storage), same
        check = self._buffers.unchanged_check(value)
        return None if check is None else (_held_key(value), check)

    def _within_budget(
        self, groups: dict[tuple[str, ...], Group], carried: list[dict[str, Any]],
        lost: dict[str, str], room: budget.Room | None,
    ) -> tuple[dict[tuple[str, ...], Group], dict[str, int], str | None]:
        """The groups :func:`budget.protect` keeps under the disk budget (groups that share a
        storage kept or left out together), and the names left out with their bytes; those
        are also ``lost``, so a restore says they were not protected."""
        if room is None:
            return groups, {}, None
        records = [g.record for g in groups.values()]
        units = sharing(records)
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
    ) -> tuple[dict[tuple[str, ...], Group], int]:
        """The groups of the namespace, each reused when its members' fingerprints did not change
        since the last checkpoint, else pickled; (groups by names, how many were pickled)."""
        saved = self._saved
        groups: dict[tuple[str, ...], Group] = {}
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
    ) -> Group | None:
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
            return Group(record, data)
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


def _held_key(owner: Any) -> int:
    """What names a storage or an array when the snapshot decides to hold it: a storage by its
    data's address (storage objects come and go), an array by its identity."""
    data_ptr = getattr(owner, "data_ptr", None)
    return int(data_ptr()) if callable(data_ptr) and not hasattr(owner, "__array_interface__") \
        else id(owner)


def _hold_nothing(_owner: Any) -> Callable[[], bool] | None:
    return None


def _unprotected_reason(size: int, room: budget.Room) -> str:
    """What a restore says of a variable the budget left out."""
    return f"not protected: it takes {format_bytes(size)}, {room.why}"


def _matplotlib_backend() -> str | None:
    """The plotting backend the notebook chose (``matplotlib.use``, ``%matplotlib``), if loaded."""
    matplotlib = sys.modules.get("matplotlib")
    try:
        return None if matplotlib is None else str(matplotlib.get_backend())
    except Exception:  # a broken backend must not cost the checkpoint
        return None
