"""How the agent polls: one sweep a tick, a stretched interval on a quiet node that snaps back
on a call or a change, and deadlines kept to the moment."""

from __future__ import annotations

import asyncio
import itertools
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from node_agent.devices import SimulatedBackend, Sweep
from node_agent.flows.polling import POLL_STRETCH, QUIET_TICKS
from node_agent.ledger import Ledger
from node_agent.quantities import parse_quantity
from node_agent.service import Agent, AgentConfig, Caller, CreateLease

from ..conftest import Holder


class Recorded(SimulatedBackend):
    """A simulated node that notes when each sweep was made."""

    def __init__(self, spec: str) -> None:
        super().__init__(spec)
        self.swept: list[float] = []

    def sweep(self) -> Sweep:
        self.swept.append(time.monotonic())
        return super().sweep()


async def _until(check: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


def _gaps(times: list[float]) -> list[float]:
    return [b - a for a, b in itertools.pairwise(times)]


@pytest.fixture
def node(tmp_path: Path) -> Iterator[tuple[Agent, Recorded]]:
    backend = Recorded("1x4GiB")
    ledger = Ledger(tmp_path)
    yield Agent(backend, ledger, AgentConfig(poll_interval=0.1)), backend
    ledger.close()


ME = Caller(uid=os.getuid())
SHARE = parse_quantity("0.25", "request")


def test_a_quiet_node_is_polled_less_and_a_call_brings_polling_back_at_once(
    node: tuple[Agent, Recorded]
) -> None:
    agent, backend = node
    interval = agent.config.poll_interval

    async def run() -> None:
        await agent.start()
        try:
            # Doubling after QUIET_TICKS quiet ticks, up to POLL_STRETCH intervals.
            stretched = interval * POLL_STRETCH
            await _until(lambda: len(backend.swept) >= QUIET_TICKS + 5, 10, "quiet ticks")
            assert _gaps(backend.swept)[-1] >= 0.8 * stretched
            assert all(gap <= 1.5 * stretched for gap in _gaps(backend.swept))
            since = len(backend.swept)
            called = time.monotonic()
            agent.create_lease(ME, CreateLease("notebook", "test", SHARE, SHARE))
            await _until(lambda: len(backend.swept) > since, 5, "a sweep after the call")
            assert backend.swept[since] - called < 0.6 * stretched
            # And at the configured interval from then on, until it is quiet again.
            await _until(lambda: len(backend.swept) > since + 1, 5, "the next sweep")
            assert backend.swept[since + 1] - backend.swept[since] < 0.6 * stretched
        finally:
            await agent.stop()

    asyncio.run(run())


def test_a_change_measured_brings_polling_back(
    node: tuple[Agent, Recorded], holders: Callable[..., Holder]
) -> None:
    agent, backend = node
    interval = agent.config.poll_interval
    h = holders()

    async def run() -> None:
        await agent.start()
        try:
            lease = agent.create_lease(ME, CreateLease("notebook", "test", SHARE, SHARE))
            agent.register_pid(ME, lease.id, h.pid)
            await _until(lambda: len(backend.swept) >= QUIET_TICKS + 6
                         and _gaps(backend.swept)[-1] >= 0.8 * interval * POLL_STRETCH,
                         10, "a stretched interval")
            h.hold(16)  # no call: only a sweep can see it
            since = len(backend.swept)
            await _until(lambda: agent.ledger.leases[lease.id].usage > 0, 5, "the usage seen")
            seen = len(backend.swept)
            await _until(lambda: len(backend.swept) > seen, 5, "the sweep after it")
            assert backend.swept[seen] - backend.swept[seen - 1] < 0.6 * interval * POLL_STRETCH
            assert seen - since <= 1, "the change is seen by the next sweep"
        finally:
            await agent.stop()

    asyncio.run(run())


def test_a_shrink_grace_ends_when_it_says_however_stretched_the_interval(
    tmp_path: Path, holders: Callable[..., Holder]
) -> None:
    """A borrower asked to shrink, holding on: the agent polls less during the grace (nothing
    changes), yet stops it at the deadline, not at its next poll."""
    backend = Recorded("1x256MiB")
    ledger = Ledger(tmp_path)
    # Polls at 0.25, 0.5, 0.75, 1.25 and 2.25 s after the shrink, then 3.25: the grace ends
    # between the last two.
    agent = Agent(backend, ledger, AgentConfig(poll_interval=0.25, reclaim_grace=2.4,
                                               headroom=0.25))
    half, whole = parse_quantity("0.5", "request"), parse_quantity("1", "limit")
    borrower, owner = holders(), holders()

    async def run() -> None:
        await agent.start()
        try:
            lent = agent.create_lease(ME, CreateLease("notebook", "test", half, whole))
            owed = agent.create_lease(ME, CreateLease("notebook", "test", half, half))
            agent.register_pid(ME, lent.id, borrower.pid)
            agent.register_pid(ME, owed.id, owner.pid)
            borrower.hold(200)  # 72 MiB above its request of 128
            owner.hold(40)  # free memory falls below the headroom while it is owed 88
            await _until(lambda: ledger.leases[lent.id].state == "shrinking", 10, "a shrink")
            deadline = ledger.leases[lent.id].deadline
            assert deadline is not None
            asked = len(backend.swept)
            await _until(lambda: ledger.leases[lent.id].state == "killed", 10, "the kill")
            assert 0 <= time.time() - deadline < 0.3
            during = _gaps(backend.swept[asked - 1:])
            assert max(during) >= 2 * agent.config.poll_interval, "the interval stretched"
        finally:
            await agent.stop()

    asyncio.run(run())
    ledger.close()


