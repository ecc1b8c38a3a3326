"""Node size specs (``8xA100-80GB``) read with the simulated backend's own parser, as policy Devices."""

from __future__ import annotations

from dataclasses import dataclass

from node_agent.devices.simulated import parse_spec
from node_agent.policy import Device
from node_agent.quantities import QuantityError

# Boards the simulated backend knows by name (its table is private; tests check each still parses).
KNOWN_MODELS = ("A100-40GB", "A100-80GB", "H100-80GB", "H200-141GB", "L4-24GB", "T4-16GB")
ACCEPTED = (
    "COUNTxMODEL (8xA100-80GB; models: " + ", ".join(KNOWN_MODELS) + "), "
    "COUNTxSIZE (8x80GiB, 4x16G), either with :reserved=SIZE:context=SIZE (8xA100-80GB:reserved=1Gi), "
    "or several joined by commas (4xA100-80GB,4xT4-16GB)"
)


class NodeSpecError(ValueError):
    """A node spec that does not parse; says what is accepted."""


@dataclass(frozen=True)
class NodeSpec:
    """One node's GPUs: usable memory each (driver-reserved memory left out), and the CUDA
    context one process takes on them."""

    text: str
    totals: tuple[int, ...]
    context: int

    @property
    def gpus(self) -> int:
        return len(self.totals)

    @property
    def largest(self) -> int:
        return max(self.totals)

    def devices(self, node: int) -> list[Device]:
        """The node's GPUs as policy sees them, with UUIDs unique across the cluster."""
        return [Device(f"node{node}-gpu{i}", i, total) for i, total in enumerate(self.totals)]


def parse_node(text: str) -> NodeSpec:
    try:
        boards = parse_spec(text)
    except QuantityError as e:
        raise NodeSpecError(f"node spec {text!r}: {e.message}. Accepted: {ACCEPTED}") from None
    # Without a per-board context (a plain size), a CUDA 12 context's typical 500 MiB.
    context = max((b.context for b in boards), default=0) or 500 * 2**20
    return NodeSpec(text, tuple(b.total - b.reserved for b in boards), context)
