"""Namespace pickling and change detection.

Pickling (:class:`NamespacePickler`): cloudpickle with protocol 5; tensor storages and large
out-of-band buffers (NumPy arrays, pandas columns) go to blobs of their own, cell functions keep
the live globals. Change detection (:class:`FingerprintSession`): a variable's fingerprint is a
pickle of it in which tensors stand as their storage blob (reused while their version counter
says unchanged), large arrays as a hash of their bytes, pandas arrays protected by copy-on-write
as their identity, the notebook's classes as a hash of their own fingerprint and empty
OrderedDicts as a mark beside their identity; a variable whose fingerprint did not change is not
pickled again. An object that an imported module holds under a name (``scipy.stats.norm``,
``logging.root``, ``sys.stdout``) is pickled and fingerprinted as that name (see
:class:`ModuleObjects`): a restore finds the module's own object again.
"""

from __future__ import annotations

import collections
import contextlib
import enum
import functools
import gc
import importlib
import io
import itertools
import pickle
import sys
import threading
import types
import warnings
import weakref
import zlib
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import cloudpickle

from jupyter_gpufrac.kernel import store, tensor_io, torch_adapter

# Buffers at least this large are written out of band, as content-addressed blobs.
BUFFER_MIN = 256 * 1024
# Arrays at least this large are fingerprinted by a hash of their bytes rather than the bytes.
_DIGEST_MIN = 4096
# Fingerprints longer than this are kept as a hash.
_FINGERPRINT_KEPT = 64 * 1024
_MEMO_REUSED = 512  # a fingerprint pickler whose memo grew past this is replaced
_BATCH_SPREAD = 64  # variables of built-in objects are fingerprinted about this many at once
_DIRTY = itertools.count()  # tokens that never compare equal: "always pickled again"


def _tensor_ref(*args: Any) -> Any:
    """Names a tensor in a pickle; :class:`NamespaceUnpickler` resolves it, nothing calls it."""
    raise pickle.UnpicklingError("a gpufrac tensor outside a gpufrac restore")


def _storage_ref(*args: Any) -> Any:
    """Names a bare storage in a pickle (see :func:`_tensor_ref`)."""
    raise pickle.UnpicklingError("a gpufrac storage outside a gpufrac restore")


def _user_ns_ref() -> Any:
    """Names the notebook's namespace in a pickle (see :func:`_tensor_ref`)."""
    raise pickle.UnpicklingError("a gpufrac namespace outside a gpufrac restore")


def _fp(*args: Any) -> Any:
    """The callable of fingerprint tokens: fingerprints are compared, never loaded."""
    raise pickle.UnpicklingError("a gpufrac fingerprint cannot be loaded")


def _module_object_ref(*args: Any) -> Any:
    """Names a module's object in a pickle (see :func:`_tensor_ref`)."""
    raise pickle.UnpicklingError("a gpufrac module object outside a gpufrac restore")


_REFS = frozenset({_tensor_ref.__name__, _storage_ref.__name__, _user_ns_ref.__name__,
                   _module_object_ref.__name__})
# Format 2 named tensors, bare storages and the namespace by persistent ids with these tags.
_V2_TENSOR = "gpufrac.tensor"
_V2_STORAGE = "gpufrac.storage"
_V2_USER_NS = ("gpufrac.user_ns",)
# A list, dict or set a module holds, as a persistent id (pickle asks no reducer_override for
# those): (tag, module, name, class module, class qualified name).
_MODULE_OBJECT = "gpufrac.module_object"


class ModuleObjectError(pickle.UnpicklingError):
    """A module's object named by a checkpoint is not there to be found again: its module does
    not import, no longer has the name, or holds an object of another class under it."""


_MISSING = object()
# Never by reference: what is immutable (a copy is as good), what pickle and cloudpickle already
# name (classes, functions, modules), and bound methods (their object is met, and named, itself).
_NOT_NAMED = frozenset({
    str, bytes, int, float, complex, bool, type(None), tuple, frozenset, range, slice,
    type(Ellipsis), type(NotImplemented), types.FunctionType, types.BuiltinFunctionType,
    types.MethodType, types.ModuleType, types.CodeType, property, staticmethod, classmethod,
    types.MethodWrapperType, types.WrapperDescriptorType, types.MethodDescriptorType,
    types.GetSetDescriptorType, types.MemberDescriptorType,
})
# Modules whose globals are the notebook's, or hold its objects: IPython binds the last result
# to ``builtins._``, the interpreter the last exception to ``sys.last_value``.
_SKIPPED_MODULES = frozenset({"__main__", "__mp_main__", "builtins"})
_SKIPPED_NAMES = frozenset({("sys", "last_value"), ("sys", "last_type"),
                            ("sys", "last_traceback"), ("sys", "last_exc")})


def _module_order(name: str) -> tuple[bool, int, int, str]:
    """Modules in the order their names are preferred: public before private, shallow before
    deep (``scipy.stats.norm`` rather than ``scipy.stats._continuous_distns.norm``)."""
    parts = name.split(".")
    return (any(part.startswith("_") for part in parts), len(parts), len(name), name)


class ModuleObjects:
    """Where imported modules hold each object, by id: ``id -> (module, name)``.

    A value that is, when pickled, the very object an imported module holds under a name (a
    module's singleton, ``scipy.stats.norm``, ``logging.root``, ``sys.stdout``, ``os.environ``,
    ``numpy.random.mtrand._rand`` behind ``numpy.random.seed``) is pickled as that name and a
    restore imports the module and takes its object again: a copy would be another object, with
    state of its own (``norm``'s generator would no longer be the one ``np.random.seed`` seeds).
    Only modules in ``sys.modules`` when the checkpoint was taken are named (importing them
    again at the restore has the effects their first import had), never ``__main__``, the
    builtins, nor a module cloudpickle is told to pickle by value; a hit is checked against the
    module's globals when met (``vars(module)[name] is obj``), so an index gone stale (an object
    rebound, an id reused) costs only the check.

    No copy is kept besides the name: a restore that cannot find the object again (the module
    fails to import, the name is gone, or holds an object of another class) reports the
    variable as not restored, with why. A copy would seldom help (its class is most often
    defined in the very module that failed to import), could not be taken of many such objects
    (``sys.stdout``), and taking it would cost every checkpoint a pickle of the object's state,
    which for ``logging.root`` is every logger of the process and for ``norm`` a generator that
    changes at every draw.

    The index is built from every module's globals (about 20 ms with torch, pandas and scipy
    loaded) and rebuilt only when modules were imported since: an object bound into an already
    imported module later is pickled by value until the next import.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._key: tuple[int, int] | None = None
        self._by_id: dict[int, tuple[str, str]] = {}

    def current(self) -> dict[int, tuple[str, str]]:
        """The index, rebuilt first if modules were imported (or registered by value) since."""
        registered = cloudpickle.list_registry_pickle_by_value()
        key = (len(sys.modules), len(registered))
        if key != self._key:
            with self._lock:
                if key != self._key:
                    self._by_id = self._build(registered)
                    self._key = key
        return self._by_id

    @staticmethod
    def _build(registered: Collection[str]) -> dict[int, tuple[str, str]]:
        by_id: dict[int, tuple[str, str]] = {}
        tensors = _tensor_classes() + _storage_classes()
        numpy = sys.modules.get("numpy")
        data = (*tensors, numpy.ndarray) if numpy is not None else tensors
        for module_name, module in sorted(list(sys.modules.items()), key=lambda i: _module_order(i[0])):
            if (module_name in _SKIPPED_MODULES or type(module_name) is not str
                    or not isinstance(module, types.ModuleType)
                    # A lazy module (importlib.util.LazyLoader) would load on being looked at.
                    or type(module).__getattribute__ is not types.ModuleType.__getattribute__
                    or getattr(module, "__spec__", None) is None
                    or any(module_name == name or module_name.startswith(name + ".")
                           for name in registered)):
                continue
            try:
                items = list(vars(module).items())
            except TypeError:
                continue
            # Public names first, then those of a leading underscore.
            for name, value in sorted(items, key=lambda i: str(i[0]).startswith("_")):
                cls = type(value)  # not isinstance: a lazy module proxy answers __class__
                if (cls in _NOT_NAMED or type(name) is not str or name.startswith("__")
                        or issubclass(cls, type) or cls in data
                        or (module_name, name) in _SKIPPED_NAMES):
                    continue
                by_id.setdefault(id(value), (module_name, name))
        return by_id


_MODULE_OBJECTS = ModuleObjects()


def _module_object(obj: Any, index: Mapping[int, tuple[str, str]]) -> tuple[str, str, str, str] | None:
    """(module, name, class module, class qualified name) when ``obj`` is the object the module
    holds under that name now, else None."""
    where = index.get(id(obj))
    if where is None:
        return None
    module_name, name = where
    module = sys.modules.get(module_name)
    if module is None or vars(module).get(name, _MISSING) is not obj:
        return None  # rebound since the index was built, or another object on a reused id
    cls = type(obj)
    cls_module, cls_name = getattr(cls, "__module__", None), getattr(cls, "__qualname__", None)
    if not isinstance(cls_module, str) or not isinstance(cls_name, str) or cls_module == "__main__":
        return None  # an object of the notebook's own class that a module was given
    return (module_name, name, cls_module, cls_name)


def load_module_object(module_name: str, name: str, cls_module: str, cls_name: str) -> Any:
    """The object ``module_name`` holds under ``name``, importing the module; raises
    :class:`ModuleObjectError`, saying why, when it is not there or is of another class."""
    where = f"{module_name}.{name}"
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:
        raise ModuleObjectError(
            f"{where}: import {module_name} failed: {type(exc).__name__}: {exc}") from exc
    value = vars(module).get(name, _MISSING)
    if value is _MISSING:
        value = getattr(module, name, _MISSING)
    if value is _MISSING:
        raise ModuleObjectError(f"{where}: {module_name} has no {name} any more")
    cls = type(value)
    found = (getattr(cls, "__module__", None), getattr(cls, "__qualname__", None))
    if found != (cls_module, cls_name):
        raise ModuleObjectError(f"{where} is now a {found[0]}.{found[1]}, "
                                f"not the {cls_module}.{cls_name} it was")
    return value


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


class _NamespaceMarker(dict):
    """Stands for the notebook's namespace as the globals of cell functions in a pickle."""


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
    # Content blobs of arrays fingerprinted in this checkpoint, by id (the arrays are held).
    digests: dict[int, tuple[Any, str]] = field(default_factory=dict)
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
        """A new blob of ``storage``'s bytes. A host storage is written by a syncing thread while
        the checkpoint goes on (several at once, each core copying); the commit waits for it.
        Another device's is copied to the host and written here, one host copy at a time."""
        if storage.device.type == "cpu":
            blob = store.new_blob_name()
            self._later(self._count_blob)(
                blob, lambda: tensor_io.write_storage(self.folder, storage, blob)[1])
            return blob, int(storage.nbytes())
        with _writing_blobs():
            blob, nbytes, _path = tensor_io.write_storage(self.folder, storage)
        self._count_new(blob, nbytes)
        return blob, nbytes

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
        self.cache.remember(tensor, known[0], storage)
        return known

    def record_for(self, tensor: Any) -> tuple[str, int, str]:
        """(blob, nbytes, device type) of ``tensor``'s storage, writing it if needed."""
        blob, nbytes = self.storage_blob(tensor)
        device = tensor.device.type
        self.reached[blob] = (nbytes, device)
        return (blob, nbytes, device)

    def buffer_blob(self, raw: memoryview) -> str:
        """The content blob holding an out-of-band buffer, written only if new."""
        if self.dry:
            return "dry.bin"
        exporter = raw.obj
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

    def array_digest(self, array: Any) -> str:
        """The content blob name ``array``'s bytes would have (hashed once per checkpoint)."""
        known = self.digests.get(id(array))
        if known is not None and known[0] is array:
            return known[1]
        name = tensor_io.content_name(tensor_io.digest(_array_bytes(array)))
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


def _tensor_classes() -> tuple[type, ...]:
    torch = sys.modules.get("torch")
    if torch is None:
        return ()
    return (torch.Tensor, torch.nn.Parameter)


def _storage_classes() -> tuple[type, ...]:
    torch = sys.modules.get("torch")
    if torch is None:
        return ()
    return (torch.UntypedStorage, torch.TypedStorage)


def _storable(obj: Any) -> bool:
    """Whether a tensor is one dense block of a storage on the host or a CUDA device."""
    return bool(
        obj.layout is sys.modules["torch"].strided
        and (obj.is_cpu or obj.is_cuda)
        and not obj.is_quantized
        and not obj.is_nested
        and not obj.is_neg()
        and not obj.is_conj()
    )


def _bare_storage(obj: Any, untyped: type) -> tuple[Any, str | None]:
    """(untyped storage, dtype name or None) of a storage object."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TypedStorage is deprecated, not our user's doing
        if type(obj) is untyped:
            return obj, None
        return obj.untyped(), str(obj.dtype)


def _keeps_grad(tensor: Any) -> Any:
    """The gradient a pickle of ``tensor`` carries, or None."""
    if tensor.requires_grad and (tensor.is_leaf or tensor.retains_grad):
        return tensor.grad
    return None


class _NamespacePicklerBase(cloudpickle.Pickler):
    """cloudpickle, protocol 5, with cell functions bound to ``user_ns`` rather than copies of it.

    cloudpickle rebuilds functions sharing one ``__globals__`` with one new dict, found in
    ``globals_ref``; pre-seeding it with a marker lets the namespace itself be named, so restored
    cell functions see later assignments, as they did before.
    """

    def __init__(self, file: Any, user_ns: dict[str, Any],
                 buffer_callback: Callable[[pickle.PickleBuffer], bool] | None = None) -> None:
        super().__init__(file, protocol=5, buffer_callback=buffer_callback)
        self._user_ns = user_ns
        self.globals_ref[id(user_ns)] = _NamespaceMarker(__name__="__main__")

    def _dynamic_function_reduce(self, func: types.FunctionType) -> Any:
        reduced = super()._dynamic_function_reduce(func)
        if func.__globals__ is not self._user_ns:
            return reduced
        # The function's globals will be the restored namespace itself, so the copies of the
        # globals it uses need not be pickled (and an unpicklable one cannot sink the function).
        try:
            state, slotstate = reduced[2]
        except (TypeError, ValueError):
            return reduced
        if isinstance(slotstate, dict) and "__globals__" in slotstate:
            slotstate = dict(slotstate, __globals__={})
            reduced = (*reduced[:2], (state, slotstate), *reduced[3:])
        return reduced


def _out_of_band(blobs: BlobWriter, buffer: pickle.PickleBuffer) -> bool:
    """protocol 5's buffer_callback: False sends ``buffer`` out of band, into a blob."""
    try:
        raw = buffer.raw()
    except BufferError:  # not contiguous: in band
        return True
    if raw.nbytes < BUFFER_MIN:
        return True
    blobs.buffer_blob(raw)
    return False


class NamespacePickler(_NamespacePicklerBase):
    """Pickles a group of variables: tensors and bare storages become references to their blobs,
    large buffers are written out of band as content-addressed blobs.
    """

    def __init__(self, file: Any, blobs: BlobWriter, user_ns: dict[str, Any]) -> None:
        # Not a bound method: the pickler would then be a cycle, and its memo, which holds
        # every object pickled, would keep a tensor the user `del`s alive until the garbage
        # collector runs.
        super().__init__(file, user_ns, buffer_callback=functools.partial(_out_of_band, blobs))
        self._blobs = blobs
        self._tensor_types = _tensor_classes()
        self._storage_types = _storage_classes()
        self._module_objects = _MODULE_OBJECTS.current()

    def dump(self, obj: Any) -> None:
        # A list, dict or set is never shown to reducer_override: one that a module holds is
        # named by a persistent id, asked of every object pickled, which doubles the time
        # pickling lists of records takes. So only a group with a variable holding one
        # (``path = sys.path``) asks it; there, it is named wherever the group holds it
        # (variables that share it are in its group). Held only inside other values, such
        # a container stays a copy.
        index = self._module_objects
        if type(obj) is dict and any(type(value) in _MUTABLE and id(value) in index
                                     for value in obj.values()):
            self.persistent_id = self._module_container
        super().dump(obj)

    def _module_container(self, obj: Any) -> Any:
        if type(obj) in _MUTABLE and (named := _module_object(obj, self._module_objects)):
            return (_MODULE_OBJECT, *named)
        return None

    def reducer_override(self, obj: Any) -> Any:
        if id(obj) in self._module_objects and (named := _module_object(obj, self._module_objects)):
            return (_module_object_ref, named)
        cls = type(obj)
        if cls in self._tensor_types and _storable(obj):
            blob, nbytes, device = self._blobs.record_for(obj)
            return (_tensor_ref, (
                blob, nbytes, device, int(obj.storage_offset()), tuple(obj.size()),
                tuple(obj.stride()), str(obj.dtype).removeprefix("torch."),
                bool(obj.requires_grad), cls is not self._tensor_types[0], _keeps_grad(obj),
                bool(obj.is_inference()),
            ))
        if cls in self._storage_types:
            storage, dtype = _bare_storage(obj, self._storage_types[0])
            if storage.device.type in ("cpu", "cuda"):
                blob, nbytes, device = self._blobs.storage_record(storage)
                return (_storage_ref, (blob, nbytes, device, dtype))
        if cls is _NamespaceMarker:
            return (_user_ns_ref, ())
        return super().reducer_override(obj)


    def shared_ids(self) -> set[int]:
        """Ids of the objects this pickler met that another variable could share by reference."""
        return {id(obj) for _, obj in self.memo.copy().values() if _shareable(obj)}


Fingerprint = tuple[bytes, tuple[int, ...]]


@dataclass
class Fingerprints:
    """The fingerprints of a namespace's variables, as one checkpoint took them."""

    by_name: dict[str, Fingerprint | None] = field(default_factory=dict)
    plain: set[str] = field(default_factory=set)  # built-in containers and atoms only
    batches: dict[tuple[str, ...], Fingerprint] = field(default_factory=dict)
    # The code objects these fingerprints name by id (see FingerprintSession._code), held as
    # long as the fingerprints are compared with: no other code object can take their ids.
    held: list[types.CodeType] = field(default_factory=list)


def _batches(names: list[str]) -> list[tuple[str, ...]]:
    """``names`` cut into batches of about _BATCH_SPREAD where the names alone say: a new or a
    removed name changes one batch."""
    batches: list[tuple[str, ...]] = []
    start = 0
    for end, name in enumerate(names, 1):
        if zlib.crc32(name.encode()) % _BATCH_SPREAD == 0 or end - start >= 4 * _BATCH_SPREAD:
            batches.append(tuple(names[start:end]))
            start = end
    if start < len(names):
        batches.append(tuple(names[start:]))
    return batches


class FingerprintSession:
    """Fingerprints the variables of one checkpoint (see the module's docstring).

    A fingerprint is (the fingerprint pickle, or its hash when long; the ids of the mutable
    objects it met that outlive the pickling, in pickling order). Equal fingerprints at two
    checkpoints mean equal pickles with the same objects shared the same way; the ids also say
    which variables share objects (and must be pickled together). Storages of changed tensors
    are written while fingerprinting: their new blob names are what makes the fingerprint differ.
    """

    def __init__(self, blobs: BlobWriter, user_ns: dict[str, Any]) -> None:
        self.blobs = blobs
        self.user_ns = user_ns
        self.guard = blobs.guard if PandasGuard.active() else None
        self.handlers = _Handlers(self._find_handler)
        self.module_objects = _MODULE_OBJECTS.current()
        self._tensor_types = _tensor_classes()
        self._storage_types = _storage_classes()
        self._kinds: dict[type, bool | None] = {}
        self._by_value: dict[int, tuple[Any, bool]] = {}  # see by_value
        self._held: dict[int, types.CodeType] = {}  # see _code
        self._tokens: dict[int, tuple[Any, Any]] = {}  # tensor id -> (tensor, its token)
        # Classes of the notebook, each fingerprinted apart once per checkpoint (see
        # _class_token): id -> (class, its fingerprint), and those being fingerprinted.
        self._classes: dict[int, tuple[type, Fingerprint]] = {}
        self._open: set[int] = set()
        # Ids of what the fingerprint being taken holds as marks, in the order met (classes
        # fingerprinted apart: what they reached; empty OrderedDicts, see _marked_items).
        self._marked: list[int] = []
        # A plain dict, looked up in C, rather than cloudpickle's ChainMap, looked up in Python
        # for every object; taken anew each checkpoint, so reducers registered since count.
        self.dispatch_table = dict(cloudpickle.Pickler.dispatch_table)
        self._sink = io.BytesIO()
        self._pickler = _Fingerprinter(self._sink, self)

    def close(self) -> None:
        """Let go of what the fingerprinting met. The session and its pickler refer to each
        other, so without this a tensor the user then `del`s would keep its memory (GPU memory
        too) until the garbage collector next runs."""
        self._tokens.clear()
        self._by_value.clear()
        self._held.clear()
        self._classes.clear()
        self.handlers.clear()
        self._pickler.clear_memo()
        self._pickler.globals_ref.clear()
        self.dispatch_table.clear()

    def fingerprint_all(self, values: Mapping[str, Any], last: Fingerprints | None) -> Fingerprints:
        """The fingerprints of ``values`` by name; ``last`` are those of the last checkpoint.

        Variables that held only built-in containers and atoms last time are fingerprinted in
        batches first: a batch that did not change stands for all its variables' fingerprints
        (same bytes, same objects), and only a changed batch is taken apart.
        """
        found = Fingerprints()
        if last is not None:
            names = list(filter(last.plain.__contains__, values))
            known = list(last.batches)
            # The same names cut the same way: the cut is reused rather than made again.
            same = names == list(itertools.chain.from_iterable(known))
            for batch in known if same else _batches(names):
                taken, plain = self._fingerprint(tuple(map(values.__getitem__, batch)))
                if taken is None or not plain:
                    continue
                found.batches[batch] = taken
                if last.batches.get(batch) == taken:
                    found.by_name.update(zip(batch, map(last.by_name.__getitem__, batch), strict=True))
                    found.plain.update(batch)
        for name in list(itertools.filterfalse(found.by_name.__contains__, values)):
            found.by_name[name], plain = self._fingerprint(values[name])
            if plain:
                found.plain.add(name)
        found.held = list(self._held.values())
        return found

    def _fingerprint(self, value: Any) -> tuple[Fingerprint | None, bool]:
        """(``value``'s fingerprint or None when it cannot be taken, whether it holds only
        built-in containers and atoms)."""
        # One pickler for many variables: making one costs as much as pickling a small value.
        pickler, sink = self._pickler, self._sink
        sink.seek(0)
        sink.truncate()
        pickler.reductions = 0
        try:
            pickle.Pickler.dump(pickler, value)
        except Exception:
            self._pickler = _Fingerprinter(sink, self)  # a failed dump may leave it half-way
            self._marked.clear()
            return None, False
        marked = tuple(self._marked)
        self._marked.clear()
        data = sink.getvalue()
        # Only built-in containers and atoms (no reduction): nothing was made by the pickling.
        plain = not pickler.reductions
        # What a large one reaches is not read off the memo (see _container_ids).
        memo = None if plain and len(data) > _FINGERPRINT_KEPT else pickler.memo.copy()
        if memo is None or len(memo) > _MEMO_REUSED:
            # Clearing a memo costs what it grew to: a large one is not reused.
            self._pickler = _Fingerprinter(sink, self)
        else:
            pickler.clear_memo()
        del pickler  # its memo held every object met: the counts below need it gone
        if len(data) > _FINGERPRINT_KEPT:
            data = tensor_io.digest(data).encode()
        if memo is None:
            return (data, _container_ids(value)), True
        if not plain:
            return (data, _lasting_ids(memo, self._kinds, self.by_value) + marked), False
        found = {index: key for key, (index, obj) in memo.items() if type(obj) in _MUTABLE}
        return (data, _in_order(found)), True

    def _find_handler(self, cls: type) -> Callable[[Any], Any] | None:
        if issubclass(cls, type) or cls is types.FunctionType:
            return self._cloudpickle  # by value when the notebook defined it
        if cls is types.CodeType:
            return self._code
        if cls in self._tensor_types:
            return self._tensor
        if cls in self._storage_types:
            return _changed
        if cls is _NamespaceMarker:
            return lambda _obj: (_fp, _USER_NS)
        numpy = sys.modules.get("numpy")
        if numpy is not None and cls is numpy.ndarray:
            return self._array
        pandas = sys.modules.get("pandas")
        if pandas is not None and self.guard is not None:
            if issubclass(cls, pandas.DataFrame | pandas.Series):
                return self._frame
            if issubclass(cls, pandas.api.extensions.ExtensionArray):
                return self._protected
        if _state_reduced(cls, self.dispatch_table):
            args = ("object", cls)  # held by the handler: one object per class, not per instance
            return lambda obj: self._object_token(args, obj)
        return None

    def _cloudpickle(self, obj: Any) -> Any:
        if not self.by_value(obj):
            return NotImplemented  # by reference, as cloudpickle would, without asking it again
        if isinstance(obj, type) and id(obj) not in self._open:
            return self._class_token(obj)
        reduced = cloudpickle.Pickler.reducer_override(self._pickler, obj)
        if isinstance(obj, type) and isinstance(reduced, tuple) and len(reduced) > 2:
            # copyreg caches __slotnames__ in a class the first time one of its instances is
            # pickled: derived data, left out so that this does not count as a change.
            clsdict, *rest = reduced[2]
            if isinstance(clsdict, dict) and "__slotnames__" in clsdict:
                clsdict = {k: v for k, v in clsdict.items() if k != "__slotnames__"}
                reduced = (*reduced[:2], (clsdict, *rest), *reduced[3:])
        return reduced

    def by_value(self, obj: Any) -> bool:
        """:func:`_by_value`, once per class or function and checkpoint: it is asked for each
        one every fingerprint meets."""
        known = self._by_value.get(id(obj))
        if known is None or known[0] is not obj:
            known = self._by_value[id(obj)] = (obj, _by_value(obj))
        return known[1]

    def _object_token(self, args: tuple[str, type], obj: Any) -> Any:
        """What the default reduction holds, without its per-object tuple and, for a state
        that is the object's own dict or one made for the occasion (a module's copy of its
        dict), without the dict: its items in order. Another dict could be shared with another
        variable: it is pickled as it is, so its identity counts."""
        state = obj.__getstate__()
        if isinstance(state, dict) and (
                sys.getrefcount(state) <= 2 or state is getattr(obj, "__dict__", None)):
            items = _marked_items(state, getattr(obj, "__dict__", None), self._marked)
            return (_fp, args, None, None, items)
        return (_fp, args, state)

    def _class_token(self, cls: type) -> Any:
        """A class of the notebook as a token of its fingerprint, taken apart and once per
        checkpoint: a model's classes, met in the model and as variables of their own, cost
        more than the rest of what a fingerprint meets. What the class's fingerprint reached
        counts as reached by the fingerprint that met it (its ids join the others)."""
        known = self._classes.get(id(cls))
        if known is None or known[0] is not cls:
            known = self._classes[id(cls)] = (cls, self._class_print(cls))
        data, reached = known[1]
        self._marked += reached
        return (_fp, ("class", data))

    def _class_print(self, cls: type) -> Fingerprint:
        sink = io.BytesIO()
        pickler = _Fingerprinter(sink, self)
        marked = len(self._marked)
        self._open.add(id(cls))  # met again within itself: pickled there as any class is
        try:
            pickle.Pickler.dump(pickler, cls)
        finally:
            self._open.discard(id(cls))
        memo = pickler.memo.copy()
        pickler.clear_memo()
        del pickler  # its memo held every object met: the counts below need it gone
        reached = _lasting_ids(memo, self._kinds, self.by_value) + tuple(self._marked[marked:])
        del self._marked[marked:]
        return tensor_io.digest(sink.getvalue()).encode(), reached

    def _code(self, code: types.CodeType) -> Any:
        """A code object by its id: it cannot change, and while the fingerprints naming it hold
        it, no other object takes that id. Its pickle (bytecode, constants, names, line table)
        cost a fifth of fingerprinting the notebook's classes and functions."""
        self._held[id(code)] = code
        return (_fp, ("code", id(code)))

    def _tensor(self, tensor: Any) -> Any:
        known = self._tokens.get(id(tensor))
        if known is not None and known[0] is tensor:
            return known[1]  # a model's parameters, met again in its optimizer
        token = self._tensor_token(tensor)
        self._tokens[id(tensor)] = (tensor, token)
        return token

    def _tensor_token(self, tensor: Any) -> Any:
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError):  # sparse, and other tensors of no storage
            return NotImplemented
        cache = self.blobs.cache
        known = cache.token(tensor, storage)
        if known is not None and self.blobs.found(known[0]) is not None:
            meta = known[1]
        else:
            if not _storable(tensor):
                return NotImplemented  # torch's own reduction, through its storages
            blob, _nbytes = self.blobs.storage_blob(tensor)
            # Few objects per token: every object in a fingerprint costs (see _lasting_ids).
            meta = (f"{blob} {tensor.get_device()} {tensor.storage_offset()} "
                    f"{tuple(tensor.size())} {tensor.stride()} {tensor.dtype} "
                    f"{tensor.requires_grad} {type(tensor).__name__} {tensor.is_inference()}")
            cache.remember_token(tensor, storage, meta)
        grad = _keeps_grad(tensor)
        return (_fp, (), meta if grad is None else (meta, grad))

    def _array(self, array: Any) -> Any:
        if self.guard is not None and self.guard.protects(array):
            return (_fp, ("frozen", id(array)))
        if array.dtype.hasobject or array.nbytes < _DIGEST_MIN:
            return NotImplemented  # pickled as it is: elements, or few bytes
        order = "C" if array.flags.c_contiguous or not array.flags.f_contiguous else "F"
        return (_fp, ("array", array.dtype.str, array.shape, order,
                      self.blobs.array_digest(array)))

    def _frame(self, frame: Any) -> Any:
        assert self.guard is not None
        self.guard.protect(frame)
        return NotImplemented  # pickled as usual: axes, attrs, flags; its arrays as identities

    def _protected(self, array: Any) -> Any:
        assert self.guard is not None
        if self.guard.protects(array):
            return (_fp, ("frozen", id(array)))
        return NotImplemented


class _Handlers(dict[type, Callable[[Any], Any] | None]):
    """What fingerprints instances of each class (None: the pickler's usual reduction), found
    once per class: looked up in C for every object a fingerprint meets."""

    def __init__(self, find: Callable[[type], Callable[[Any], Any] | None]) -> None:
        super().__init__()
        self._find = find

    def __missing__(self, cls: type) -> Callable[[Any], Any] | None:
        found = self[cls] = self._find(cls)
        return found


_USER_NS = ("user_ns",)
_ORDERED = ("ordered dict",)


def _state_reduced(cls: type, dispatch: Mapping[type, Any]) -> bool:
    """Whether instances of ``cls`` pickle as ``copyreg.__newobj__(cls)`` and their
    ``__getstate__()`` alone, the default that most classes (models, their layers, optimizers,
    the notebook's own classes) keep.

    Not subclasses of list or dict: their default pickle also holds their items, which
    ``__getstate__()`` leaves out, so a token of the state alone would miss an append.
    """
    return (cls.__reduce_ex__ is object.__reduce_ex__ and cls.__reduce__ is object.__reduce__
            and cls not in dispatch and not hasattr(cls, "__getnewargs_ex__")
            and not hasattr(cls, "__getnewargs__") and hasattr(cls, "__getstate__")
            and not issubclass(cls, list | dict))


_EMPTY_ORDERED = "gpufrac: an empty OrderedDict"


def _marked_items(state: dict[str, Any], attributes: dict[str, Any] | None,
                  marked: list[int]) -> Iterator[tuple[str, Any]]:
    """``state``'s items, in which an empty OrderedDict (no items, no attributes) that is the
    object's own attribute stands as a mark, its id added to ``marked``. A model holds a dozen
    per layer (its hooks): as marks, they cost a fingerprint a third of what they did. Their
    ids still count, so one swapped for another, or shared anew, is still a change."""
    items = list(state.items())
    if attributes is None:
        return iter(items)
    for i, (key, value) in enumerate(items):
        if (type(value) is collections.OrderedDict and not value
                and attributes.get(key) is value and not vars(value)):
            items[i] = (key, _EMPTY_ORDERED)
            marked.append(id(value))
    return iter(items)


def _changed(_obj: Any) -> Any:
    return (_fp, ("changed", next(_DIRTY)))


class _Fingerprinter(_NamespacePicklerBase):
    """The pickler of fingerprints: cloudpickle's reductions, with the session's tokens."""

    def __init__(self, file: Any, session: FingerprintSession) -> None:
        self.dispatch_table = session.dispatch_table
        super().__init__(file, session.user_ns)
        self._handlers = session.handlers
        self._module_objects = session.module_objects
        self.reductions = 0  # objects that were not built-in containers or atoms

    def reducer_override(self, obj: Any) -> Any:
        self.reductions += 1
        if id(obj) in self._module_objects and (named := _module_object(obj, self._module_objects)):
            # As the checkpoint pickles it: by its name (its state is its module's).
            return (_fp, ("module object", *named))
        cls = type(obj)
        if cls is collections.OrderedDict:
            # Here rather than through a handler: a model has a dozen per module (its hooks),
            # and their own reduction asks copyreg, in Python, for slot names.
            return (_fp, _ORDERED, vars(obj) or None, None, iter(obj.items()))
        handler = self._handlers[cls]
        if handler is None:
            return NotImplemented
        return handler(obj)

    def _dynamic_function_reduce(self, func: types.FunctionType) -> Any:
        # All a pickle by value holds of a function, without the globals of a cell function
        # (they are the namespace itself) and without cloudpickle's search of sys.modules
        # for submodules the function uses, which costs most of a fingerprint.
        closure = None if func.__closure__ is None else tuple(
            _cell_contents(cell) for cell in func.__closure__)
        used = None if func.__globals__ is self._user_ns else {
            name: func.__globals__[name] for name in sorted(_code_names(func.__code__))
            if name in func.__globals__}
        return (_fp, ("function",), (
            func.__code__, func.__name__, func.__qualname__, func.__module__, func.__doc__,
            func.__defaults__, func.__kwdefaults__, func.__annotations__, func.__dict__,
            closure, used,
        ))


_EMPTY_CELL = "gpufrac: empty cell"


def _cell_contents(cell: Any) -> Any:
    try:
        return cell.cell_contents
    except ValueError:
        return _EMPTY_CELL


def _code_names(code: types.CodeType) -> set[str]:
    """Global names ``code`` and the code nested in it may use."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _code_names(const)
    return names


def _lasting_ids(memo: dict[int, tuple[int, Any]], kinds: dict[type, bool | None],
                 by_value: Callable[[Any], bool]) -> tuple[int, ...]:
    """Ids of the shareable objects a pickling met, in pickling order, less those the pickling
    made itself (a ``__getstate__`` returning a new dict): they are new at every checkpoint.

    An object the pickling made is referenced only by the pickler's memo and by other such
    objects; with the pickler's memo cleared, reference counts tell them apart. ``kinds``
    caches :func:`_shareable_kind` for the checkpoint, ``by_value`` answers :func:`_by_value`.
    """
    probe: list[Any] = []  # made here, held by the memo alone: the count of such an object
    memo[id(probe)] = (-1, probe)
    del probe
    # Strings and numbers refer to nothing and are never shared: left out from the start.
    extra = {key: sys.getrefcount(obj) for key, (_, obj) in memo.items()
             if type(obj) not in _ATOMS}
    baseline = extra[next(reversed(extra))]
    made = [key for key, count in extra.items() if count == baseline]
    while made:
        key = made.pop()
        extra[key] = 0  # made by the pickling: not among the ids
        for child in gc.get_referents(memo[key][1]):
            child_key = id(child)
            count = extra.get(child_key)
            if count:
                extra[child_key] = count - 1
                if count - 1 == baseline:
                    made.append(child_key)
    found = {}
    for key, count in extra.items():
        if not count:
            continue
        index, obj = memo[key]
        cls = type(obj)
        kind = kinds[cls] if cls in kinds else kinds.setdefault(cls, _shareable_kind(cls, obj))
        if kind or (kind is None and by_value(obj)):
            found[index] = key
    return _in_order(found)


def _in_order(by_index: dict[int, int]) -> tuple[int, ...]:
    """The ids of a memo's objects in pickling order (a memo's copy is in no order; numbers
    sort faster than pairs)."""
    return tuple(map(by_index.__getitem__, sorted(by_index)))


_MUTABLE = frozenset({list, dict, set, bytearray})
_ATOMS = frozenset({str, bytes, int, float, complex, bool, type(None)})
_IMMUTABLE = _ATOMS | {tuple, frozenset}

# The built-ins a pickle without reductions can hold that refer to other objects.
_REFERRING = frozenset({list, dict, set, frozenset, tuple})


def _container_ids(value: Any) -> tuple[int, ...]:
    """Ids of the lists, dicts and sets that ``value``, made of built-in containers and atoms
    only, reaches: each once, breadth first (a fixed order that moves when an object moves).

    Level by level in bulk C calls, for large values: reading them off the pickler's memo
    takes a Python step per object, and took 1.9 s a checkpoint for a list of 200,000 small
    records. Small values are read off the memo, where these calls' fixed cost would show.
    """
    seen: set[int] = set()
    found: list[int] = []
    level: list[Any] = [value]
    while level:
        level = list(itertools.compress(level, map(_REFERRING.__contains__, map(type, level))))
        by_id = dict(zip(map(id, level), level, strict=True))
        new = list(itertools.filterfalse(seen.__contains__, by_id))
        seen.update(new)
        objects = list(map(by_id.__getitem__, new))
        found += itertools.compress(new, map(_MUTABLE.__contains__, map(type, objects)))
        level = gc.get_referents(*objects)
    return tuple(found)


def _shareable(obj: Any) -> bool:
    """Whether two variables holding ``obj`` must keep holding one object after a restore.

    Mutable containers, arrays, objects with state of their own and what is pickled by value
    (classes and functions of the notebook) count; what is pickled by reference or immutable
    (strings, numbers, importable classes and functions, modules) is the same everywhere anyway.
    """
    kind = _shareable_kind(type(obj), obj)
    return kind if kind is not None else _by_value(obj)


def _shareable_kind(cls: type, obj: Any) -> bool | None:
    """:func:`_shareable` for every instance of ``cls`` (``obj`` is one), or None when it
    depends on the object (classes and functions)."""
    if cls in _MUTABLE:
        return True
    if cls in _IMMUTABLE:
        return False
    if issubclass(cls, type) or cls is types.FunctionType:
        return None
    if issubclass(cls, types.ModuleType | enum.Enum):
        return False
    if issubclass(cls, list | dict | set | bytearray):
        return True
    numpy = sys.modules.get("numpy")
    return hasattr(obj, "__dict__") or (numpy is not None and issubclass(cls, numpy.ndarray))


def _by_value(obj: type | types.FunctionType) -> bool:
    """Whether cloudpickle pickles this class or function by value (it is not importable)."""
    module_name = getattr(obj, "__module__", None)
    if not isinstance(module_name, str) or module_name == "__main__":
        return True
    module = sys.modules.get(module_name)
    if module is None:
        return True
    target: Any = module
    try:
        for part in obj.__qualname__.split("."):
            target = getattr(target, part)
    except AttributeError:
        return True
    # Registering a package registers its modules too.
    return target is not obj or any(
        module_name == name or module_name.startswith(name + ".")
        for name in cloudpickle.list_registry_pickle_by_value())


class NamespaceUnpickler(pickle.Unpickler):
    """Rebuilds tensors from blobs on the kernel's device and binds functions to ``user_ns``.

    ``storages`` may be shared by the unpicklers of one restore, so tensors of different
    groups that viewed one storage still share it. ``device`` None means the kernel's device.
    ``root`` is the checkpoint directory held open (a path is opened and checked per blob).
    ``fetch(blob, nbytes)``, when given, returns a storage read ahead into host memory.
    ``buffers`` are the group's out-of-band buffers, in order. Pickles of format 2 (persistent
    ids, see :meth:`persistent_load`) load as well.
    """

    def __init__(
        self, file: Any, root: store.CheckpointDir | Path, user_ns: dict[str, Any],
        device: str | None,
        on_tensor: Callable[[Any, str], None] | None = None,
        storages: dict[tuple[str, str], Any] | None = None,
        buffers: Iterable[Any] = (),
        fetch: Callable[[str, int], Any] | None = None,
    ) -> None:
        super().__init__(file, buffers=buffers)
        self._root = root
        self._user_ns = user_ns
        self._device = device
        self._on_tensor = on_tensor
        self._fetch = fetch
        self._storages: dict[tuple[str, str], Any] = {} if storages is None else storages
        self._refs: dict[str, Callable[..., Any]] = {
            _tensor_ref.__name__: self._load_tensor,
            _storage_ref.__name__: self._load_bare_storage,
            _user_ns_ref.__name__: lambda: self._user_ns,
            _module_object_ref.__name__: load_module_object,
        }
        self._v2_tensors: dict[int, Any] = {}
        self.moved_to_cpu_bytes = 0

    def persistent_load(self, pid: Any) -> Any:
        """Format 2's references: the namespace, bare storages, and tensors numbered per pickle
        (a tensor met twice is one tensor); and the lists, dicts and sets of modules."""
        if pid == _V2_USER_NS:
            return self._user_ns
        if isinstance(pid, tuple) and len(pid) == 5 and pid[0] == _MODULE_OBJECT:
            return load_module_object(*pid[1:])
        if isinstance(pid, tuple) and len(pid) == 5 and pid[0] == _V2_STORAGE:
            return self._load_bare_storage(*pid[1:])
        if isinstance(pid, tuple) and len(pid) in (12, 13) and pid[0] == _V2_TENSOR:
            return self._v2_tensor(pid)
        raise pickle.UnpicklingError(f"unknown persistent id {pid!r}")

    def _v2_tensor(self, pid: tuple[Any, ...]) -> Any:
        (_tag, index, blob, nbytes, device, offset, size, stride, dtype_name, requires_grad,
         is_param, grad_pid) = pid[:12]
        known = self._v2_tensors.get(index)
        if known is None:
            grad = None if grad_pid is None else self._v2_tensor(grad_pid)
            # Checkpoints written before inference tensors were recorded did not say.
            inference = bool(pid[12]) if len(pid) == 13 else False
            known = self._v2_tensors[index] = self._load_tensor(
                blob, nbytes, device, offset, tuple(size), tuple(stride), dtype_name,
                requires_grad, is_param, grad, inference)
        return known

    def find_class(self, module: str, name: str) -> Any:
        """Our references resolve to this restore's loaders; the rest as pickle does."""
        if module == __name__ and name in _REFS:
            return self._refs[name]
        return super().find_class(module, name)

    def _gpu_target(self) -> str:
        if self._device is None:
            # A fresh kernel has not imported torch yet, and without torch the adapter can only
            # answer "cpu": import it first, or every GPU tensor would land on the host.
            import torch  # noqa: F401

            self._device = torch_adapter.current_device()
        return self._device

    def _storage(self, blob: str, nbytes: int, device: str) -> Any:
        target = "cpu" if device == "cpu" else self._gpu_target()
        storage = self._storages.get((blob, target))
        if storage is None:
            if device != "cpu" and target == "cpu":
                self.moved_to_cpu_bytes += nbytes
            if self._fetch is not None:
                storage = self._fetch(blob, nbytes)
                if target != "cpu":
                    storage = tensor_io.to_device(storage, target)
            else:
                with store.opened(self._root) as folder:
                    storage = tensor_io.read_storage(folder, blob, nbytes, target)
            self._storages[(blob, target)] = storage
        return storage

    def _load_bare_storage(self, blob: str, nbytes: int, device: str, dtype_name: str | None) -> Any:
        storage = self._storage(blob, nbytes, device)
        if dtype_name is None:
            return storage
        import torch

        dtype = getattr(torch, str(dtype_name).removeprefix("torch."))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # TypedStorage is deprecated, and still in notebooks
            return torch.TypedStorage(wrap_storage=storage, dtype=dtype, _internal=True)

    def _load_tensor(self, blob: str, nbytes: int, device: str, offset: int, size: tuple[int, ...],
                     stride: tuple[int, ...], dtype_name: str, requires_grad: bool, is_param: bool,
                     grad: Any, inference: bool) -> Any:
        import torch

        storage = self._storage(blob, nbytes, device)
        dtype = getattr(torch, dtype_name)
        # An inference tensor stays one: code that relied on it (no autograd, no version
        # counter) behaves as before the restore.
        mode = torch.inference_mode() if inference else torch.no_grad()
        with mode:
            tensor = torch.empty(0, dtype=dtype, device=storage.device)
            tensor.set_(storage, offset, size, stride)
        if requires_grad:
            tensor.requires_grad_(True)
        if is_param:
            tensor = torch.nn.Parameter(tensor, requires_grad=requires_grad)
        if grad is not None:
            tensor.grad = grad
        if self._on_tensor is not None:
            self._on_tensor(tensor, blob)
        return tensor


class NullSink(io.RawIOBase):
    """A file that forgets what is written: for pickling only to learn about a value."""

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        return memoryview(data).nbytes


def unpicklable_reason(
    name: str, value: Any, blobs: BlobWriter, user_ns: dict[str, Any]
) -> str | None:
    """Why ``value`` alone cannot be pickled, or None if it can (nothing is written)."""
    dry = BlobWriter(blobs.folder, blobs.cache, dry=True)
    try:
        NamespacePickler(NullSink(), dry, user_ns).dump({name: value})
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"[:300]
    return None
