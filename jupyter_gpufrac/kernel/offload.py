"""Move the notebook's GPU tensors, modules and optimizer state to host memory and back."""

from __future__ import annotations

import functools
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from jupyter_gpufrac.kernel.namespace import is_ipython_name

Predicate = Callable[[Any], bool]


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


def _not_on(device: str, tensor: Any) -> bool:
    return str(tensor.device) != device


def _is_tensor(value: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


_OUTPUT_CACHE = re.compile(r"^(_{1,3}|_\d+)$")


class _Mover:
    """Moves tensors to the host once each, so names that alias one tensor keep aliasing it."""

    def __init__(self, host: str, on_gpu: Predicate) -> None:
        self.host = host
        self.on_gpu = on_gpu
        self._copies: dict[int, Any] = {}
        self._keep: list[Any] = []  # originals stay alive, so their ids are not reused meanwhile

    def tensor(self, value: Any) -> Any:
        key = id(value)
        if key not in self._copies:
            self._copies[key] = value.detach().to(self.host).requires_grad_(value.requires_grad)
            self._keep.append(value)
        return self._copies[key]

    def container(self, value: Any) -> tuple[Any, int, str | None]:
        """(value with its GPU tensors moved, bytes moved, their device); one level deep."""
        if isinstance(value, list):
            items = list(enumerate(value))
        elif isinstance(value, dict):
            items = list(value.items())
        elif isinstance(value, tuple) and type(value) is tuple:
            items = list(enumerate(value))
        else:
            return value, 0, None
        moved, device = 0, None
        replaced = {}
        for key, item in items:
            if _is_tensor(item) and self.on_gpu(item):
                device = device or str(item.device)
                moved += _tensor_bytes(item)
                replaced[key] = self.tensor(item)
        if not replaced:
            return value, 0, None
        if isinstance(value, tuple):
            return tuple(replaced.get(i, item) for i, item in items), moved, device
        for key, item in replaced.items():
            value[key] = item  # lists and dicts in place: other references see the move too
        return value, moved, device


def offload(
    ns: dict[str, Any], host: str = "cpu", on_gpu: Predicate = _on_cuda
) -> list[Offloaded]:
    """Move the GPU tensors the notebook holds in ``ns`` to ``host``.

    Modules move in place, so the optimizer still holds the same parameters; tensors bound to
    names, held in lists, dicts and tuples bound to names, and kept by IPython's output cache
    (``Out``, ``_``, ``_7``) move too: a tensor displayed once would otherwise keep its GPU
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
        new, nbytes, where = mover.container(value)
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


def reload(
    ns: dict[str, Any], records: list[Offloaded], budget: int | None
) -> tuple[list[Offloaded], list[Offloaded]]:
    """Move offloaded names back while they fit in ``budget`` bytes; returns (back, still away).

    A name the user has since rebound is forgotten: it is no longer the object we moved.
    """
    torch = sys.modules.get("torch")
    if torch is None:
        return [], []
    back: list[Offloaded] = []
    left: list[Offloaded] = []
    room = budget
    for record in records:
        value = ns.get(record.name)
        if value is None or id(value) != record.obj_id:
            continue
        if room is not None and record.nbytes > room:
            left.append(record)
            continue
        if record.kind == "output cache":
            continue
        if record.kind == "module":
            value.to(record.device)
        elif record.kind == "optimizer":
            for state, key, tensor in _optimizer_tensors(value):
                state[key] = tensor.to(record.device)
        elif record.kind == "container":
            back_mover = _Mover(record.device, functools.partial(_not_on, record.device))
            value, _, _ = back_mover.container(value)
            ns[record.name] = value
            record = Offloaded(record.name, record.kind, record.device, record.nbytes, id(value))
        else:
            copy = value.detach().to(record.device).requires_grad_(value.requires_grad)
            ns[record.name] = copy
            record = Offloaded(record.name, record.kind, record.device, record.nbytes, id(copy))
        back.append(record)
        if room is not None:
            room -= record.nbytes
    return back, left
