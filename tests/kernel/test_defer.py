"""Which variables a budgeted restore leaves on disk: a pure rule, checked on random groups."""

from __future__ import annotations

from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from jupyter_gpufrac.kernel.groups import defer, group_size

BLOBS = [f"s{i}.bin" for i in range(6)]


@st.composite
def groups(draw: st.DrawFn) -> list[dict[str, Any]]:
    sizes = {blob: draw(st.integers(0, 1000)) for blob in BLOBS}
    out = []
    for i in range(draw(st.integers(0, 8))):
        reached = draw(st.sets(st.sampled_from(BLOBS), max_size=3))
        out.append({"names": [f"v{i}"], "blob": f"g{i}.bin", "pickle": draw(st.integers(0, 100)),
                    "tensors": {b: sizes[b] for b in reached},
                    "gpu": sorted(b for b in reached if draw(st.booleans()))})
    return out


@given(groups(), st.integers(0, 5000), st.sampled_from(["bytes", "gpu_bytes"]))
def test_what_is_loaded_fits_and_a_storage_is_never_split(
    found: list[dict[str, Any]], budget: int, measure: str
) -> None:
    waiting = defer(found, budget, measure)
    loaded = [g for g in found if g not in waiting]
    assert group_size(loaded, measure) <= budget
    # Groups reaching one storage are loaded or wait together: views stay views of their base.
    for g in waiting:
        for h in loaded:
            assert not set(g["tensors"]) & set(h["tensors"])
    if group_size(found, measure) <= budget:
        assert waiting == []
