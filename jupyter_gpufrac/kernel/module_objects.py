"""Objects an imported module holds under a name: pickled as that name, found again at a restore."""

from __future__ import annotations

import importlib
import pickle
import sys
import threading
import types
from collections.abc import Collection, Mapping
from typing import Any

import cloudpickle

from jupyter_gpufrac.kernel.kinds import storage_classes, tensor_classes

# A list, dict or set a module holds, as a persistent id (pickle asks no reducer_override for
# those): (tag, module, name, class module, class qualified name).
MODULE_OBJECT_TAG = "gpufrac.module_object"


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
        tensors = tensor_classes() + storage_classes()
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


MODULE_OBJECTS = ModuleObjects()


def module_object(obj: Any, index: Mapping[int, tuple[str, str]]) -> tuple[str, str, str, str] | None:
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
