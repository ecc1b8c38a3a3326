"""Freezing against a real agent on a simulated node: a whole-GPU job on a one-GPU node, park,
reclaim and their fallbacks, on real processes that keep running and keep what they hold; then
in process, on a simulated node and its freezer: a GPU lost while a kernel is frozen, a thaw that
waits for room, and the policy's choice of whom to freeze."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families
from unix_users import as_user

from harness.agent import AgentProcess, wait_for
from node_agent.client import AgentClient, AgentError
from node_agent.devices.simulated import SimulatedBackend, SimulatedFreezer
from node_agent.ledger import Ledger
from node_agent.policy import NOTEBOOK
from node_agent.quantities import parse_quantity
from node_agent.service import Agent, AgentConfig, Caller, CreateLease

from ..conftest import Holder, notebook_holding

MiB = 2**20
NOBODY = 65534
EVERY_KIND = ("migrate", "shrink", "killed", "park", "resized", "bursting", "unparked", "frozen")


def _heard(c: AgentClient, cursor: int, client: str = "jupyter") -> list[dict[str, Any]]:
    return c.directives(client=client, after=cursor, timeout=0, kinds=EVERY_KIND)[0]


def _metric(c: AgentClient, name: str, **labels: str) -> float:
    return sum(s.value for f in text_string_to_metric_families(c.metrics()) for s in f.samples
               if s.name == name and s.labels.items() >= labels.items())


def test_a_whole_gpu_job_on_a_one_gpu_node_freezes_the_notebooks_and_thaws_them_after(
    start_agent: Callable[..., AgentProcess], holders: Callable[..., Holder]
) -> None:
    """The issue's failure: two notebooks of a quarter on the only GPU, then a job that needs
    all of it. It waits while they are frozen, runs, and they thaw when it ends, each process
    alive throughout and holding what it held."""
    agent = start_agent(spec="1x2GiB")
    c = agent.client()
    a, a_proc = notebook_holding(agent, holders, "512Mi", "1Gi", 200)
    b, b_proc = notebook_holding(agent, holders, "512Mi", "1Gi", 100)
    wait_for(lambda: c.lease(a["id"])["usage"] >= 200 * MiB, what="a's usage measured")
    wait_for(lambda: c.lease(b["id"])["usage"] >= 100 * MiB, what="b's usage measured")
    _, cursor = c.directives(client="jupyter", after=-1, timeout=0)

    job = c.create_lease(client="run", kind="job", name="train.py")
    assert job["state"] == "pending"
    assert "waiting for 2 notebook(s) on GPU 0 to be frozen" in job["reason"]
    job = wait_for(lambda: (j := c.lease(job["id"]))["state"] == "active" and j,
                   what="the job to run")
    for lease, proc, held in ((a, a_proc, 200), (b, b_proc, 100)):
        frozen = c.lease(lease["id"])
        assert frozen["frozen"] and frozen["protection"] == "frozen in host memory"
        assert (frozen["state"], frozen["physical_gpus"], frozen["usage"]) == ("pending", [], 0)
        assert frozen["frozen_gpus"] == [job["physical_gpu"]]
        assert frozen["frozen_bytes"] >= held * MiB
        assert frozen["reason"].startswith("frozen in host memory, waiting for a GPU")
        assert 'held whole by job "train.py"' in frozen["reason"]
        assert proc.alive()
    assert [s["lease"] for s in c.node()["gpus"][0]["shares"]] == [job["id"]]
    said = _heard(c, cursor)
    assert sorted((d["kind"], d["lease_id"]) for d in said) == sorted(
        [("frozen", a["id"]), ("frozen", b["id"])])
    assert all(d["waiting"] and d["frozen_bytes"] > 0 for d in said)
    assert all('job "train.py"' in d["reason"] and "needs GPU 0 whole" in d["reason"]
               and "thaws when the job ends" in d["reason"] for d in said)
    cursor = max(d["seq"] for d in said)
    # A frozen process runs on: it can still be told to do things (a cell that waits for the
    # GPU is the kernel's to hold), and keeps its memory.
    a_proc.hold(10)

    c.release(job["id"])
    for lease, held in ((a, 210), (b, 100)):
        back = wait_for(lambda lease=lease: (x := c.lease(lease["id"]))["state"] == "active" and x,
                        what="a notebook thawed")
        assert not back["frozen"] and back["physical_gpus"] == job["physical_gpus"]
        # What it held comes back onto the GPU with it.
        wait_for(lambda lease=lease, held=held: c.lease(lease["id"])["usage"] >= held * MiB,
                 what="its memory back on the GPU")
    thawed = [d for d in _heard(c, cursor) if d["kind"] == "unparked"]
    assert sorted(d["lease_id"] for d in thawed) == sorted([a["id"], b["id"]])
    assert all(d["thawed"] and d["frozen_s"] > 0
               and "frozen in host memory for" in d["reason"] for d in thawed)
    assert a_proc.alive() and b_proc.alive()
    assert _metric(c, "gpufrac_freezes_total", cause="job") == 2
    assert _metric(c, "gpufrac_kills_total") == 0


def test_a_job_with_freezing_off_asks_the_notebooks_in_its_way_to_park(
    start_agent: Callable[..., AgentProcess], holders: Callable[..., Holder]
) -> None:
    """The fallback: their servers checkpoint and restart them without a GPU, and the job
    waits for that instead of being refused."""
    agent = start_agent("--no-freeze", spec="1x2GiB")
    c = agent.client()
    a, _ = notebook_holding(agent, holders, "512Mi", "1Gi", 50)
    _, cursor = c.directives(client="jupyter", after=-1, timeout=0)
    job = c.create_lease(client="run", kind="job")
    assert job["state"] == "pending"
    [park] = _heard(c, cursor)
    assert (park["kind"], park["lease_id"]) == ("park", a["id"])
    assert "freezing could not be used: freezing is turned off" in park["reason"]
    # What `gpufrac-agent run` shows meanwhile: asked to park, with no deadline to count.
    assert c.lease(job["id"])["waiting_for"] == [{
        "who": f"notebook {a['id']}", "kind": "notebook", "gpu": "GPU 0", "action": "parking",
        "to": None, "deadline": None}]
    c.park(a["id"])  # what its server does once the kernel restarted without a GPU
    wait_for(lambda: c.lease(job["id"])["state"] == "active", what="the job to run")


def test_a_job_is_still_refused_when_no_freeze_could_make_room(
    start_agent: Callable[..., AgentProcess]
) -> None:
    agent = start_agent(spec="1x2GiB")
    c = agent.client()
    c.create_lease(client="run", kind="job", request="1Gi")
    with pytest.raises(AgentError) as err:
        c.create_lease(client="run", kind="job")
    assert err.value.status == 409
    assert err.value.message.startswith("nothing this agent may move, freeze or park makes room "
                                        "for 2.0 GiB on a GPU: GPU 0 can free only 1.0 GiB")
    assert "wait" not in err.value.message, "it says what to do, never to wait: nobody waits"


def test_park_by_freezing_keeps_the_process_and_the_next_unpark_thaws_it(
    start_agent: Callable[..., AgentProcess], holders: Callable[..., Holder]
) -> None:
    agent = start_agent(spec="1x2GiB")
    c = agent.client()
    a, proc = notebook_holding(agent, holders, "512Mi", "1Gi", 150)
    wait_for(lambda: c.lease(a["id"])["usage"] >= 150 * MiB, what="usage measured")
    parked = c.freeze(a["id"], reason="parked after 10 min idle")
    assert (parked["state"], parked["frozen"], parked["physical_gpus"]) == ("parked", True, [])
    assert parked["reason"] == "parked after 10 min idle" and parked["pids"] == [proc.pid]
    gpu = c.node()["gpus"][0]
    assert gpu["shares"] == [] and gpu["memory_used"] < 150 * MiB
    assert proc.alive()
    # Freezing again changes nothing.
    assert c.freeze(a["id"])["frozen_at"] == parked["frozen_at"]

    c.unpark(a["id"])
    back = wait_for(lambda: (x := c.lease(a["id"]))["state"] == "active" and x, what="thawed")
    assert back["physical_gpus"] == [gpu["uuid"]] and not back["frozen"]
    wait_for(lambda: c.lease(a["id"])["usage"] >= 150 * MiB, what="its memory back")
    assert _metric(c, "gpufrac_freezes_total", cause="park") == 1


def test_a_frozen_process_replaced_by_its_restart_before_a_poll_ends_the_freeze(
    start_agent: Callable[..., AgentProcess], holders: Callable[..., Holder]
) -> None:
    """The host's OOM killer takes a frozen kernel, and jupyter_client restarts it within
    0.1 s: the new process registers before any poll sees the old one gone. What the freeze
    kept went with the old process; the lease must say so, not stay frozen for good."""
    agent = start_agent("--poll-interval", "3600", spec="1x2GiB")
    c = agent.client()
    a, proc = notebook_holding(agent, holders, "512Mi", "1Gi", 50)
    assert c.freeze(a["id"], reason="parked after 1 s idle")["frozen"]
    proc.proc.kill()
    proc.proc.wait()
    restarted = holders()
    lease = c.register_pid(a["id"], restarted.pid)
    assert (lease["state"], lease["frozen"], lease["pids"]) == ("parked", False, [restarted.pid])
    assert "frozen process ended" in lease["fallback"], lease


def test_a_freeze_that_cannot_be_used_says_why_for_the_fallback(
    start_agent: Callable[..., AgentProcess], holders: Callable[..., Holder]
) -> None:
    agent = start_agent("--freeze-budget", "1Mi", spec="1x2GiB")
    c = agent.client()
    a, _ = notebook_holding(agent, holders, "512Mi", "1Gi", 50)
    wait_for(lambda: c.lease(a["id"])["usage"] >= 50 * MiB, what="usage measured")
    with pytest.raises(AgentError) as err:
        c.freeze(a["id"])
    assert (err.value.status, err.value.field) == (409, "freeze")
    assert "host memory for frozen kernels is used up" in err.value.message
    lease = c.lease(a["id"])
    assert lease["state"] == "active" and not lease["frozen"]
    assert lease["protection"] == "checkpoint on disk" and "used up" in lease["fallback"]
    assert _metric(c, "gpufrac_freeze_fallbacks_total", cause="park") == 1


def test_only_the_owner_or_an_admin_may_freeze_a_lease(
    start_agent: Callable[..., AgentProcess], holders: Callable[..., Holder]
) -> None:
    """Freezing is as guarded as killing: another user's lease is not even there for them."""
    agent = start_agent(spec="1x2GiB")
    c = agent.client()
    a, proc = notebook_holding(agent, holders, "512Mi", "1Gi", 10)
    denied = as_user(NOBODY, lambda: agent.client().freeze(a["id"]))
    assert (denied["status"], denied["field"]) == (404, "lease"), denied
    assert c.lease(a["id"])["state"] == "active" and proc.alive()
    assert c.freeze(a["id"])["state"] == "parked"  # root, an admin, freezes anyone's


def test_reclaim_freezes_a_borrower_and_thaws_it_when_room_returns(
    start_agent: Callable[..., AgentProcess], holders: Callable[..., Holder]
) -> None:
    """Shrink, then freeze instead of a kill: the borrower's process lives on and comes back
    by itself once its GPU has room for what it froze."""
    agent = start_agent("--reclaim-grace", "0.5", "--headroom", "0.25", spec="1x1GiB")
    c = agent.client()
    owner, owner_proc = notebook_holding(agent, holders, "512Mi", "512Mi", 100)
    borrower, borrower_proc = notebook_holding(agent, holders, "128Mi", "1", 450)
    notebook_holding(agent, holders, "128Mi", "1", 1)  # owed its request too
    wait_for(lambda: c.lease(borrower["id"])["bursting"], what="borrower bursting")
    _, cursor = c.directives(client="jupyter", after=-1, timeout=0)
    owner_proc.hold(300)
    found, cursor = c.directives(client="jupyter", after=cursor, timeout=10, kinds=EVERY_KIND)
    assert [(d["kind"], d["lease_id"]) for d in found] == [("shrink", borrower["id"])]
    found, cursor = c.directives(client="jupyter", after=cursor, timeout=10, kinds=EVERY_KIND)
    assert [(d["kind"], d["lease_id"]) for d in found] == [("frozen", borrower["id"])]
    assert "frozen to return" in found[0]["reason"] and found[0]["waiting"]
    frozen = c.lease(borrower["id"])
    assert (frozen["state"], frozen["frozen"]) == ("pending", True)
    assert "waiting until a GPU has room" in frozen["reason"] or "frozen to return" in frozen["reason"]
    assert borrower_proc.alive() and _metric(c, "gpufrac_kills_total") == 0
    assert _metric(c, "gpufrac_freezes_total", cause="reclaim") == 1

    owner_proc.hold(0)
    c.release(owner["id"])
    owner_proc.stop()
    wait_for(lambda: c.lease(borrower["id"])["state"] == "active", timeout=15,
             what="the borrower thawed once room returned")
    assert borrower_proc.alive()


def test_reclaim_kills_where_freezing_is_off_and_says_why(
    start_agent: Callable[..., AgentProcess], holders: Callable[..., Holder]
) -> None:
    agent = start_agent("--reclaim-grace", "0.5", "--headroom", "0.25", "--no-freeze",
                        spec="1x1GiB")
    c = agent.client()
    _, owner_proc = notebook_holding(agent, holders, "512Mi", "512Mi", 100)
    borrower, borrower_proc = notebook_holding(agent, holders, "128Mi", "1", 450)
    notebook_holding(agent, holders, "128Mi", "1", 1)
    wait_for(lambda: c.lease(borrower["id"])["bursting"], what="borrower bursting")
    owner_proc.hold(300)
    wait_for(lambda: not borrower_proc.alive(), what="borrower stopped")
    killed = c.lease(borrower["id"])
    assert killed["state"] == "killed"
    assert "Freezing could not be used: freezing is turned off" in killed["reason"]


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
        # No thaw onto a lost GPU: the lock and checkpoint only.
        assert [c[0] for c in freezer.calls] == ["lock", "checkpoint"]
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
        freezer.fail("restore", "the driver failed to restore it", pid=sleeper.pid)
        agent.unpark(ROOT, lease.id)
        await agent.settled()
        stopped = agent.ledger.leases[lease.id]
        assert stopped.state == "killed" and "the driver failed to restore it" in stopped.reason
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


def test_a_jobs_freeze_cut_short_by_an_agent_restart_is_made_again(
    tmp_path: Path, sleeper: subprocess.Popen[bytes]
) -> None:
    """The agent is killed while a notebook is being frozen for a whole-GPU job: the next
    agent undoes the freeze cut short (the driver's state is not known to be whole), and then
    makes way for the job again, which would otherwise wait for good."""
    backend = SimulatedBackend("1x2GiB")
    freezer = SimulatedFreezer(backend)
    first = Ledger(tmp_path / "state")
    before = Agent(backend, first, AgentConfig(), freezer)

    whole = parse_quantity("1", "request")  # the whole GPU

    async def until_killed() -> tuple[str, str]:
        await before.tick()
        notebook = before.create_lease(ROOT, ask("512Mi", "1Gi"))
        before.register_pid(ROOT, notebook.id, sleeper.pid)
        job = before.create_lease(ROOT, CreateLease(kind="job", client="run", request=whole,
                                                    limit=whole))
        assert job.state == "pending"
        assert first.leases[notebook.id].state == "freezing"
        for task in asyncio.all_tasks() - {asyncio.current_task()}:
            task.cancel()  # the freeze never runs: the agent is killed here
        return notebook.id, job.id

    notebook_id, job_id = asyncio.run(until_killed())
    first.close()
    ledger = Ledger(tmp_path / "state")
    after = Agent(backend, ledger, AgentConfig(), freezer)

    async def restarted() -> None:
        await after.start()
        try:
            await after.settled()
            await after.tick()
            job, notebook = ledger.leases[job_id], ledger.leases[notebook_id]
            assert job.state == "active", job.reason
            assert notebook.frozen and notebook.state == "pending", notebook.reason
            assert freezer.state(sleeper.pid) == "checkpointed"
        finally:
            await after.stop()
            ledger.close()

    asyncio.run(restarted())
