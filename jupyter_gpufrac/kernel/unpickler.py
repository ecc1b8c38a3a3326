"""The unpickler of restores: tensors rebuilt from their blobs, cell functions bound to the namespace."""

from __future__ import annotations

import pickle
import warnings
from collections.abc import Callable, Iterable
from typing import Any

from jupyter_gpufrac.kernel import pickling, torch_adapter
from jupyter_gpufrac.kernel.module_objects import MODULE_OBJECT_TAG, load_module_object
from jupyter_gpufrac.kernel.pickling import _module_object_ref, _storage_ref, _tensor_ref, _user_ns_ref

# The callables of ours a pickle may name (see :mod:`pickling`).
_REFS = frozenset({_tensor_ref.__name__, _storage_ref.__name__, _user_ns_ref.__name__,
                   _module_object_ref.__name__})


# Format 2 named tensors, bare storages and the namespace by persistent ids with these tags.
_V2_TENSOR = "gpufrac.tensor"
_V2_STORAGE = "gpufrac.storage"
_V2_USER_NS = ("gpufrac.user_ns",)


class NamespaceUnpickler(pickle.Unpickler):
    """Rebuilds tensors from blobs on the kernel's device and binds functions to ``user_ns``.

    ``storages`` may be shared by the unpicklers of one restore, so tensors of different
    groups that viewed one storage still share it. ``device`` None means the kernel's device.
    ``buffers`` are the group's out-of-band buffers, in order. Pickles of format 2 (persistent
    ids, see :meth:`persistent_load`) load as well.
    ``fetch(blob, nbytes, target)`` returns the storage of ``blob`` read onto ``target`` (a
    device or ``cpu``; see :class:`restore._ReadAhead`).
    """

    def __init__(
        self, file: Any, user_ns: dict[str, Any], device: str | None,
        fetch: Callable[[str, int, str], Any],
        on_tensor: Callable[[Any, str], None] | None = None,
        storages: dict[tuple[str, str], Any] | None = None,
        buffers: Iterable[Any] = (),
    ) -> None:
        super().__init__(file, buffers=buffers)
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
        if isinstance(pid, tuple) and len(pid) == 5 and pid[0] == MODULE_OBJECT_TAG:
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
        if module == pickling.__name__ and name in _REFS:
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
            storage = self._fetch(blob, nbytes, target)
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
