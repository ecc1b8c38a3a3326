"""Change detection: each variable's fingerprint, a pickle that says whether it changed and what it shares."""

from __future__ import annotations

import collections
import gc
import io
import itertools
import pickle
import sys
import types
import zlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import cloudpickle

from jupyter_gpufrac.kernel import tensor_io
from jupyter_gpufrac.kernel.blobs import BlobWriter, PandasGuard
from jupyter_gpufrac.kernel.kinds import (
    ATOMS,
    MUTABLE,
    keeps_grad,
    pickled_by_value,
    shareable_kind,
    storable,
    storage_classes,
    tensor_classes,
)
from jupyter_gpufrac.kernel.module_objects import MODULE_OBJECTS, module_object
from jupyter_gpufrac.kernel.pickler import NamespaceMarker, NamespacePicklerBase
from jupyter_gpufrac.kernel.pickling import _fp

# Arrays at least this large are fingerprinted by a hash of their bytes rather than the bytes.
_DIGEST_MIN = 4096
# Fingerprints longer than this are kept as a hash.
_FINGERPRINT_KEPT = 64 * 1024
_MEMO_REUSED = 512  # a fingerprint pickler whose memo grew past this is replaced
_BATCH_SPREAD = 64  # variables of built-in objects are fingerprinted about this many at once
_DIRTY = itertools.count()  # tokens that never compare equal: "always pickled again"


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
    """Fingerprints the variables of one checkpoint.

    A variable's fingerprint is a pickle of it in which tensors stand as their storage blob
    (reused while their version counter says unchanged), large arrays as a hash of their bytes,
    pandas arrays protected by copy-on-write as their identity, the notebook's classes as a hash
    of their own fingerprint, empty OrderedDicts as a mark beside their identity, and an object
    an imported module holds under a name as that name (see :class:`module_objects.ModuleObjects`); a variable
    whose fingerprint did not change is not pickled again.

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
        self.module_objects = MODULE_OBJECTS.current()
        self._tensor_types = tensor_classes()
        self._storage_types = storage_classes()
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
        found = {index: key for key, (index, obj) in memo.items() if type(obj) in MUTABLE}
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
        if cls is NamespaceMarker:
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
        """:func:`pickled_by_value`, once per class or function and checkpoint: it is asked for each
        one every fingerprint meets."""
        known = self._by_value.get(id(obj))
        if known is None or known[0] is not obj:
            known = self._by_value[id(obj)] = (obj, pickled_by_value(obj))
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
            if not storable(tensor):
                return NotImplemented  # torch's own reduction, through its storages
            blob, _nbytes = self.blobs.storage_blob(tensor)
            # Few objects per token: every object in a fingerprint costs (see _lasting_ids).
            meta = (f"{blob} {tensor.get_device()} {tensor.storage_offset()} "
                    f"{tuple(tensor.size())} {tensor.stride()} {tensor.dtype} "
                    f"{tensor.requires_grad} {type(tensor).__name__} {tensor.is_inference()}")
            cache.remember_token(tensor, storage, meta)
        grad = keeps_grad(tensor)
        return (_fp, (), meta if grad is None else (meta, grad))

    def _array(self, array: Any) -> Any:
        if self.guard is not None and self.guard.protects(array):
            return (_fp, ("frozen", id(array)))
        if array.dtype.hasobject or array.nbytes < _DIGEST_MIN:
            return NotImplemented  # pickled as it is: elements, or few bytes
        order = "C" if array.flags.c_contiguous or not array.flags.f_contiguous else "F"
        return (_fp, ("array", array.dtype.str, array.shape, order,
                      self.blobs.array_blob(array)))

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


class _Fingerprinter(NamespacePicklerBase):
    """The pickler of fingerprints: cloudpickle's reductions, with the session's tokens."""

    def __init__(self, file: Any, session: FingerprintSession) -> None:
        self.dispatch_table = session.dispatch_table
        super().__init__(file, session.user_ns)
        self._handlers = session.handlers
        self._module_objects = session.module_objects
        self.reductions = 0  # objects that were not built-in containers or atoms

    def reducer_override(self, obj: Any) -> Any:
        self.reductions += 1
        if id(obj) in self._module_objects and (named := module_object(obj, self._module_objects)):
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
    caches :func:`shareable_kind` for the checkpoint, ``by_value`` answers :func:`pickled_by_value`.
    """
    probe: list[Any] = []  # made here, held by the memo alone: the count of such an object
    memo[id(probe)] = (-1, probe)
    del probe
    # Strings and numbers refer to nothing and are never shared: left out from the start.
    extra = {key: sys.getrefcount(obj) for key, (_, obj) in memo.items()
             if type(obj) not in ATOMS}
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
        kind = kinds[cls] if cls in kinds else kinds.setdefault(cls, shareable_kind(cls, obj))
        if kind or (kind is None and by_value(obj)):
            found[index] = key
    return _in_order(found)


def _in_order(by_index: dict[int, int]) -> tuple[int, ...]:
    """The ids of a memo's objects in pickling order (a memo's copy is in no order; numbers
    sort faster than pairs)."""
    return tuple(map(by_index.__getitem__, sorted(by_index)))


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
        found += itertools.compress(new, map(MUTABLE.__contains__, map(type, objects)))
        level = gc.get_referents(*objects)
    return tuple(found)
