"""The service in process, with typed requests: refusals by kind, resizes, activation after moves."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from node_agent.devices.simulated import SimulatedBackend
from node_agent.ledger import Ledger
from node_agent.policy import JOB, NOTEBOOK
from node_agent.quantities import parse_quantity
from node_agent.service import (
    ACTIONS,
    NOTICES,
    Agent,
    AgentConfig,
    Caller,
    Conflict,
    CreateLease,
    NotFound,
    OverQuota,
    Refused,
    Resize,
)

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


def test_refusals_say_what_kind_and_which_field(agent: Agent) -> None:
    lease = agent.create_lease(ME, ask("0.25"))
    with pytest.raises(NotFound) as found:
        agent.lease(Caller(uid=1001), lease.id)
    assert found.value.field == "lease"
    with pytest.raises(Conflict) as conflict:
        agent.migrated(ME, lease.id)
    assert (conflict.value.field, conflict.value.message) == ("lease", "lease is active, not migrating")
    with pytest.raises(Refused) as refused:
        agent.create_lease(ME, ask("0.25", devices=3))
    assert type(refused.value) is Refused and refused.value.field == "devices"
    with pytest.raises(Refused) as small:
        agent.create_lease(ME, ask("0.25", "0.125"))
    assert small.value.field == "limit"
    agent.create_lease(ME, ask("0.25"))
    agent.create_lease(ME, ask("0.25"))
    with pytest.raises(OverQuota):
        agent.create_lease(ME, ask("0.25"))
    assert len(agent.visible(ME)) == 3, "nothing half-applied"


def test_a_resize_stays_where_it_fits_and_keeps_its_compute_share(agent: Agent) -> None:
    lease = agent.create_lease(ME, ask("0.25", "1"))
    grown = agent.resize(ME, lease.id, Resize(request=parse_quantity("0.5", "request"),
                                              compute_request=0.5))
    assert (grown.state, grown.physical, grown.reason) == (
        "active", lease.physical, "request changed in place")
    assert (grown.request, grown.limit) == (2 * lease.request, lease.limit), "limit kept"
    half = parse_quantity("0.5", "request")
    pinned = agent.resize(ME, lease.id, Resize(request=half, limit=half))
    assert pinned.limit == pinned.request == grown.request
    assert (grown.compute_request, grown.compute_limit) == (0.5, 0.5)
    with pytest.raises(Refused) as refused:
        agent.resize(ME, lease.id, Resize(compute_limit=0.25))
    assert refused.value.field == "compute_limit" and "at least compute_request" in refused.value.message


def test_a_job_waits_for_the_notebook_it_moves_and_starts_once_the_move_is_done(
    agent: Agent,
) -> None:
    home = agent.create_lease(ME, ask("0.25", "1"))
    spread = agent.create_lease(ME, ask("0.25", "1"))
    assert spread.logical == home.physical and spread.physical != spread.logical
    job = agent.create_lease(ME, ask("1", kind=JOB))
    assert job.state == "pending" and job.physical == spread.physical
    assert agent.ledger.leases[spread.id].state == "migrating"
    moved = agent.migrated(ME, spread.id)
    assert moved.physical == spread.logical
    assert agent.ledger.leases[job.id].state == "active"


def test_a_waiting_job_says_which_notebooks_make_room_naming_only_its_users_own(
    agent: Agent, tmp_path: Path
) -> None:
    other = Caller(uid=1001)
    agent.create_lease(ME, replace(ask("0.25", "1"), name="mine.ipynb"))
    theirs = agent.create_lease(other, replace(ask("0.25", "1"), name="theirs.ipynb"))
    assert theirs.physical != theirs.logical, "spread to the other GPU"
    job = agent.create_lease(ME, ask("1", kind=JOB))
    assert job.physical == theirs.physical
    [entry] = agent.waiting_for(job, ME.uid)
    deadline = agent.ledger.leases[theirs.id].deadline
    assert entry == {"who": "another user's notebook", "kind": NOTEBOOK, "gpu": "GPU 1",
                     "action": "moving", "to": "GPU 0", "deadline": deadline}
    assert deadline is not None
    # What the plan chose outlives the agent: the ledger keeps it.
    assert Ledger(tmp_path / "state").leases[job.id].waits_for == (theirs.id,)
    agent.migrated(other, theirs.id)
    assert agent.ledger.leases[job.id].state == "active"
    assert agent.waiting_for(agent.ledger.leases[job.id], ME.uid) == []


def test_a_job_asked_while_a_notebook_still_leaves_its_gpu_waits_for_it(agent: Agent) -> None:
    agent.create_lease(ME, ask("0.25", "1"))
    spread = agent.create_lease(ME, replace(ask("0.25", "1"), name="b.ipynb"))
    first = agent.create_lease(ME, ask("1", kind=JOB))
    agent.release(ME, first.id)  # the move it started goes on
    assert agent.ledger.leases[spread.id].state == "migrating"
    second = agent.create_lease(ME, ask("1", kind=JOB))
    assert second.state == "pending" and second.physical == spread.physical
    [entry] = agent.waiting_for(second, ME.uid)
    assert entry["who"] == f'notebook "b.ipynb" ({spread.id})' and entry["action"] == "moving"
    agent.migrated(ME, spread.id)
    assert agent.ledger.leases[second.id].state == "active"


def kinds(agent: Agent) -> list[tuple[str, dict[str, object]]]:
    directives, _ = asyncio.run(
        agent.wait_directives(ME, client="t", lease_id=None, after=0, timeout=0,
                              kinds=(*ACTIONS, *NOTICES)))
    return [(d.kind, d.body) for d in directives]


def test_the_follower_hears_of_a_new_share_and_of_a_burst_as_they_happen(agent: Agent) -> None:
    """No polling: a resize and the start of a burst each leave one notice for the lease."""
    lease = agent.create_lease(ME, ask("0.25", "1"))
    agent.resize(ME, lease.id, Resize(request=parse_quantity("0.5", "request")))
    [(kind, body)] = kinds(agent)
    assert kind == "resized" and (body["request_spec"], body["limit_spec"]) == ("0.5", "1")
    above = lease.request * 2 + 1
    agent.report_usage(ME, lease.id, above)
    asyncio.run(agent.tick())
    agent.report_usage(ME, lease.id, 0)
    asyncio.run(agent.tick())
    agent.report_usage(ME, lease.id, above)
    asyncio.run(agent.tick())  # bursting again at once: not said twice in a minute
    said = [body for kind, body in kinds(agent) if kind == "bursting"]
    assert len(said) == 1 and said[0]["usage"] == above and said[0]["request"] == 2 * lease.request
    # Asked for by default are only the directives that ask for something.
    actions, last = asyncio.run(
        agent.wait_directives(ME, client="t", lease_id=None, after=0, timeout=0))
    assert actions == [] and last == 2, "notices skipped, and not read again"


def test_a_new_request_keeps_the_limit_unless_it_is_above_it(agent: Agent) -> None:
    """`%gpu request X` says the limit is unchanged: it is, unless X is above it."""
    roomy = agent.create_lease(ME, ask("0.25", "0.75"))
    kept = agent.resize(ME, roomy.id, Resize(request=parse_quantity("0.5", "request")))
    assert (kept.request_spec, kept.limit_spec, kept.limit) == ("0.5", "0.75", roomy.limit)
    tight = agent.create_lease(ME, ask("0.25"))
    raised = agent.resize(ME, tight.id, Resize(request=parse_quantity("0.5", "request")))
    assert raised.limit == raised.request == 2 * tight.request and raised.limit_spec == "0.5"
