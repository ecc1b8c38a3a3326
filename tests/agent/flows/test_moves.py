"""Moves: a job waits for the notebook it moves and starts once the move is done (in process,
and with real processes), and a client that does not move is stopped at the deadline."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from harness.agent import AgentProcess
from node_agent.policy import JOB
from node_agent.service import Agent

from ..conftest import Holder, notebook_holding, run_job
from .conftest import ME, ask


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


def test_job_compacts_a_spread_notebook(
    start_agent: Callable[..., AgentProcess], holders: Callable[..., Holder], tmp_path: Path
) -> None:
    agent = start_agent()
    c = agent.client()
    gpu0, gpu1 = (g["uuid"] for g in c.node()["gpus"])
    a, a_proc = notebook_holding(agent, holders, "0.25", "1", 40)
    b, b_proc = notebook_holding(agent, holders, "0.25", "1", 20)
    # Spread: both logically on GPU 0 (bin-packed), physically one per GPU.
    assert a["logical_gpu"] == b["logical_gpu"] == gpu0
    assert {a["physical_gpu"], b["physical_gpu"]} == {gpu0, gpu1}
    moving, staying = (b, a) if b["physical_gpu"] == gpu1 else (a, b)
    moving_proc = b_proc if moving is b else a_proc
    staying_proc = a_proc if moving is b else b_proc

    _, cursor = c.directives(client="jupyter", after=-1, timeout=0)
    out = tmp_path / "job.txt"
    job = run_job(agent, out)
    found, cursor = c.directives(client="jupyter", after=cursor, timeout=20)
    assert [(d["kind"], d["lease_id"]) for d in found] == [("migrate", moving["id"])]
    d = found[0]
    assert (d["from_gpu"], d["to_gpu"]) == (gpu1, gpu0)
    assert "job" in d["reason"] and d["deadline"] > time.time()
    assert c.lease(moving["id"])["state"] == "migrating"
    pending = [x for x in c.leases() if x["kind"] == "job"]
    assert len(pending) == 1 and pending[0]["state"] == "pending"
    assert not out.exists(), "the job must wait for the GPU to be freed"

    # The client moves the kernel: stop it, start it on the new GPU, report the move.
    moving_proc.stop()
    moved_proc = holders(CUDA_VISIBLE_DEVICES=d["to_gpu"])
    c.register_pid(moving["id"], moved_proc.pid)
    moved = c.migrated(moving["id"])
    assert moved["physical_gpu"] == gpu0 and moved["state"] == "active"

    assert job.wait(timeout=30) == 0
    assert out.read_text() == gpu1, "the job ran on the freed GPU"
    assert job.stderr is not None
    assert f"waiting for 1 notebook to make room: notebook {moving['id']} moves from" \
        in job.stderr.read()
    # The other notebook was not touched, and the job's lease is gone.
    assert staying_proc.alive()
    assert c.lease(staying["id"])["physical_gpu"] == staying["physical_gpu"]
    assert c.directives(client="jupyter", after=cursor, timeout=0)[0] == []
    assert {x["id"] for x in c.leases()} == {a["id"], b["id"]}


def test_a_client_that_does_not_move_is_stopped_after_the_grace(
    start_agent: Callable[..., AgentProcess], holders: Callable[..., Holder], tmp_path: Path
) -> None:
    agent = start_agent("--migrate-grace", "1")
    c = agent.client()
    gpu0, gpu1 = (g["uuid"] for g in c.node()["gpus"])
    notebook_holding(agent, holders, "0.25", "1", 10)
    b, b_proc = notebook_holding(agent, holders, "0.25", "1", 10)
    assert b["physical_gpu"] == gpu1
    _, cursor = c.directives(client="jupyter", after=-1, timeout=0)
    out = tmp_path / "job.txt"
    job = run_job(agent, out)
    assert job.wait(timeout=30) == 0
    assert out.read_text() == gpu1
    assert not b_proc.alive()
    found, _ = c.directives(client="jupyter", after=cursor, timeout=0)
    assert [x["kind"] for x in found] == ["migrate", "killed"]
    killed = found[1]
    assert killed["cause"] == "migrate_timeout" and "OOM" not in killed["reason"]
    assert "its move from GPU 1 to GPU 0 did not finish within 1s" in killed["reason"]
    assert "not a memory problem" in killed["reason"] and killed["stops_in_window"] == 0
    # The lease survives, pointed at its new GPU, ready for the kernel to restart there.
    lease = c.lease(b["id"])
    assert (lease["state"], lease["physical_gpu"]) == ("killed", gpu0)
    restarted = holders(CUDA_VISIBLE_DEVICES=gpu0)
    assert c.register_pid(b["id"], restarted.pid)["state"] == "active"
