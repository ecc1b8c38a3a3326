"""Move the notebook's GPU tensors, modules and optimizer state to host memory and back."""

from __future__ import annotations

import functools
import re
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from jupyter_gpufrac.kernel.namespace import is_ipython_name

Predicate = Callable[[Any], bool]

# Containers nest deeper than this only in odd data structures; past it we leave them be
# rather than risk Python's recursion limit.
_MAX_DEPTH = 32


def _on_cuda(tensor: Any) -> bool:
    return bool(tensor.device.type == "cuda")


@dataclass
class Offloaded:
    """One top-level name that was moved to the host, and where it came from."""

    name: str
    kind: str  # tensor | module | optimizer | container | output cache
    device: str
    nbytes: int
    obj_id: int


def _tensor_bytes(tensor: Any) -> int:
    return int(tensor.numel() * tensor.element_size())


def _optimizer_tensors(opt: Any) -> list[tuple[dict[str, Any], str, Any]]:
    found = []
    for state in opt.state.values():
        if isinstance(state, dict):
            for key, value in state.items():
                if _is_tensor(value):
                    found.append((state, key, value))
    return found


def _stays_on_host(opt: Any) -> set[int]:
    """ids of state tensors PyTorch keeps on the CPU: ``step`` unless capturable or fused.

    Offload moves a GPU ``step`` (capturable, fused) too, so reload must not move a CPU one.
    """
    ids: set[int] = set()
    for group in getattr(opt, "param_groups", []):
        if group.get("capturable") or group.get("fused"):
            continue
        for param in group.get("params", []):
            state = opt.state.get(param)
            if isinstance(state, dict) and _is_tensor(state.get("step")):
                ids.add(id(state["step"]))
    return ids


def _not_on(device: str, tensor: Any) -> bool:
    return str(tensor.device) != device


def _is_tensor(value: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


_OUTPUT_CACHE = re.compile(r"^(_{1,3}|_\d+)$")


class _Mover:
    """Moves each tensor once, so every reference to one tensor gets the same single copy.

    One mover serves a whole offload or reload: a tensor bound to a name, kept in a list and
    in an optimizer's state comes back as one object everywhere. A tuple is rebuilt once too,
    so two references to one tuple stay one tuple. With ``dry`` nothing moves: ``reached``
    only collects what would (reload sizes records that share tensors together with it).
    """

    def __init__(self, device: str, wanted: Predicate, *, dry: bool = False) -> None:
        self.device = device
        self.wanted = wanted
        self.dry = dry
        self.reached: dict[int, Any] = {}  # tensors the current walk found to move, by id
        self._copies: dict[int, Any] = {}  # id of a tensor or tuple -> its replacement
        self._inside: dict[int, dict[int, Any]] = {}  # id of a container walked -> its tensors
        self._keep: list[Any] = []  # originals stay alive, so their ids are not reused meanwhile

    def tensor(self, value: Any) -> Any:
        key = id(value)
        self.reached[key] = value
        if self.dry:
            return value
        if key not in self._copies:
            copy = value.detach().to(self.device).requires_grad_(value.requires_grad)
            self._copies[key] = copy
            self._keep.append(value)
        return self._copies[key]

    def value(self, value: Any, depth: int = 0) -> Any:
        """``value`` with its tensors moved: lists and dicts change in place (other references
        see the move), a tuple holding a moved tensor is replaced by a new one."""
        if _is_tensor(value):
            return self.tensor(value) if self.wanted(value) else value
        if depth > _MAX_DEPTH or not isinstance(value, list | dict | tuple):
            return value
        key = id(value)
        if key in self._inside:
            # Walked already through another reference: what it holds counts for this one too,
            # or a name reaching it would not be recorded and would not come back.
            self.reached.update(self._inside[key])
            return self._copies.get(key, value)
        outer, self.reached = self.reached, {}
        self._inside[key] = self.reached  # before the items: a list that holds itself ends here
        self._keep.append(value)
        try:
            return self._replace(value, depth)
        finally:
            outer.update(self.reached)
            self.reached = outer

    def _replace(self, value: Any, depth: int) -> Any:
        if isinstance(value, list | dict):
            pairs = enumerate(list(value)) if isinstance(value, list) else list(value.items())
            for index, item in pairs:
                new = self.value(item, depth + 1)
                if new is not item:
                    value[index] = new
            return value
        if type(value) is not tuple and not hasattr(value, "_make"):
            return value  # a tuple subclass we cannot rebuild (torch.Size, return types)
        # A tuple that holds itself through a list keeps the old one in there: Python cannot
        # build that cycle anew, and such data is rare enough to leave.
        items = [self.value(item, depth + 1) for item in value]
        if all(new is old for new, old in zip(items, value, strict=True)):
            return value
        if type(value) is tuple:
            rebuilt: tuple[Any, ...] = tuple(items)
        else:  # a namedtuple: its own constructor takes fields, not one iterable
            rebuilt = type(value)._make(items)
        self._copies[id(value)] = rebuilt
        return rebuilt

    def walk(self, value: Any) -> tuple[Any, int, str | None]:
        """(value with its tensors moved, bytes of the tensors it reaches that moved, where
        the first of them was)."""
        self.reached = {}
        new = self.value(value)
        found = list(self.reached.values())
        return new, sum(_tensor_bytes(t) for t in found), str(found[0].device) if found else None


def offload(
    ns: dict[str, Any], host: str = "cpu", on_gpu: Predicate = _on_cuda
) -> list[Offloaded]:
    """Move the GPU tensors the notebook holds in ``ns`` to ``host``.

    Modules move in place, so the optimizer still holds the same parameters; tensors bound to
    names, held in (nested) lists, dicts and tuples bound to names, and kept by IPython's output
    cache (``Out``, ``_``, ``_7``) move too: a tensor displayed once would otherwise keep its GPU
    memory for the rest of the session. Aliases of one tensor stay one tensor.
    """
    torch = sys.modules.get("torch")
    if torch is None:
        return []
    mover = _Mover(host, on_gpu)
    moved: list[Offloaded] = []
    # Modules and optimizers first: a tensor name bound to a parameter then finds it moved.
    for name, value in list(ns.items()):
        if name.startswith("_"):
            continue
        if isinstance(value, torch.nn.Module):
            params = [p for p in value.parameters() if on_gpu(p)]
            if params:
                device = str(params[0].device)
                nbytes = sum(_tensor_bytes(p) for p in params)
                value.to(host)
                moved.append(Offloaded(name, "module", device, nbytes, id(value)))
        elif isinstance(value, torch.optim.Optimizer):
            entries = [e for e in _optimizer_tensors(value) if on_gpu(e[2])]
            if entries:
                device = str(entries[0][2].device)
                for state, key, tensor in entries:
                    state[key] = mover.tensor(tensor)
                nbytes = sum(_tensor_bytes(e[2]) for e in entries)
                moved.append(Offloaded(name, "optimizer", device, nbytes, id(value)))
    for name, value in list(ns.items()):
        if name.startswith("_") or is_ipython_name(name):
            continue
        if isinstance(value, torch.Tensor):
            if on_gpu(value):
                copy = ns[name] = mover.tensor(value)
                moved.append(Offloaded(name, "tensor", str(value.device), _tensor_bytes(value),
                                       id(copy)))
            continue
        new, nbytes, where = mover.walk(value)
        if nbytes:
            ns[name] = new
            moved.append(Offloaded(name, "container", where or "cuda", nbytes, id(new)))
    cache_bytes, cache_device = 0, None
    counted: set[int] = set()
    out = ns.get("Out")
    cached = [(ns, name) for name in ns if _OUTPUT_CACHE.match(name)]
    if isinstance(out, dict):
        cached += [(out, key) for key in out]
    for holder, key in cached:
        value = holder[key]
        if _is_tensor(value) and on_gpu(value):
            if id(value) not in counted:  # one tensor shown as _, _4 and Out[4] counts once
                counted.add(id(value))
                cache_device = cache_device or str(value.device)
                cache_bytes += _tensor_bytes(value)
            holder[key] = mover.tensor(value)
    if cache_bytes:
        # Shown outputs are history: they stay on the host, `%gpu reload` leaves them there.
        moved.append(Offloaded("Out", "output cache", cache_device or "cuda", cache_bytes,
                               id(out)))
    return moved


def _away(ns: dict[str, Any], record: Offloaded, mover: _Mover) -> dict[int, Any]:
    """The tensors reload would move back for ``record``, by id (modules: none; they move in
    place and share nothing with the other records)."""
    value = ns[record.name]
    mover.reached = {}
    if record.kind == "optimizer":
        stay = _stays_on_host(value)
        for _state, _key, tensor in _optimizer_tensors(value):
            if id(tensor) not in stay and mover.wanted(tensor):
                mover.tensor(tensor)
    elif record.kind in ("container", "tensor"):
        mover.value(value)
    return dict(mover.reached)


def _groups(ns: dict[str, Any], records: list[Offloaded]) -> Iterator[list[Offloaded]]:
    """Records in their order, those that share a tensor together: they come back at once or
    not at all, or the tensor they share would come back as two objects."""
    reach = {}
    for index, record in enumerate(records):
        dry = _Mover(record.device, functools.partial(_not_on, record.device), dry=True)
        reach[index] = set(_away(ns, record, dry)) if record.kind != "output cache" else set()
    placed: set[int] = set()
    for start in range(len(records)):
        if start in placed:
            continue
        group, ids = [start], set(reach[start])
        grew = True
        while grew:  # records reaching a tensor the group reaches join it, transitively
            grew = False
            for other in range(start + 1, len(records)):
                if other not in group and other not in placed and reach[other] & ids:
                    group.append(other)
                    ids |= reach[other]
                    grew = True
        placed.update(group)
        yield [records[i] for i in sorted(group)]


def reload(
    ns: dict[str, Any], records: list[Offloaded], budget: int | None
) -> tuple[list[Offloaded], list[Offloaded]]:
    """Move offloaded names back while they fit in ``budget`` bytes; returns (back, still away).

    A name the user has since rebound is forgotten: it is no longer the object we moved. One
    tensor several names reach comes back as one object: those names come back together.
    """
    torch = sys.modules.get("torch")
    if torch is None:
        return [], []
    back: list[Offloaded] = []
    left: list[Offloaded] = []
    room = budget
    current = [r for r in records if ns.get(r.name) is not None and id(ns[r.name]) == r.obj_id]
    movers: dict[str, _Mover] = {}
    for group in _groups(ns, current):
        if group[0].kind == "output cache":
            # Shown outputs stay on the host: forgotten once they would fit.
            if room is not None and group[0].nbytes > room:
                left.append(group[0])
            continue
        # Records that share a tensor both count it: the estimate errs on the side of room.
        nbytes = sum(r.nbytes for r in group)
        if room is not None and nbytes > room:
            left.extend(group)
            continue
        for record in group:
            mover = movers.setdefault(
                record.device, _Mover(record.device, functools.partial(_not_on, record.device)))
            value = ns[record.name]
            if record.kind == "module":
                value.to(record.device)
            elif record.kind == "optimizer":
                stay = _stays_on_host(value)
                for state, key, tensor in _optimizer_tensors(value):
                    if id(tensor) not in stay and mover.wanted(tensor):
                        state[key] = mover.tensor(tensor)
            else:
                value = ns[record.name] = mover.value(value)
                record = Offloaded(record.name, record.kind, record.device, record.nbytes,
                                   id(value))
            back.append(record)
        if room is not None:
            room -= nbytes
    return back, left
