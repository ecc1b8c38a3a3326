"""Node specs: the forms accepted, and what a bad one says."""

from __future__ import annotations

import pytest

from node_agent.simulator.node_spec import KNOWN_MODELS, NodeSpecError, parse_node

GiB = 2**30


@pytest.mark.parametrize("model", KNOWN_MODELS)
def test_every_model_named_in_the_message_parses(model: str) -> None:
    spec = parse_node(f"8x{model}")
    assert spec.gpus == 8 and len(set(spec.totals)) == 1 and spec.context > 0


def test_a_model_leaves_out_what_the_driver_reserves() -> None:
    spec = parse_node("8xA100-80GB")
    assert spec.gpus == 8
    assert 79 * GiB < spec.totals[0] < 80 * GiB
    assert parse_node("8xA100-80GB:reserved=4Gi").totals[0] == 76 * GiB


def test_sizes_mixes_and_lower_case() -> None:
    assert parse_node("4x16GiB").totals == (16 * GiB,) * 4
    mixed = parse_node("2xa100-80gb,2xT4-16GB")
    assert mixed.gpus == 4 and mixed.largest == mixed.totals[0] > mixed.totals[3]
    devices = mixed.devices(3)
    assert [d.index for d in devices] == [0, 1, 2, 3]
    assert len({d.uuid for d in devices} | {d.uuid for d in mixed.devices(4)}) == 8


@pytest.mark.parametrize("bad", ["8xV100", "eight A100s", "0xA100-80GB", "8x", "8xA100-80GB:spare=1Gi", ""])
def test_a_bad_spec_says_what_is_accepted(bad: str) -> None:
    with pytest.raises(NodeSpecError) as e:
        parse_node(bad)
    message = str(e.value)
    assert repr(bad) in message and "Accepted:" in message
    assert "8xA100-80GB" in message and "8x80GiB" in message and "T4-16GB" in message
