"""`gpufrac-agent run` at agent level, with real processes: waiting out an agent restart while a
notebook moves for it, stopped while it waits, and the caps it hands to other frameworks."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from harness.agent import AgentProcess, wait_for

from .conftest import Holder, notebook_holding, run_job

MiB = 2**20


@pytest.mark.parametrize("when", ["asking", "waiting"])
def test_run_waits_out_an_agent_restart_and_leaves_no_lease(
    start_agent: Callable[..., AgentProcess], holders: Callable[..., Holder], tmp_path: Path,
    when: str,
) -> None:
    # A spread notebook whose client never moves it: the job waits for the migrate deadline.
    agent = start_agent("--migrate-grace", "6")
    c = agent.client()
    notebook_holding(agent, holders, "0.25", "1", 10)
    spread, spread_proc = notebook_holding(agent, holders, "0.25", "1", 10)
    out = tmp_path / "job.txt"
    said: list[str] = []

    def follow(job: subprocess.Popen[str]) -> threading.Thread:
        reader = threading.Thread(target=lambda: said.extend(job.stderr or ()), daemon=True)
        reader.start()
        return reader

    if when == "asking":
        agent.kill()  # SIGKILL: `run` finds it gone when it asks for its lease
        job = run_job(agent, out)
        reader = follow(job)
        wait_for(lambda: "waiting for it" in "".join(said).lower(), 30,
                 "run to wait for the agent")
        agent.start()  # same socket, same ledger
    else:
        job = run_job(agent, out)
        reader = follow(job)
        wait_for(lambda: any(x["kind"] == "job" and x["pids"] for x in c.leases()),
                 what="the job lease")
        agent.kill()  # SIGKILL while `run` waits for its lease
        agent.start()
    assert job.wait(timeout=60) == 0, "".join(said)
    reader.join(10)
    assert out.read_text() == spread["physical_gpu"]
    assert "waiting for it" in "".join(said).lower()
    assert [x for x in agent.client().leases() if x["kind"] == "job"] == []
    assert not spread_proc.alive()


def test_run_stopped_while_waiting_gives_its_lease_back(
    start_agent: Callable[..., AgentProcess], holders: Callable[..., Holder], tmp_path: Path
) -> None:
    agent = start_agent("--migrate-grace", "120")
    c = agent.client()
    notebook_holding(agent, holders, "0.25", "1", 10)
    notebook_holding(agent, holders, "0.25", "1", 10)
    job = run_job(agent, tmp_path / "never.txt")
    # Its pid registered: `run` holds the lease's id and waits (before that, a lease whose
    # answer it never read is an orphan, which --orphan-grace releases instead).
    wait_for(lambda: any(x["kind"] == "job" and x["pids"] for x in c.leases()),
             what="the job lease")
    job.terminate()
    assert job.wait(timeout=30) == 128 + signal.SIGTERM
    assert [x["kind"] for x in c.leases()] == ["notebook", "notebook"]
    assert job.stderr is not None and "stopped by SIGTERM" in job.stderr.read()


def test_run_caps_other_frameworks_at_the_limit_less_the_context(
    start_agent: Callable[..., AgentProcess], tmp_path: Path
) -> None:
    agent = start_agent(spec="1x2GiB:context=200Mi")
    out = tmp_path / "env.json"
    names = ["XLA_PYTHON_CLIENT_PREALLOCATE", "XLA_PYTHON_CLIENT_MEM_FRACTION",
             "CUPY_GPU_MEMORY_LIMIT", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"]
    script = (f"import json, os; open({str(out)!r}, 'w').write(json.dumps("
              f"{{n: os.environ.get(n) for n in {names!r}}}))")
    done = subprocess.run(
        [sys.executable, "-m", "node_agent", "--socket", agent.socket, "run", "--gpus", "1",
         "--request", "1Gi", "--", sys.executable, "-c", script],
        capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert json.loads(out.read_text()) == {
        "XLA_PYTHON_CLIENT_PREALLOCATE": "false",
        "XLA_PYTHON_CLIENT_MEM_FRACTION": f"{(1024 - 200) / 2048:.4f}",
        "CUPY_GPU_MEMORY_LIMIT": str((1024 - 200) * MiB),
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=1024M",
    }


