"""The blobs of one checkpoint: each storage and large buffer written once, unchanged ones reused."""

from __future__ import annotations

import contextlib
import sys
import threading
import weakref
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from jupyter_gpufrac.kernel import store, tensor_io
from jupyter_gpufrac.kernel.buffers import TRACKED_MIN, BufferTracker


class BlobWriteError(OSError):
    """Writing a blob failed (disk full, over quota, an I/O error).

    Not a fault of the variable being pickled: the checkpoint fails as a whole, so the last
    good one stays, rather than committing one without the variables whose bytes did not fit.
    """


@contextlib.contextmanager
def _writing_blobs() -> Iterator[None]:
    """Turns a failed write into :class:`BlobWriteError`."""
    try:
        yield
    except BlobWriteError:
        raise
    except OSError as exc:
        raise BlobWriteError(exc.errno, exc.strerror or str(exc)) from exc


@dataclass
class _Seen:
    """One tensor on a storage, as it was when its storage was last written or reused."""

    ref: weakref.ref[Any]
    version: int


@dataclass
class _StorageEntry:
    """The blob holding one storage, and every tensor on it that the last checkpoint met.

    Storages of tensors without a version counter are recognised by ``digest`` instead.
    """

    blob: str
    nbytes: int
    tensors: dict[int, _Seen] = field(default_factory=dict)
    digest: str | None = None


class _Token(NamedTuple):
    """The text of a tensor's fingerprint token, and what it was made from (see
    :meth:`IncrementalCache.token`)."""

    entry: _StorageEntry
    ref: weakref.ref[Any]
    layout: tuple[Any, ...]
    text: str


class IncrementalCache:
    """Remembers which blob holds each storage, to skip storages that did not change.

    A storage counts as unchanged when every tensor on it that the last checkpoint met is
    still alive with the same ``_version`` (bumped by every in-place operation). All of them
    count: tensors restored separately onto one storage (a tensor and its view) have version
    counters of their own, so a change through one is seen only on that one. A tensor that
    died meanwhile could have written to the storage: its storage is written again.
    Tensors made under ``torch.inference_mode()`` have no version counter: their storage is
    hashed instead. Writes that bypass the version counter (``t.data.add_()``, writing through
    ``t.numpy()``) are not seen: take a full checkpoint (``%gpu checkpoint --full``) after those.
    """

    def __init__(self) -> None:
        self._storages: dict[tuple[int, int], _StorageEntry] = {}
        # Tensors whose token text is kept, by id: found without computing their storage's
        # key, as a checkpoint with nothing changed asks for every tensor of the notebook.
        self._tokens: dict[int, _Token] = {}

    def __len__(self) -> int:
        return sum(len(e.tensors) for e in self._storages.values())

    @staticmethod
    def _key(tensor: Any, storage: Any) -> tuple[int, int]:
        return (int(tensor.get_device()), int(storage.data_ptr()))

    def lookup(self, tensor: Any, storage: Any = None) -> str | None:
        """The blob holding ``tensor``'s storage (``storage``, when the caller has it) if
        nothing on it changed, or None."""
        storage = tensor.untyped_storage() if storage is None else storage
        entry = self._storages.get(self._key(tensor, storage))
        if entry is None or entry.nbytes != storage.nbytes():
            return None
        if id(tensor) not in entry.tensors:
            return None  # a tensor new on this storage: it may have written to it
        if entry.digest is not None:
            return entry.blob if entry.digest == tensor_io.storage_digest(storage) else None
        for key, seen in entry.tensors.items():
            alive = seen.ref()
            if alive is None or id(alive) != key or int(alive._version) != seen.version:
                return None
        return entry.blob

    def token(self, tensor: Any, storage: Any) -> tuple[str, str] | None:
        """(blob, token text) that the last fingerprint of ``tensor`` recorded, if it still
        holds: the tensor is the only one the storage's entry knows, and neither its version
        nor its place and shape changed (a fingerprint then skips making the text anew, which
        costs most of a tensor's part of it). ``tensor.data = other`` keeps the version; it
        shows as another data pointer, shape, stride or dtype."""
        known = self._tokens.get(id(tensor))
        if known is None:
            return None
        entry, ref, layout, text = known
        if ref() is not tensor or len(entry.tensors) != 1 or layout != _layout(tensor, storage):
            return None
        return entry.blob, text

    def remember_token(self, tensor: Any, storage: Any, token: str) -> None:
        """Record ``token``, the text of ``tensor``'s fingerprint token, made just now."""
        entry = self._storages.get(self._key(tensor, storage))
        if entry is None or entry.digest is not None:
            return  # a hashed storage's token is made each time
        seen = entry.tensors.get(id(tensor))
        if seen is not None and seen.ref() is tensor:
            self._tokens[id(tensor)] = _Token(entry, seen.ref, _layout(tensor, storage), token)

    def remember(self, tensor: Any, blob: str, storage: Any = None) -> None:
        """Record that ``blob`` holds ``tensor``'s storage as it is now."""
        storage = tensor.untyped_storage() if storage is None else storage
        storage_key = self._key(tensor, storage)
        nbytes = int(storage.nbytes())
        entry = self._storages.get(storage_key)
        if entry is None or entry.blob != blob or entry.nbytes != nbytes:
            # The storage was just written: tensors still on it are as the new blob has them.
            kept = {} if entry is None else {
                k: _Seen(seen.ref, _version(alive)) for k, seen in entry.tensors.items()
                if (alive := seen.ref()) is not None and id(alive) == k
            }
            digest = tensor_io.storage_digest(storage) if _no_version(tensor) else None
            self._retire(storage_key)
            entry = self._storages[storage_key] = _StorageEntry(blob, nbytes, kept, digest)
        key = id(tensor)
        seen = entry.tensors.get(key)
        if seen is not None and seen.ref() is tensor:
            seen.version = _version(tensor)  # known already: its new version is all there is
            return

        # A tensor that dies may have changed its storage last: the storage is then written
        # again (and ids of dead tensors are never confused with new ones).
        def forget(dead: weakref.ref[Any], storage_key: tuple[int, int] = storage_key) -> None:
            self._drop(storage_key, dead)

        entry.tensors[key] = _Seen(weakref.ref(tensor, forget), _version(tensor))

    def _drop(self, storage_key: tuple[int, int], ref: weakref.ref[Any]) -> None:
        entry = self._storages.get(storage_key)
        if entry is not None and any(seen.ref is ref for seen in entry.tensors.values()):
            self._retire(storage_key)

    def _retire(self, storage_key: tuple[int, int]) -> None:
        """Forget a storage's entry, and the token texts of its tensors with it."""
        entry = self._storages.pop(storage_key, None)
        if entry is None:
            return
        for key in entry.tensors:
            known = self._tokens.get(key)
            if known is not None and known.entry is entry:
                del self._tokens[key]

    def forget_blobs(self, blobs: set[str]) -> None:
        """Drop entries pointing at blobs about to be deleted."""
        for key in [k for k, e in self._storages.items() if e.blob in blobs]:
            self._retire(key)

    def clear(self) -> None:
        """Forget everything: the next checkpoint writes every tensor."""
        self._storages.clear()
        self._tokens.clear()


def _layout(tensor: Any, storage: Any) -> tuple[Any, ...]:
    """What a tensor's token text is made of besides its storage's blob, with its version."""
    return (tensor._version, type(tensor), tensor.data_ptr(), tensor.shape, tensor.stride(),
            tensor.dtype, tensor.requires_grad, storage.nbytes())


def _no_version(tensor: Any) -> bool:
    # Tensors created under torch.inference_mode() raise on ``_version``.
    is_inference = getattr(tensor, "is_inference", None)
    return bool(is_inference is not None and is_inference())


def _version(tensor: Any) -> int:
    return -1 if _no_version(tensor) else int(tensor._version)


class PandasGuard:
    """Makes a pandas array's identity say whether it changed.

    With copy-on-write (always on from pandas 3), a DataFrame or Series whose data another
    object references copies a block before writing to it. Holding a shallow copy of every
    frame the last checkpoint met therefore turns each later write through pandas (``loc``,
    ``iloc``, ``at``, ``df[c] = ...``, in-place methods) into a new array object, while an array
    that is still the same object was not written. The arrays themselves are held too, so their
    ids are not reused. Writes around pandas (into ``Series.array`` or into NumPy arrays the
    frame was built on with ``copy=False``) are not seen: ``%gpu checkpoint --full`` after those.
    The cost: a written block is copied once per checkpoint, and a frame dropped by the notebook
    stays in memory until the next checkpoint.
    """

    def __init__(self) -> None:
        self._snapshots: list[Any] = []
        self._protected: dict[int, Any] = {}
        self._next_snapshots: list[Any] = []
        self._next_protected: dict[int, Any] = {}
        self._blobs: dict[int, str] = {}  # content blob of a protected array, once written

    @staticmethod
    def active() -> bool:
        """Whether the loaded pandas copies on write."""
        pandas = sys.modules.get("pandas")
        if pandas is None:
            return False
        if int(str(pandas.__version__).split(".")[0]) >= 3:
            return True
        return getattr(getattr(pandas.options, "mode", None), "copy_on_write", False) is True

    def protect(self, frame: Any) -> None:
        """Hold ``frame``'s arrays for the checkpoint being fingerprinted."""
        try:
            arrays = list(frame._mgr.arrays)
            snapshot = frame.copy(deep=False)
        except Exception:  # another internal layout: its arrays are hashed instead
            return
        self._next_snapshots.append(snapshot)
        for array in arrays:
            self._next_protected[id(array)] = array

    def protects(self, array: Any) -> bool:
        """Whether ``array`` belongs to a frame protected in this checkpoint."""
        return self._next_protected.get(id(array)) is array

    def blob(self, array: Any) -> str | None:
        """The content blob a protected ``array`` was written to."""
        return self._blobs.get(id(array)) if self.protects(array) else None

    def remember(self, array: Any, blob: str) -> None:
        if self.protects(array):
            self._blobs[id(array)] = blob

    def commit(self) -> None:
        """This checkpoint's frames are the ones held from now on."""
        self._snapshots, self._next_snapshots = self._next_snapshots, []
        self._protected, self._next_protected = self._next_protected, {}
        self._blobs = {k: v for k, v in self._blobs.items() if k in self._protected}

    def abandon(self) -> None:
        """A checkpoint that failed: the frames held before stay held."""
        self._next_snapshots, self._next_protected = [], {}

    def forget_blobs(self, blobs: set[str]) -> None:
        self._blobs = {k: v for k, v in self._blobs.items() if v not in blobs}

    def clear(self) -> None:
        """Hold nothing: the next checkpoint hashes every array again."""
        self._snapshots, self._protected, self._blobs = [], {}, {}
        self.abandon()


@dataclass
class BlobWriter:
    """Writes each storage once per checkpoint, reuses blobs of unchanged tensors and buffers,
    and counts what one checkpoint writes."""

    folder: store.CheckpointDir
    cache: IncrementalCache
    dry: bool = False
    guard: PandasGuard | None = None
    # Blobs the committed state names: durable, and there unless someone else removed them,
    # which a check of the state file itself would have told (see Checkpointer).
    trusted: Collection[str] = ()
    bytes_written: int = 0  # storages and buffers
    blobs_written: int = 0
    group_bytes_written: int = 0
    new_blobs: list[str] = field(default_factory=list)  # written, synced before the commit
    # What the group being pickled reaches: storage blob -> (nbytes, device type), and its
    # out-of-band buffers in pickling order, [blob, nbytes].
    reached: dict[str, tuple[int, str]] = field(default_factory=dict)
    buffers: list[list[Any]] = field(default_factory=list)
    # Large buffers followed from one snapshot to the next (None: every buffer is hashed).
    tracker: BufferTracker | None = None
    # The blob of each array fingerprinted in this checkpoint, by id (the arrays are held):
    # its content's name, or where the tracker keeps it (and whether it changed).
    digests: dict[int, tuple[Any, str]] = field(default_factory=dict)
    followed: dict[int, tuple[Any, str, bool]] = field(default_factory=dict)
    # New blobs of storages and followed buffers, named but not yet staged: their bytes are
    # copied (or held) by :meth:`stage_pending` once the snapshot knows what it keeps, so a
    # variable a budget leaves out costs no copy. Blob -> the storage, or the buffer's view.
    pending: dict[str, Any] = field(default_factory=dict)
    # The tensors met on each pending storage and their versions then (None: one has no version
    # counter): what tells a storage held on its device changed after the snapshot.
    pending_tensors: dict[str, list[_Seen] | None] = field(default_factory=dict)
    _written: set[str] = field(default_factory=set)
    _by_storage: dict[int, tuple[str, int]] = field(default_factory=dict)
    _keepalive: list[Any] = field(default_factory=list)
    _count_lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self.sync = store.BlobSync(self.folder)  # each new blob starts syncing once written

    def close(self) -> None:
        """Stop the syncing threads and let go of what this checkpoint held alive: a fingerprint
        session that refers to this writer may outlive it in a reference cycle, and a storage or
        an array the notebook then deletes must give its memory back at once."""
        self.sync.close()
        self._keepalive.clear()
        self._by_storage.clear()
        self.digests.clear()
        self.followed.clear()
        self.pending.clear()
        self.pending_tensors.clear()

    def _note_new(self, blob: str, write: Callable[[], None] | None = None) -> None:
        self.new_blobs.append(blob)
        self._written.add(blob)
        self.sync.add(blob, write)

    def _later(self, count: Callable[[int], None]) -> Callable[[str, Callable[[], int]], None]:
        """A blob written in a syncing thread (a storage, or what :func:`tensor_io.store_bytes`
        compresses), its bytes counted by ``count`` once written (read after the commit has
        waited for them)."""

        def later(blob: str, write: Callable[[], int]) -> None:
            def job() -> None:
                with _writing_blobs():
                    written = write()
                count(written)

            self._note_new(blob, job)

        return later

    def start_group(self) -> None:
        """Forget what the previous group reached."""
        self.reached, self.buffers = {}, []

    def storage_record(self, storage: Any) -> tuple[str, int, str]:
        """(blob, nbytes, device type) of a bare storage: written once per checkpoint."""
        device = storage.device.type
        if self.dry:
            return ("dry.bin", int(storage.nbytes()), device)
        key = int(storage._cdata)
        known = self._by_storage.get(key)
        if known is None:
            known = self._by_storage[key] = self._write(storage)
            self._keepalive.append(storage)
        self.reached[known[0]] = (known[1], device)
        return (known[0], known[1], device)

    def _write(self, storage: Any) -> tuple[str, int]:
        """A new blob for ``storage``'s bytes, staged at the snapshot's end (:meth:`stage_pending`)."""
        blob = store.new_blob_name()
        self.pending[blob] = storage
        self._note_new(blob)
        return blob, int(storage.nbytes())

    def stage_pending(self, referenced: Collection[str],
                      hold: Callable[[Any], Callable[[], bool] | None]) -> None:
        """Stage the new blobs the snapshot's state names (the rest were left out: never
        copied): copied as they are now, or, where ``hold`` gives a check for them, held where
        they are and written from the notebook's own memory (see :class:`store.Staged`)."""
        assert isinstance(self.folder, store.StagingDir)
        for name, source in self.pending.items():
            if name not in referenced:
                continue
            owner = source.obj if isinstance(source, memoryview) else source
            valid = hold(owner)
            if isinstance(source, memoryview):
                staged = (tensor_io.held(source, owner, valid) if valid is not None
                          else tensor_io.copy_host(source))
                staged.shared, staged.compress = True, name.startswith(tensor_io.COMPRESSED)
                entry = None if self.tracker is None else self.tracker.followed(owner)
                if entry is not None:
                    staged.hashed = entry.hashed
            elif valid is not None:
                staged = tensor_io.held(tensor_io.host_view(source), source, valid)
            else:
                staged = tensor_io.snapshot_storage(source, self._unchanged(name))
            self.folder.stage(name, staged)
            if not staged.compress:
                self._count_blob(staged.nbytes)  # a compressed one counts once written
        self.pending.clear()
        self.pending_tensors.clear()

    def _count_new(self, blob: str, nbytes: int) -> None:
        self._note_new(blob)
        self._count_blob(nbytes)

    # Counted from the syncing threads too (see _later): under a lock.
    def _count_blob(self, nbytes: int) -> None:
        with self._count_lock:
            self.bytes_written += nbytes
            self.blobs_written += 1

    def _count_pack(self, nbytes: int) -> None:
        with self._count_lock:
            self.group_bytes_written += nbytes

    def found(self, name: str) -> str | None:
        """The blob holding ``name`` (a content-addressed one, compressed or not) if it may be
        reused: one the committed state names or this checkpoint wrote. Another one on disk
        was left by a writer that failed or was killed before it synced it, and is written
        again."""
        for candidate in (name, tensor_io.COMPRESSED + name):
            if candidate in self.trusted or candidate in self._written:
                return candidate
        return None

    def storage_blob(self, tensor: Any) -> tuple[str, int]:
        """(blob, nbytes) of ``tensor``'s storage as it is now, written if it changed."""
        storage = tensor.untyped_storage()
        if self.dry:
            return ("dry.bin", int(storage.nbytes()))
        key = int(storage._cdata)
        known = self._by_storage.get(key)
        if known is None:
            blob = self.cache.lookup(tensor, storage)
            if blob is not None and self.found(blob) is not None:
                known = (blob, int(storage.nbytes()))
            else:
                known = self._write(storage)
            self._by_storage[key] = known
            # Keep the storage alive so its _cdata cannot be reused within this checkpoint.
            self._keepalive.append(storage)
            if blob is not None and known[0] == blob:
                return known  # found as remembered: this tensor's version is the one recorded
        if known[0] in self.pending:
            self._met(known[0], tensor)
        self.cache.remember(tensor, known[0], storage)
        return known

    def _met(self, blob: str, tensor: Any) -> None:
        """``tensor`` views the pending storage of ``blob``: remember its version now."""
        seen = self.pending_tensors.setdefault(blob, [])
        if seen is None:
            return
        if _no_version(tensor):
            self.pending_tensors[blob] = None
            return
        seen.append(_Seen(weakref.ref(tensor), int(tensor._version)))

    def _unchanged(self, blob: str) -> Callable[[], bool] | None:
        """A check that no tensor met on ``blob``'s storage was written since the snapshot (a
        view shares its base's version counter), or None when that cannot be told (a bare
        storage, an inference tensor). A tensor that died may have written first: changed."""
        seen = self.pending_tensors.get(blob)
        if not seen:
            return None
        known = list(seen)

        def unchanged() -> bool:
            for each in known:
                alive = each.ref()
                if alive is None or int(alive._version) != each.version:
                    return False
            return True

        return unchanged

    def record_for(self, tensor: Any) -> tuple[str, int, str]:
        """(blob, nbytes, device type) of ``tensor``'s storage, writing it if needed."""
        blob, nbytes = self.storage_blob(tensor)
        device = tensor.device.type
        self.reached[blob] = (nbytes, device)
        return (blob, nbytes, device)

    def buffer_blob(self, raw: memoryview) -> str:
        """The blob holding an out-of-band buffer: a followed one's (staged when it changed),
        else its content's, written only if new."""
        if self.dry:
            return "dry.bin"
        exporter = raw.obj
        followed = self._followed(exporter)
        if followed is not None:
            name = self.found(followed[1])
            if name is None:
                # Changed (a new name), or its blob went missing: staged at the snapshot's end
                # as it is now, compressed by the writer where that pays.
                name = (tensor_io.COMPRESSED if tensor_io.pays(raw) else "") + followed[1]
                self.pending[name] = raw
                self._note_new(name)
            self.buffers.append([name, raw.nbytes])
            return name
        blob = self.guard.blob(exporter) if self.guard is not None else None
        if blob is None and (known := self.digests.get(id(exporter))) and known[0] is exporter:
            blob = known[1]
        stored = None if blob is None else self.found(blob)
        if stored is None:
            with _writing_blobs():
                stored, written = tensor_io.store_bytes(self.folder, raw, have=self.found,
                                                        later=self._later(self._count_blob))
            if written:
                self._count_new(stored, written)
        blob = stored
        if self.guard is not None:
            self.guard.remember(exporter, blob)
        self.buffers.append([blob, raw.nbytes])
        return blob

    def _followed(self, exporter: Any) -> tuple[Any, str, bool] | None:
        """What the tracker decided for the array a buffer is of (NumPy pickles an array of
        Fortran order through its transpose, whose base is the array)."""
        for owner in (exporter, getattr(exporter, "base", None)):
            found = self.followed.get(id(owner))
            if found is not None and found[0] is owner:
                return found
        return None

    def array_blob(self, array: Any) -> str:
        """The blob ``array``'s bytes are in for this checkpoint (decided once per checkpoint):
        a large contiguous one's as the tracker follows it (:mod:`buffers`), else the content
        blob its bytes would have (hashed)."""
        followed = self.followed.get(id(array))
        if followed is not None and followed[0] is array:
            return followed[1]
        known = self.digests.get(id(array))
        if known is not None and known[0] is array:
            return known[1]
        view = _array_bytes(array)
        contiguous = array.flags.c_contiguous or array.flags.f_contiguous
        if self.tracker is not None and contiguous and view.nbytes >= TRACKED_MIN:
            address = int(array.__array_interface__["data"][0])
            blob, changed = self.tracker.decide(array, view, address)
            self.followed[id(array)] = (array, blob, changed)
            return blob
        name = tensor_io.content_name(tensor_io.digest(view))
        self.digests[id(array)] = (array, name)
        return name

    def pack_blob(self, data: bytes) -> str:
        """The content-addressed blob holding ``data`` (pickles of groups); written only if new."""
        with _writing_blobs():
            name, written = tensor_io.store_bytes(self.folder, data, tensor_io.PACK_PREFIX,
                                                  have=self.found,
                                                  later=self._later(self._count_pack))
        if written:
            self._note_new(name)
            self._count_pack(written)
        return name


def _array_bytes(array: Any) -> memoryview:
    """The bytes of a NumPy array in the order its pickle holds them, as a flat byte view."""
    numpy = sys.modules["numpy"]
    if array.flags.c_contiguous:
        flat = array
    elif array.flags.f_contiguous:
        flat = array.T
    else:
        flat = numpy.ascontiguousarray(array)
    return memoryview(flat.reshape(-1).view(numpy.uint8))
