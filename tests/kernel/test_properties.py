"""Property tests: namespaces with shared references round-trip through a checkpoint."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from jupyter_gpufrac.kernel.checkpoint import Checkpointer

leaves = st.one_of(
    st.integers(), st.floats(allow_nan=False), st.text(max_size=5), st.none(),
    st.lists(st.integers(-(2**62), 2**62), max_size=4).map(
        lambda xs: torch.tensor(xs, dtype=torch.int64)
    ),
)


@st.composite
def namespaces(draw: st.DrawFn) -> tuple[dict[str, Any], list[tuple[str, str]]]:
    """A namespace of containers and tensors where some names alias one object."""
    pool = draw(st.lists(st.one_of(leaves, st.lists(leaves, max_size=3)), min_size=1,
                         max_size=6))
    shared = [[x] for x in pool]  # mutable holders give every value an identity
    names = draw(st.lists(st.from_regex(r"[a-z]{1,6}", fullmatch=True), min_size=1,
                          max_size=8, unique=True))
    ns: dict[str, Any] = {}
    for name in names:
        ns[name] = shared[draw(st.integers(0, len(shared) - 1))]
    aliases = [(a, b) for a in ns for b in ns if a < b and ns[a] is ns[b]]
    return ns, aliases


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(map(same, a, b))
    return bool(a == b)


@settings(max_examples=25, deadline=None)
@given(namespaces())
def test_round_trip_keeps_values_and_aliases(
    data: tuple[dict[str, Any], list[tuple[str, str]]],
) -> None:
    ns, aliases = data
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "ck"
        Checkpointer(root).take(ns)
        fresh: dict[str, Any] = {}
        Checkpointer(root).load(fresh)
    assert set(fresh) == set(ns)
    for name, value in ns.items():
        assert same(value, fresh[name]), name
    for a, b in aliases:
        assert fresh[a] is fresh[b]
    distinct = {id(v) for v in ns.values()}
    assert len({id(v) for v in fresh.values()}) == len(distinct)
