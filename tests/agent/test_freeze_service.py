"""The freeze paths of the service in process, on a simulated node and its freezer: a GPU lost
while a kernel is frozen, a thaw that waits for room, and the policy's choice of whom to freeze."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from node_agent.devices.simulated import SimulatedBackend, SimulatedFreezer
from node_agent.ledger import Ledger
from node_agent.policy import NOTEBOOK
from node_agent.quantities import parse_quantity
from node_agent.service import Agent, AgentConfig, Caller, CreateLease

ROOT = Caller(uid=0, admin=True)


def ask(request: str, limit: str) -> CreateLease:
    return CreateLease(kind=NOTEBOOK, client="t", request=parse_quantity(request, "request"),
                       limit=parse_quantity(limit, "limit"))


@pytest.fixture
def sleeper() -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    yield proc
    proc.kill()
    proc.wait()


@pytest.fixture
def node(tmp_path: Path) -> Iterator[tuple[Agent, SimulatedBackend, SimulatedFreezer]]:
    backend = SimulatedBackend("1x2GiB")
    freezer = SimulatedFreezer(backend)
    ledger = Ledger(tmp_path / "state")
    agent = Agent(backend, ledger, AgentConfig(), freezer)
    asyncio.run(agent.tick())
    yield agent, backend, freezer
    ledger.close()


def test_a_kernel_frozen_when_its_gpu_is_lost_waits_and_thaws_once_it_is_back(
    node: tuple[Agent, SimulatedBackend, SimulatedFreezer], sleeper: subprocess.Popen[bytes]
) -> None:
    agent, backend, freezer = node
    uuid = agent.gpus[0].uuid

    async def scenario() -> None:
        lease = agent.create_lease(ROOT, ask("512Mi", "1Gi"))
        agent.register_pid(ROOT, lease.id, sleeper.pid)
        frozen = await agent.freeze(ROOT, lease.id)
        assert frozen.state == "parked" and frozen.frozen and freezer.state(sleeper.pid) == "checkpointed"
        backend.set_fault(uuid, "lost")
        await agent.tick()
        waiting = agent.unpark(ROOT, lease.id)
        assert waiting.state == "pending" and "GPU 0 is unhealthy" in waiting.reason
        assert waiting.reason.startswith("frozen in host memory")
        assert freezer.calls == [("freeze", sleeper.pid, None)]  # no thaw onto a lost GPU
        backend.set_fault(uuid, None)
        await agent.tick()
        await agent.settled()
        back = agent.ledger.leases[lease.id]
        assert back.state == "active" and not back.frozen and back.physical == (uuid,)
        assert freezer.state(sleeper.pid) == "running"

    asyncio.run(scenario())


def test_a_thaw_the_simulated_driver_fails_restarts_the_kernel(
    node: tuple[Agent, SimulatedBackend, SimulatedFreezer], sleeper: subprocess.Popen[bytes]
) -> None:
    agent, _, freezer = node

    async def scenario() -> None:
        lease = agent.create_lease(ROOT, ask("512Mi", "1Gi"))
        agent.register_pid(ROOT, lease.id, sleeper.pid)
        await agent.freeze(ROOT, lease.id)
        freezer.fail("thaw", "out of memory while restoring", pid=sleeper.pid)
        agent.unpark(ROOT, lease.id)
        await agent.settled()
        stopped = agent.ledger.leases[lease.id]
        assert stopped.state == "killed" and "out of memory while restoring" in stopped.reason
        assert not stopped.frozen and stopped.fallback
        assert sleeper.wait(10) == -9

    asyncio.run(scenario())


def test_the_host_memory_budget_stops_a_freeze_before_it_starts(
    tmp_path: Path, sleeper: subprocess.Popen[bytes]
) -> None:
    backend = SimulatedBackend("1x2GiB")
    freezer = SimulatedFreezer(backend)
    ledger = Ledger(tmp_path / "state")
    agent = Agent(backend, ledger, AgentConfig(freeze_budget=0), freezer)

    async def scenario() -> None:
        await agent.tick()
        lease = agent.create_lease(ROOT, ask("512Mi", "1Gi"))
        lease = agent.register_pid(ROOT, lease.id, sleeper.pid)
        agent.ledger.set_usage(lease.id, 64 * 2**20)
        blocker = agent.freeze_blocker(agent.ledger.leases[lease.id])
        assert blocker is not None and "host memory for frozen kernels is used up" in blocker
        assert agent.freezing()["budget"] == 0 and freezer.calls == []

    asyncio.run(scenario())
    ledger.close()


@pytest.mark.parametrize("wait", [300.0, 0.0])
def test_a_cell_that_waits_too_long_to_thaw_restarts_its_kernel_within_its_request(
    tmp_path: Path, sleeper: subprocess.Popen[bytes], wait: float
) -> None:
    """A borrower frozen with more than its GPU now has free waits for room; once a cell has
    waited --thaw-wait for it, the kernel restarts from its checkpoint within its request."""
    backend = SimulatedBackend("1x2GiB")
    ledger = Ledger(tmp_path / "state")
    agent = Agent(backend, ledger, AgentConfig(thaw_wait=wait), SimulatedFreezer(backend))

    async def scenario() -> None:
        await agent.tick()
        lease = agent.create_lease(ROOT, ask("512Mi", "2Gi"))
        agent.register_pid(ROOT, lease.id, sleeper.pid)
        await agent.freeze(ROOT, lease.id)
        # What it froze is more than the GPU has free now (others grew meanwhile).
        agent.ledger.update(lease.id, frozen_bytes=3 * 2**30)
        after = agent.unpark(ROOT, lease.id)
        await agent.settled()
        after = agent.ledger.leases[lease.id]
        if wait:
            assert after.state == "pending" and after.frozen
            assert "waiting until a GPU has room for the 3.0 GiB it froze" in after.reason
            assert sleeper.poll() is None
        else:
            assert after.state == "killed" and not after.frozen
            assert "waited 0 s for room to thaw the 3.0 GiB it froze" in after.reason
            assert sleeper.wait(10) == -9

    asyncio.run(scenario())
    ledger.close()
