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
    parse_size,
    stored_spec,
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
        ("1073741824B", Quantity(nbytes=GiB)),
        ("50%", Quantity(fraction=0.5)),
        ("100%", Quantity(fraction=1.0)),
        (" 12.5 % ", Quantity(fraction=0.125)),
    ],
)
def test_parses(text: object, expected: Quantity) -> None:
    assert parse_quantity(text, "request") == expected


@pytest.mark.parametrize(
    "bad", ["", "abc", "0", "-1", "1.5", "4 apples", "4Xi", None, True, [1], "inf", "nan", "0%",
            "101%", "-5%", "%"]
)
def test_refuses_with_field_and_expectation(bad: object) -> None:
    with pytest.raises(QuantityError) as err:
        parse_quantity(bad, "limit")
    assert err.value.field == "limit"
    assert str(err.value).startswith("limit: ")
    # What was expected, or the question a bare number raises.
    assert any(word in err.value.message for word in ("expected", "must", "GPUs?"))


@pytest.mark.parametrize("bare", ["2", 2, "1.5", "4294967296", 4294967296, "16"])
def test_a_bare_number_above_one_is_answered_with_the_question_it_raises(bare: object) -> None:
    """People who type 2 mean 2 GiB or 2 GPUs, never 2 bytes: neither is guessed."""
    n = f"{float(str(bare)):g}"
    with pytest.raises(QuantityError) as err:
        parse_quantity(bare, "request")
    assert err.value.message.startswith(f"{n} GiB or {n} GPUs? A bare number is a share of one "
                                        "GPU"), err.value.message
    assert f"{n}Gi for {n} GiB" in err.value.message
    assert err.value.message.endswith("A share here is of one GPU.")
    with pytest.raises(QuantityError) as err:
        parse_quantity(bare, "--request", several="--gpus {n}")
    assert err.value.message.endswith(f"For {n} GPUs use --gpus {n}.")


def test_a_percentage_above_a_whole_gpu_says_how_to_ask_for_several() -> None:
    with pytest.raises(QuantityError, match=r"at most 100% \(a whole GPU\), got '150%'; for "
                       "several GPUs use --gpus 2"):
        parse_quantity("150%", "--request", several="--gpus {n}")


def test_sizes_are_bytes_where_nothing_else_is_meant() -> None:
    assert parse_size("4096", "--context-size") == 4096
    assert parse_size("500Mi", "--context-size") == 500 * MiB
    with pytest.raises(QuantityError, match="--context-size: expected a memory size such as "
                       "500Mi"):
        parse_size("0.5", "--context-size")


def test_specs_stored_by_earlier_versions_keep_their_meaning() -> None:
    """A byte count stored bare (an earlier %gpu request, KAI's gpu-memory) reads as bytes."""
    assert parse_quantity(stored_spec("4294967296"), "request") == Quantity(nbytes=4 * GiB)
    assert stored_spec("0.25") == "0.25" and stored_spec("1") == "1" and stored_spec("4Gi") == "4Gi"


def test_kai_gpu_memory_is_mib() -> None:
    assert parse_kai_gpu_memory("2048") == Quantity(nbytes=2048 * MiB)
    assert parse_kai_gpu_memory("2048").spec == "2048Mi"
    with pytest.raises(QuantityError, match="gpu-memory: expected a whole number of MiB"):
        parse_kai_gpu_memory("2G")


def test_limit_below_request_refused_saying_what_each_was_understood_as() -> None:
    request, limit = parse_quantity("50%", "request"), parse_quantity("0.25", "limit")
    with pytest.raises(QuantityError) as err:
        check_share(request, limit, 16 * GiB)
    assert str(err.value) == ("limit: 0.25 (4.0 GiB here) is below the request, 50% (8.0 GiB "
                              "here): a limit is at least the request")
    big = parse_quantity("32Gi", "request")
    with pytest.raises(QuantityError, match=r"request: 32Gi \(32.0 GiB\) is more than one GPU "
                       r"holds \(16.0 GiB\)"):
        check_share(big, big, 16 * GiB)


@given(st.floats(min_value=1e-6, max_value=1.0), st.integers(min_value=1, max_value=2**40))
def test_fraction_resolves_within_gpu(f: float, total: int) -> None:
    q = parse_quantity(repr(f), "request")
    assert q.fraction == f
    assert 0 <= q.bytes_of(total) <= total


@given(st.integers(min_value=2, max_value=2**50), st.sampled_from(["B", "Ki", "Mi", "Gi", "K", "M", "G"]))
def test_sizes_round_trip(n: int, unit: str) -> None:
    scale = {"B": 1, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "K": 10**3, "M": 10**6, "G": 10**9}[unit]
    assume(n * scale <= 2**50)
    assert parse_quantity(f"{n}{unit}", "request").nbytes == n * scale


def test_absurd_sizes_refused() -> None:
    with pytest.raises(QuantityError, match="at most 1 PiB"):
        parse_quantity("4611686019G", "request")
