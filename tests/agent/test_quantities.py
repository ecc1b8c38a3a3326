"""Quantities as Run:ai and KAI users write them."""

from __future__ import annotations

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from node_agent.quantities import (
    GiB,
    MiB,
    Quantity,
    QuantityError,
    check_share,
    parse_kai_gpu_memory,
    parse_quantity,
)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("0.25", Quantity(fraction=0.25)),
        ("1", Quantity(fraction=1.0)),
        (0.5, Quantity(fraction=0.5)),
        ("2500M", Quantity(nbytes=2_500_000_000)),
        ("4G", Quantity(nbytes=4_000_000_000)),
        ("4Gi", Quantity(nbytes=4 * GiB)),
        ("4GiB", Quantity(nbytes=4 * GiB)),
        ("512Mi", Quantity(nbytes=512 * MiB)),
        ("1073741824", Quantity(nbytes=GiB)),
        (1073741824, Quantity(nbytes=GiB)),
    ],
)
def test_parses(text: object, expected: Quantity) -> None:
    assert parse_quantity(text, "request") == expected


@pytest.mark.parametrize(
    "bad", ["", "abc", "0", "-1", "1.5", "4 apples", "4Xi", None, True, [1], "inf", "nan"]
)
def test_refuses_with_field_and_expectation(bad: object) -> None:
    with pytest.raises(QuantityError) as err:
        parse_quantity(bad, "limit")
    assert err.value.field == "limit"
    assert str(err.value).startswith("limit: ")
    assert "expected" in err.value.message or "must" in err.value.message


def test_kai_gpu_memory_is_mib() -> None:
    assert parse_kai_gpu_memory("2048") == Quantity(nbytes=2048 * MiB)
    with pytest.raises(QuantityError, match="gpu-memory: expected a whole number of MiB"):
        parse_kai_gpu_memory("2G")


def test_limit_below_request_refused() -> None:
    with pytest.raises(QuantityError, match="limit: must be at least the request"):
        check_share(Quantity(fraction=0.5), Quantity(fraction=0.25), 16 * GiB)
    with pytest.raises(QuantityError, match=r"request: .* more than one GPU holds"):
        check_share(Quantity(nbytes=32 * GiB), Quantity(nbytes=32 * GiB), 16 * GiB)


@given(st.floats(min_value=1e-6, max_value=1.0), st.integers(min_value=1, max_value=2**40))
def test_fraction_resolves_within_gpu(f: float, total: int) -> None:
    q = parse_quantity(repr(f), "request")
    assert q.fraction == f
    assert 0 <= q.bytes_of(total) <= total


@given(st.integers(min_value=2, max_value=2**50), st.sampled_from(["", "Ki", "Mi", "Gi", "K", "M", "G"]))
def test_sizes_round_trip(n: int, unit: str) -> None:
    scale = {"": 1, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "K": 10**3, "M": 10**6, "G": 10**9}[unit]
    assume(n * scale <= 2**50)
    assert parse_quantity(f"{n}{unit}", "request").nbytes == n * scale


def test_absurd_sizes_refused() -> None:
    with pytest.raises(QuantityError, match="at most 1 PiB"):
        parse_quantity("4611686019G", "request")
