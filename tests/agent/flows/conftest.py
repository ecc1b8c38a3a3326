"""Fixtures of the rooms' tests: an agent in process on a simulated node, and typed asks."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from node_agent.devices.simulated import SimulatedBackend
from node_agent.ledger import Ledger
from node_agent.policy import NOTEBOOK
from node_agent.quantities import parse_quantity
from node_agent.service import Agent, AgentConfig, Caller, CreateLease

ME = Caller(uid=1000)


def ask(request: str, limit: str | None = None, kind: str = NOTEBOOK, devices: int = 1
        ) -> CreateLease:
    wanted = parse_quantity(request, "request")
    return CreateLease(kind=kind, client="t", request=wanted, devices=devices,
                       limit=parse_quantity(limit, "limit") if limit else wanted)


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[Agent]:
    ledger = Ledger(tmp_path / "state")
    agent = Agent(SimulatedBackend("2x1GiB"), ledger, AgentConfig(max_leases_per_user=3))
    asyncio.run(agent.tick())  # measures the node
    yield agent
    ledger.close()
