"""One-pass namespace pickling: tensors go to separate blobs, cell functions keep the live globals."""

from __future__ import annotations

import contextlib
import enum
import hashlib
import io
import pickle
import sys
import types
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import cloudpickle

from jupyter_gpufrac.kernel import store, tensor_io, torch_adapter

TENSOR_TAG = "gpufrac.tensor"
STORAGE_TAG = "gpufrac.storage"
USER_NS_TAG = "gpufrac.user_ns"


@dataclass
class _Seen:
    """One tensor on a storage, as it was when its storage was last written or reused."""

    ref: weakref.ref[Any]
    version: int


@dataclass
class _StorageEntry:
    """The blob holding one storage, and every tensor on it that the last checkpoint met."""

    blob: str
    nbytes: int
    tensors: dict[int, _Seen] = field(default_factory=dict)


class IncrementalCache:
    """Remembers which blob holds each storage, to skip storages that did not change.

    A storage counts as unchanged when every tensor on it that the last checkpoint met is
    still alive with the same ``_version`` (bumped by every in-place operation). All of them
    count: tensors restored separately onto one storage (a tensor and its view) have version
    counters of their own, so a change through one is seen only on that one. A tensor that
    died meanwhile could have written to the storage: its storage is written again.
    Writes that bypass the version counter (``t.data.add_()``, writing through ``t.numpy()``)
    are not seen: take a full checkpoint (``%gpu checkpoint --full``) after those.
    """

    def __init__(self) -> None:
        self._storages: dict[tuple[str, int], _StorageEntry] = {}

    def __len__(self) -> int:
        return sum(len(e.tensors) for e in self._storages.values())

    @staticmethod
    def _key(tensor: Any) -> tuple[str, int]:
        return (str(tensor.device), int(tensor.untyped_storage().data_ptr()))

    def lookup(self, tensor: Any) -> str | None:
        """The blob holding ``tensor``'s storage if nothing on it changed, or None."""
        if _no_version(tensor):
            return None
        entry = self._storages.get(self._key(tensor))
        if entry is None or entry.nbytes != tensor.untyped_storage().nbytes():
            return None
        if id(tensor) not in entry.tensors:
            return None  # a tensor new on this storage: it may have written to it
        for key, seen in entry.tensors.items():
            alive = seen.ref()
            if alive is None or id(alive) != key or int(alive._version) != seen.version:
                return None
        return entry.blob

    def remember(self, tensor: Any, blob: str) -> None:
        """Record that ``blob`` holds ``tensor``'s storage as it is now."""
        if _no_version(tensor):
            return  # without a version counter a change cannot be seen: always written
        storage_key = self._key(tensor)
        nbytes = int(tensor.untyped_storage().nbytes())
        entry = self._storages.get(storage_key)
        if entry is None or entry.blob != blob or entry.nbytes != nbytes:
            # The storage was just written: tensors still on it are as the new blob has them.
            kept = {} if entry is None else {
                k: _Seen(seen.ref, int(alive._version)) for k, seen in entry.tensors.items()
                if (alive := seen.ref()) is not None and id(alive) == k
            }
            entry = self._storages[storage_key] = _StorageEntry(blob, nbytes, kept)
        key = id(tensor)

        # A tensor that dies may have changed its storage last: the storage is then written
        # again (and ids of dead tensors are never confused with new ones).
        def forget(dead: weakref.ref[Any], storage_key: tuple[str, int] = storage_key) -> None:
            self._drop(storage_key, dead)

        entry.tensors[key] = _Seen(weakref.ref(tensor, forget), int(tensor._version))

    def _drop(self, storage_key: tuple[str, int], ref: weakref.ref[Any]) -> None:
        entry = self._storages.get(storage_key)
        if entry is not None and any(seen.ref is ref for seen in entry.tensors.values()):
            del self._storages[storage_key]

    def forget_blobs(self, blobs: set[str]) -> None:
        """Drop entries pointing at blobs about to be deleted."""
        for key in [k for k, e in self._storages.items() if e.blob in blobs]:
            del self._storages[key]

    def clear(self) -> None:
        """Forget everything: the next checkpoint writes every tensor."""
        self._storages.clear()


def _no_version(tensor: Any) -> bool:
    # Tensors made under torch.inference_mode() raise on ``_version``.
    is_inference = getattr(tensor, "is_inference", None)
    return bool(is_inference is not None and is_inference())


@dataclass
class BlobWriter:
    """Writes each storage once per checkpoint and reuses blobs of unchanged tensors."""

    folder: store.CheckpointDir
    cache: IncrementalCache
    dry: bool = False
    referenced: dict[str, int] = field(default_factory=dict)
    bytes_written: int = 0
    blobs_written: int = 0
    tensor_bytes: int = 0
    group_bytes_written: int = 0
    groups_written: int = 0
    new_blobs: list[str] = field(default_factory=list)  # written, not yet fsynced
    # Storage blobs the group being pickled reaches: blob -> (nbytes, device type).
    reached: dict[str, tuple[int, str]] = field(default_factory=dict)
    _by_storage: dict[int, tuple[str, int]] = field(default_factory=dict)
    _keepalive: list[Any] = field(default_factory=list)

    def mark(self) -> tuple[dict[str, int], int]:
        """What is referenced so far, to go back to if the pickling that follows fails."""
        return dict(self.referenced), self.tensor_bytes

    def rollback(self, mark: tuple[dict[str, int], int]) -> None:
        """Forget what a failed pickling referenced; blobs it wrote are reused, not redone.

        Tensors only a failed variable reached are then unreferenced: garbage, not kept.
        """
        self.referenced, self.tensor_bytes = dict(mark[0]), mark[1]

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
        self._reference(*known, device)
        return (known[0], known[1], device)

    def _write(self, storage: Any) -> tuple[str, int]:
        blob, nbytes, _path = tensor_io.write_storage(self.folder, storage)
        self.new_blobs.append(blob)
        self.bytes_written += nbytes
        self.blobs_written += 1
        return blob, nbytes

    def group_blob(self, data: bytes) -> str:
        """The content-addressed blob holding one group's pickle; written only if new."""
        name = "g-" + hashlib.sha256(data).hexdigest() + ".bin"
        if not self.dry and not self.folder.exists(name, blob=True):
            self.folder.write_bytes_atomic(name, data, blob=True, durable=False)
            self.new_blobs.append(name)
            self.group_bytes_written += len(data)
            self.groups_written += 1
        self.referenced[name] = len(data)
        return name

    def _reference(self, blob: str, nbytes: int, device: str) -> None:
        self.reached[blob] = (nbytes, device)
        if blob not in self.referenced:
            self.referenced[blob] = nbytes
            self.tensor_bytes += nbytes

    def record_for(self, tensor: Any) -> tuple[str, int, str]:
        """(blob, nbytes, device type) of ``tensor``'s storage, writing it if needed."""
        storage = tensor.untyped_storage()
        device = tensor.device.type
        if self.dry:
            return ("dry.bin", int(storage.nbytes()), device)
        key = int(storage._cdata)
        known = self._by_storage.get(key)
        if known is None:
            blob = self.cache.lookup(tensor)
            if blob is not None and self.folder.exists(blob, blob=True):
                known = (blob, int(storage.nbytes()))
            else:
                known = self._write(storage)
            self._by_storage[key] = known
            # Keep the storage alive so its _cdata cannot be reused within this checkpoint.
            self._keepalive.append(storage)
        self.cache.remember(tensor, known[0])
        self._reference(*known, device)
        return (known[0], known[1], device)


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
    import torch

    return bool(
        obj.layout == torch.strided
        and obj.device.type in ("cpu", "cuda")
        and not obj.is_quantized
        and not obj.is_nested
        and not obj.is_neg()
        and not obj.is_conj()
    )


class NamespacePickler(cloudpickle.Pickler):
    """cloudpickle with tensors and storages as persistent ids, cell functions bound to ``user_ns``.

    ``tensor_ids`` collects the ids of the tensors and storages it met: with the memo, they say
    which objects two variables share, so that they are saved together.
    """

    def __init__(self, file: Any, blobs: BlobWriter, user_ns: dict[str, Any]) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self._blobs = blobs
        self._user_ns = user_ns
        self._tensor_types = _tensor_classes()
        self._storage_types = _storage_classes()
        self._tensor_ids: dict[int, int] = {}
        self.tensor_ids: set[int] = set()
        # cloudpickle rebuilds functions sharing one __globals__ with one new dict, found in
        # globals_ref; pre-seeding it with a marker lets us pickle that dict as "the notebook's
        # namespace", so restored cell functions see later assignments, as they did before.
        self._ns_marker: dict[str, Any] = {"__name__": "__main__"}
        self.globals_ref[id(user_ns)] = self._ns_marker

    def persistent_id(self, obj: Any) -> Any:
        """Tensors, bare storages and the namespace marker are stored out of band."""
        if obj is self._ns_marker:
            return (USER_NS_TAG,)
        cls = type(obj)
        if self._tensor_types and cls in self._tensor_types and _storable(obj):
            return self._tensor_pid(obj)
        if self._storage_types and cls in self._storage_types:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # TypedStorage is deprecated, not our user's doing
                storage = obj if cls is self._storage_types[0] else obj.untyped()
                dtype = None if cls is self._storage_types[0] else str(obj.dtype)
            if storage.device.type in ("cpu", "cuda"):
                self.tensor_ids.add(id(obj))
                blob, nbytes, device = self._blobs.storage_record(storage)
                return (STORAGE_TAG, blob, nbytes, device, dtype)
        return None

    def _tensor_pid(self, obj: Any) -> tuple[Any, ...]:
        self.tensor_ids.add(id(obj))
        index = self._tensor_ids.setdefault(id(obj), len(self._tensor_ids))
        blob, nbytes, device = self._blobs.record_for(obj)
        keeps_grad = obj.requires_grad and (obj.is_leaf or obj.retains_grad)
        grad = obj.grad if keeps_grad else None
        grad_pid = (self._tensor_pid(grad) if grad is not None and type(grad) in self._tensor_types
                    and _storable(grad) else None)
        return (
            TENSOR_TAG, index, blob, nbytes, device, int(obj.storage_offset()),
            tuple(obj.size()), tuple(obj.stride()), str(obj.dtype).removeprefix("torch."),
            bool(obj.requires_grad), type(obj) is not self._tensor_types[0], grad_pid,
            bool(obj.is_inference()),
        )

    def shared_ids(self) -> set[int]:
        """Ids of the objects this pickler met that another variable could share by reference."""
        found = {id(obj) for _, obj in self.memo.copy().values() if _shareable(obj)}
        return found | self.tensor_ids

    def _dynamic_function_reduce(self, func: types.FunctionType) -> Any:
        reduced = super()._dynamic_function_reduce(func)
        if func.__globals__ is not self._user_ns:
            return reduced
        # The function's globals will be the restored namespace itself, so the copies of the
        # globals it uses need not be pickled (and an unpicklable one cannot sink the function).
        with contextlib.suppress(Exception):
            state, slotstate = reduced[2]
            if isinstance(slotstate, dict) and "__globals__" in slotstate:
                slotstate = dict(slotstate, __globals__={})
                reduced = (*reduced[:2], (state, slotstate), *reduced[3:])
        return reduced


def _shareable(obj: Any) -> bool:
    """Whether two variables holding ``obj`` must keep holding one object after a restore.

    Mutable containers, objects with state of their own and what cells define (pickled by
    value) count; what is pickled by reference or immutable (strings, numbers, importable
    classes and functions, modules, dtypes) is the same everywhere anyway.
    """
    if isinstance(obj, type | types.FunctionType):
        return getattr(obj, "__module__", None) == "__main__"
    if isinstance(obj, types.ModuleType | enum.Enum):
        return False
    if isinstance(obj, list | dict | set | bytearray):
        return True
    return hasattr(obj, "__dict__")


class NamespaceUnpickler(pickle.Unpickler):
    """Rebuilds tensors from blobs on the kernel's device and binds functions to ``user_ns``.

    ``storages`` may be shared by the unpicklers of one restore, so tensors of different
    groups that viewed one storage still share it. ``device`` None means the kernel's device.
    ``root`` is the checkpoint directory held open (a path is opened and checked per blob).
    """

    def __init__(
        self, file: Any, root: store.CheckpointDir | Path, user_ns: dict[str, Any],
        device: str | None,
        on_tensor: Callable[[Any, str], None] | None = None,
        storages: dict[tuple[str, str], Any] | None = None,
    ) -> None:
        super().__init__(file)
        self._root = root
        self._user_ns = user_ns
        self._device = device
        self._on_tensor = on_tensor
        self._tensors: dict[int, Any] = {}
        self._storages: dict[tuple[str, str], Any] = {} if storages is None else storages
        self.moved_to_cpu_bytes = 0

    def persistent_load(self, pid: Any) -> Any:
        """Resolve the ids written by :class:`NamespacePickler`."""
        if pid == (USER_NS_TAG,):
            return self._user_ns
        if isinstance(pid, tuple) and pid and pid[0] == TENSOR_TAG:
            return self._load_tensor(pid)
        if isinstance(pid, tuple) and pid and pid[0] == STORAGE_TAG:
            return self._load_bare_storage(pid)
        raise pickle.UnpicklingError(f"unknown persistent id {pid!r}")

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
            with store.opened(self._root) as folder:
                storage = tensor_io.read_storage(folder, blob, nbytes, target)
            self._storages[(blob, target)] = storage
        return storage

    def _load_bare_storage(self, pid: tuple[Any, ...]) -> Any:
        _tag, blob, nbytes, device, dtype_name = pid
        storage = self._storage(blob, nbytes, device)
        if dtype_name is None:
            return storage
        import torch

        dtype = getattr(torch, str(dtype_name).removeprefix("torch."))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # TypedStorage is deprecated, and still in notebooks
            return torch.TypedStorage(wrap_storage=storage, dtype=dtype, _internal=True)

    def _load_tensor(self, pid: tuple[Any, ...]) -> Any:
        (_tag, index, blob, nbytes, device, offset, size, stride, dtype_name, requires_grad,
         is_param, grad_pid) = pid[:12]
        inference = bool(pid[12]) if len(pid) > 12 else False  # older checkpoints: not recorded
        known = self._tensors.get(index)
        if known is not None:
            return known
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
        if grad_pid is not None:
            tensor.grad = self._load_tensor(grad_pid)
        self._tensors[index] = tensor
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
    """Why ``value`` alone cannot be pickled, or None if it can (tensors are not written)."""
    dry = BlobWriter(blobs.folder, blobs.cache, dry=True)
    try:
        NamespacePickler(NullSink(), dry, user_ns).dump({name: value})
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"[:300]
    return None
