"""The kinds of objects pickling tells apart: tensors, storages, containers, atoms, the shareable."""

from __future__ import annotations

import enum
import sys
import types
from typing import Any

import cloudpickle


def tensor_classes() -> tuple[type, ...]:
    """torch's tensor classes, once the notebook imported torch (we never import it here)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return ()
    return (torch.Tensor, torch.nn.Parameter)


def storage_classes() -> tuple[type, ...]:
    """torch's storage classes, once the notebook imported torch."""
    torch = sys.modules.get("torch")
    if torch is None:
        return ()
    return (torch.UntypedStorage, torch.TypedStorage)


def storable(obj: Any) -> bool:
    """Whether a tensor is one dense block of a storage on the host or a CUDA device."""
    return bool(
        obj.layout is sys.modules["torch"].strided
        and (obj.is_cpu or obj.is_cuda)
        and not obj.is_quantized
        and not obj.is_nested
        and not obj.is_neg()
        and not obj.is_conj()
    )


def keeps_grad(tensor: Any) -> Any:
    """The gradient a pickle of ``tensor`` carries, or None."""
    if tensor.requires_grad and (tensor.is_leaf or tensor.retains_grad):
        return tensor.grad
    return None


MUTABLE = frozenset({list, dict, set, bytearray})
ATOMS = frozenset({str, bytes, int, float, complex, bool, type(None)})
_IMMUTABLE = ATOMS | {tuple, frozenset}


def shareable(obj: Any) -> bool:
    """Whether two variables holding ``obj`` must keep holding one object after a restore.

    Mutable containers, arrays, objects with state of their own and what is pickled by value
    (classes and functions of the notebook) count; what is pickled by reference or immutable
    (strings, numbers, importable classes and functions, modules) is the same everywhere anyway.
    """
    kind = shareable_kind(type(obj), obj)
    return kind if kind is not None else pickled_by_value(obj)


def shareable_kind(cls: type, obj: Any) -> bool | None:
    """:func:`shareable` for every instance of ``cls`` (``obj`` is one), or None when it
    depends on the object (classes and functions)."""
    if cls in MUTABLE:
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


def pickled_by_value(obj: type | types.FunctionType) -> bool:
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
