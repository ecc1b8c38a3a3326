"""Placement: refusals by kind and field, resizes in place, what a waiting lease waits for, and
where the node scheduler puts leases (in process, and against a real agent)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest

from harness.agent import AgentProcess
from node_agent.client import AgentError
from node_agent.ledger import Ledger
from node_agent.policy import JOB, NOTEBOOK
from node_agent.quantities import parse_quantity
from node_agent.service import Agent, Caller, Conflict, NotFound, OverQuota, Refused, Resize

from .conftest import ME, ask


def test_refusals_say_what_kind_and_which_field(agent: Agent) -> None:
    lease = agent.create_lease(ME, ask("0.25"))
    with pytest.raises(NotFound) as found:
        agent.lease(Caller(uid=1001), lease.id)
    assert found.value.field == "lease"
    with pytest.raises(Conflict) as conflict:
        agent.migrated(ME, lease.id)
    assert (conflict.value.field, conflict.value.message) == ("lease", "the lease is guaranteed, not moving")
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


def test_a_new_request_keeps_the_limit_unless_it_is_above_it(agent: Agent) -> None:
    """`%gpu request X` says the limit is unchanged: it is, unless X is above it."""
    roomy = agent.create_lease(ME, ask("0.25", "0.75"))
    kept = agent.resize(ME, roomy.id, Resize(request=parse_quantity("0.5", "request")))
    assert (kept.request_spec, kept.limit_spec, kept.limit) == ("0.5", "0.75", roomy.limit)
    tight = agent.create_lease(ME, ask("0.25"))
    raised = agent.resize(ME, tight.id, Resize(request=parse_quantity("0.5", "request")))
    assert raised.limit == raised.request == 2 * tight.request and raised.limit_spec == "0.5"


def test_a_share_smaller_than_a_context_is_refused(
    start_agent: Callable[..., AgentProcess]
) -> None:
    agent = start_agent(spec="1x4GiB:context=500Mi")
    with pytest.raises(AgentError) as refused:
        agent.client().create_lease(client="jupyter", request="256Mi")
    err = refused.value
    assert (err.status, err.field) == (400, "request")
    assert "less than the 500.0 MiB a CUDA context takes" in err.message
    assert "ask for at least 500.0 MiB" in err.message


def test_the_node_scheduler_reroutes_only_burstable_notebooks_and_can_be_off(
    start_agent: Callable[..., AgentProcess]
) -> None:
    """Run:ai's rules: only a lease whose limit exceeds its request is spread to an idle GPU;
    with the node scheduler off, every lease runs where the binpacked plan puts it."""
    c = start_agent().client()
    gpu0, gpu1 = (g["uuid"] for g in c.node()["gpus"])
    first = c.create_lease(client="t", request="0.25", limit="1")
    assert first["physical_gpu"] == gpu0
    assert c.create_lease(client="t", request="0.25", limit="1")["physical_gpu"] == gpu1
    fixed = c.create_lease(client="t", request="0.25")  # limit = request: not burstable
    assert fixed["physical_gpu"] == fixed["logical_gpu"] == gpu0
    off = start_agent("--no-node-scheduler").client()
    placed = [off.create_lease(client="t", request="0.25", limit="1") for _ in range(4)]
    assert {(p["logical_gpu"], p["physical_gpu"]) for p in placed} == {(gpu0, gpu0)}


def test_workloads_per_gpu_bound_placement_and_say_so_when_full(
    start_agent: Callable[..., AgentProcess]
) -> None:
    c = start_agent("--max-workloads-per-gpu", "2").client()
    leases = [c.create_lease(client="t", request="64Mi", limit="1") for _ in range(4)]
    per_gpu: dict[str, int] = {}
    for lease in leases:
        per_gpu[lease["physical_gpu"]] = per_gpu.get(lease["physical_gpu"], 0) + 1
    assert sorted(per_gpu.values()) == [2, 2]
    with pytest.raises(AgentError) as full:
        c.create_lease(client="t", request="64Mi")
    assert full.value.status == 409 and "--max-workloads-per-gpu" in full.value.message
    assert "already runs 2 lease(s)" in full.value.message
    c.release(leases[0]["id"])
    assert c.create_lease(client="t", request="64Mi")["physical_gpu"] == leases[0]["physical_gpu"]
