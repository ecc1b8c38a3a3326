"""Move the notebook's GPU tensors, modules and optimizer state to host memory and back."""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

Predicate = Callable[[Any], bool]


def _on_cuda(tensor: Any) -> bool:
    return bool(tensor.device.type == "cuda")


@dataclass
class Offloaded:
    """One top-level name that was moved to the host, and where it came from."""

    name: str
    kind: str  # tensor | module | optimizer
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


def _is_tensor(value: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


def offload(
    ns: dict[str, Any], host: str = "cpu", on_gpu: Predicate = _on_cuda
) -> list[Offloaded]:
    """Move top-level GPU tensors, modules and optimizer state in ``ns`` to ``host``.

    Modules move in place, so the optimizer still holds the same parameters; tensors nested in
    lists or dicts are not visited (a tensor bound to a name is what notebooks hold).
    """
    torch = sys.modules.get("torch")
    if torch is None:
        return []
    moved: list[Offloaded] = []
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
                    state[key] = tensor.to(host)
                nbytes = sum(_tensor_bytes(e[2]) for e in entries)
                moved.append(Offloaded(name, "optimizer", device, nbytes, id(value)))
        elif isinstance(value, torch.Tensor) and on_gpu(value):
            copy = value.detach().to(host).requires_grad_(value.requires_grad)
            ns[name] = copy
            moved.append(Offloaded(name, "tensor", str(value.device), _tensor_bytes(value),
                                   id(copy)))
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
        if record.kind == "module":
            value.to(record.device)
        elif record.kind == "optimizer":
            for state, key, tensor in _optimizer_tensors(value):
                state[key] = tensor.to(record.device)
        else:
            copy = value.detach().to(record.device).requires_grad_(value.requires_grad)
            ns[record.name] = copy
            record = Offloaded(record.name, record.kind, record.device, record.nbytes, id(copy))
        back.append(record)
        if room is not None:
            room -= record.nbytes
    return back, left
