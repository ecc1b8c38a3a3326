"""The pickler of checkpoints: cloudpickle with protocol 5, tensors and large buffers out of band."""

from __future__ import annotations

import functools
import io
import pickle
import types
import warnings
from collections.abc import Callable
from typing import Any

import cloudpickle

from jupyter_gpufrac.kernel.blobs import BlobWriter
from jupyter_gpufrac.kernel.kinds import (
    MUTABLE,
    keeps_grad,
    shareable,
    storable,
    storage_classes,
    tensor_classes,
)
from jupyter_gpufrac.kernel.module_objects import MODULE_OBJECT_TAG, MODULE_OBJECTS, module_object
from jupyter_gpufrac.kernel.pickling import _module_object_ref, _storage_ref, _tensor_ref, _user_ns_ref

# Buffers at least this large are written out of band, as content-addressed blobs.
BUFFER_MIN = 256 * 1024


class NamespaceMarker(dict):
    """Stands for the notebook's namespace as the globals of cell functions in a pickle."""


def _bare_storage(obj: Any, untyped: type) -> tuple[Any, str | None]:
    """(untyped storage, dtype name or None) of a storage object."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TypedStorage is deprecated, not our user's doing
        if type(obj) is untyped:
            return obj, None
        return obj.untyped(), str(obj.dtype)


class NamespacePicklerBase(cloudpickle.Pickler):
    """cloudpickle, protocol 5, with cell functions bound to ``user_ns`` rather than copies of it.

    cloudpickle rebuilds functions sharing one ``__globals__`` with one new dict, found in
    ``globals_ref``; pre-seeding it with a marker lets the namespace itself be named, so restored
    cell functions see later assignments, as they did before.
    """

    def __init__(self, file: Any, user_ns: dict[str, Any],
                 buffer_callback: Callable[[pickle.PickleBuffer], bool] | None = None) -> None:
        super().__init__(file, protocol=5, buffer_callback=buffer_callback)
        self._user_ns = user_ns
        self.globals_ref[id(user_ns)] = NamespaceMarker(__name__="__main__")

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


class NamespacePickler(NamespacePicklerBase):
    """Pickles a group of variables: tensors and bare storages become references to their blobs,
    large buffers (NumPy arrays, pandas columns) are written out of band as content-addressed
    blobs, cell functions keep the live globals, and an object an imported module holds under a
    name (``scipy.stats.norm``, ``logging.root``, ``sys.stdout``) is pickled as that name (see
    :class:`module_objects.ModuleObjects`): a restore finds the module's own object again.
    """

    def __init__(self, file: Any, blobs: BlobWriter, user_ns: dict[str, Any]) -> None:
        # Not a bound method: the pickler would then be a cycle, and its memo, which holds
        # every object pickled, would keep a tensor the user `del`s alive until the garbage
        # collector runs.
        super().__init__(file, user_ns, buffer_callback=functools.partial(_out_of_band, blobs))
        self._blobs = blobs
        self._tensor_types = tensor_classes()
        self._storage_types = storage_classes()
        self._module_objects = MODULE_OBJECTS.current()

    def dump(self, obj: Any) -> None:
        # A list, dict or set is never shown to reducer_override: one that a module holds is
        # named by a persistent id, asked of every object pickled, which doubles the time
        # pickling lists of records takes. So only a group with a variable holding one
        # (``path = sys.path``) asks it; there, it is named wherever the group holds it
        # (variables that share it are in its group). Held only inside other values, such
        # a container stays a copy.
        index = self._module_objects
        if type(obj) is dict and any(type(value) in MUTABLE and id(value) in index
                                     for value in obj.values()):
            self.persistent_id = self._module_container
        super().dump(obj)

    def _module_container(self, obj: Any) -> Any:
        if type(obj) in MUTABLE and (named := module_object(obj, self._module_objects)):
            return (MODULE_OBJECT_TAG, *named)
        return None

    def reducer_override(self, obj: Any) -> Any:
        if id(obj) in self._module_objects and (named := module_object(obj, self._module_objects)):
            return (_module_object_ref, named)
        cls = type(obj)
        if cls in self._tensor_types and storable(obj):
            blob, nbytes, device = self._blobs.record_for(obj)
            return (_tensor_ref, (
                blob, nbytes, device, int(obj.storage_offset()), tuple(obj.size()),
                tuple(obj.stride()), str(obj.dtype).removeprefix("torch."),
                bool(obj.requires_grad), cls is not self._tensor_types[0], keeps_grad(obj),
                bool(obj.is_inference()),
            ))
        if cls in self._storage_types:
            storage, dtype = _bare_storage(obj, self._storage_types[0])
            if storage.device.type in ("cpu", "cuda"):
                blob, nbytes, device = self._blobs.storage_record(storage)
                return (_storage_ref, (blob, nbytes, device, dtype))
        if cls is NamespaceMarker:
            return (_user_ns_ref, ())
        return super().reducer_override(obj)


    def shared_ids(self) -> set[int]:
        """Ids of the objects this pickler met that another variable could share by reference."""
        return {id(obj) for _, obj in self.memo.copy().values() if shareable(obj)}


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
