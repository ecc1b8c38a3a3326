"""Property tests: any sequence of changes to a namespace, checkpointed incrementally along the way,
restores to the namespace as it is: the same values, and the same objects shared the same way."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import numpy
import pandas
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from jupyter_gpufrac.kernel.checkpoint import Checkpointer

NAMES = ["a", "b", "c", "d", "e", "f", "g"]
KINDS = ["list", "dict", "small array", "large array", "tensor", "object", "frame", "number"]
LARGE = 40_000  # float64: out of band, in a blob of its own


class Box:
    """An object with state of its own, as a notebook's classes make them."""

    def __init__(self, seed: int) -> None:
        self.value = seed
        self.items = [seed]


def make(kind: str, seed: int) -> Any:
    if kind == "list":
        return [seed, [seed]]
    if kind == "dict":
        return {"n": seed, "inner": [seed]}
    if kind == "small array":
        return numpy.full(8, float(seed))
    if kind == "large array":
        return numpy.full(LARGE, float(seed))
    if kind == "tensor":
        return torch.full((16,), float(seed))
    if kind == "object":
        return Box(seed)
    if kind == "frame":
        return pandas.DataFrame({"n": numpy.arange(LARGE) + seed, "x": numpy.full(LARGE, 0.5)})
    return seed


def containers(ns: dict[str, Any]) -> list[Any]:
    """Every list, dict and Box reachable from the namespace, in a fixed order."""
    found: list[Any] = []
    seen: set[int] = set()

    def walk(obj: Any) -> None:
        if isinstance(obj, list | dict | Box) and id(obj) not in seen:
            seen.add(id(obj))
            found.append(obj)
            if isinstance(obj, Box):
                walk(obj.items)
                return
            for child in obj if isinstance(obj, list) else obj.values():
                walk(child)

    for name in sorted(ns):
        walk(ns[name])
    return found


def leaves(ns: dict[str, Any]) -> list[Any]:
    """Arrays, tensors and frames reachable from the namespace."""
    kinds = numpy.ndarray | torch.Tensor | pandas.DataFrame
    inside = [v for c in containers(ns) if not isinstance(c, Box)
              for v in (c if isinstance(c, list) else c.values()) if isinstance(v, kinds)]
    return inside + [v for v in ns.values() if isinstance(v, kinds)]


def apply(ns: dict[str, Any], op: tuple[Any, ...]) -> None:
    """One change a notebook cell might make; ops that do not fit the namespace do nothing."""
    kind, a, b, seed = op
    other = NAMES[b % len(NAMES)]
    boxes = containers(ns)
    arrays = leaves(ns)
    if kind == "new":
        ns[NAMES[a]] = make(KINDS[b], seed)
    elif kind == "delete":
        ns.pop(NAMES[a], None)
    elif kind == "rebind" and other in ns:
        ns[NAMES[a]] = ns[other]
    elif kind == "append" and boxes:
        box = boxes[a % len(boxes)]
        if isinstance(box, list):
            box.append(seed)
        elif isinstance(box, Box):
            box.value = seed
        else:
            box[f"k{seed % 3}"] = seed
    elif kind == "share" and boxes and other in ns:
        box = boxes[a % len(boxes)]
        # Sharing an object, possibly making a cycle: both must come back the same way.
        if isinstance(box, list):
            box.append(ns[other])
        elif isinstance(box, Box):
            box.items = ns[other]
        else:
            box["ref"] = ns[other]
    elif kind == "copy" and boxes:
        # An equal object where the shared one was: same values, one object fewer shared.
        box = boxes[a % len(boxes)]
        if isinstance(box, Box):
            box.items = list(box.items) if isinstance(box.items, list) else box.items
            return
        key = (len(box) - 1) if isinstance(box, list) else next(iter(box), None)
        if key is not None and key != -1 and isinstance(box[key], list | dict):
            box[key] = box[key].copy()
    elif kind == "write" and arrays:
        target = arrays[a % len(arrays)]
        if isinstance(target, pandas.DataFrame):
            target.loc[seed % len(target), "x"] = -seed
        else:
            target[seed % target.shape[0]] = -seed
    elif kind == "bump" and arrays:
        target = arrays[a % len(arrays)]
        if isinstance(target, pandas.DataFrame):
            target["n"] += 1
        else:
            target += 1


def canonical(ns: dict[str, Any]) -> list[Any]:
    """The namespace as values with identities numbered in a fixed walk: equal for two namespaces
    exactly when they hold equal values shared the same way."""
    number: dict[int, int] = {}

    def walk(obj: Any) -> Any:
        if not isinstance(obj, list | dict | numpy.ndarray | torch.Tensor | Box | pandas.DataFrame):
            return ("atom", obj)
        if id(obj) in number:
            return ("same as", number[id(obj)])
        number[id(obj)] = len(number)
        if isinstance(obj, list):
            return ("list", [walk(x) for x in obj])
        if isinstance(obj, dict):
            return ("dict", [(k, walk(v)) for k, v in obj.items()])
        if isinstance(obj, numpy.ndarray):
            return ("array", obj.dtype.str, obj.shape, obj.tobytes())
        if isinstance(obj, Box):
            return ("box", walk(obj.value), walk(obj.items))
        if isinstance(obj, pandas.DataFrame):
            return ("frame", obj.to_numpy().tobytes(), list(obj.columns))
        return ("tensor", obj.tolist())

    return [(name, walk(ns[name])) for name in sorted(ns)]


ops = st.tuples(
    st.sampled_from(["new", "delete", "rebind", "append", "share", "copy", "write", "bump",
                     "checkpoint"]),
    st.integers(0, len(NAMES) - 1), st.integers(0, len(KINDS) - 1), st.integers(0, 1000),
)


@settings(max_examples=50, deadline=None)
@given(st.lists(ops, min_size=1, max_size=25))
def test_any_changes_checkpointed_on_the_way_restore_to_the_namespace(
    sequence: list[tuple[Any, ...]],
) -> None:
    ns: dict[str, Any] = {name: make(KINDS[i], i) for i, name in enumerate(NAMES)}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "ck"
        ck = Checkpointer(root)
        ck.take(ns)
        for op in sequence:
            if op[0] == "checkpoint":
                ck.take(ns)
            else:
                apply(ns, op)
        ck.take(ns)
        assert ck.take(ns).groups_written == 0, "a second checkpoint found nothing new"
        fresh: dict[str, Any] = {}
        loaded = Checkpointer(root).load(fresh)
    assert loaded.lost == {}
    assert canonical(fresh) == canonical(ns)
