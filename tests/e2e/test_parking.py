"""An idle notebook gives its GPU back and keeps its kernel: parked (frozen where the agent can
freeze, else restarted without a GPU), then back on a GPU."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from harness.agent import AgentProcess, wait_for
from harness.jupyter import Notebook, Server, start_server, stop_server
from jupyter_gpufrac import contract

pytestmark = pytest.mark.e2e

CONFIG = (
    "c.GpuFrac.park_after = 2\n"
    "c.GpuFrac.lease_poll_interval = 0.5\n"
    "c.GpuFrac.migrate_grace_period = 3\n"
)
STATE = """
import os, random, torch
random.seed(7)
t = torch.arange(6, dtype=torch.float32)
model = torch.nn.Linear(3, 1)
names = {"a": [1, 2], "t": t}
print("PID", os.getpid())
"""
CHECK = """
assert torch.equal(t, torch.arange(6, dtype=torch.float32)) and names["t"] is t
assert isinstance(model, torch.nn.Linear) and names["a"] == [1, 2]
print("DRAW", random.random())
print("PID", os.getpid(), "GPUS", os.environ["CUDA_VISIBLE_DEVICES"])
"""


def lease_of(agent: AgentProcess, kernel_id: str) -> dict[str, Any]:
    return next(lease for lease in agent.client().leases() if lease.get("kernel_id") == kernel_id)


def status_json(agent: AgentProcess) -> dict[str, Any]:
    done = subprocess.run([sys.executable, "-m", "node_agent", "--socket", agent.socket, "status",
                           "--json"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return dict(json.loads(done.stdout))


def job(agent: AgentProcess, gpus: int, *command: str) -> subprocess.Popen[str]:
    """A whole-GPU job through the agent, as a batch user starts one."""
    return subprocess.Popen(
        [sys.executable, "-m", "node_agent", "--socket", agent.socket, "run", "--gpus", str(gpus),
         "--timeout", "60", "--", *command], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True)


def parked(server: Server, agent: AgentProcess, nb: Notebook) -> dict[str, Any]:
    wait_for(lambda: lease_of(agent, nb.kernel_id)["state"] == "parked", 60,
             "the idle kernel to be parked", interval=0.2)
    wait_for(lambda: server.kernel_status(nb.kernel_id)["state"] == "parked", 30,
             "the server to say parked", interval=0.2)
    return lease_of(agent, nb.kernel_id)


@pytest.mark.parametrize("freeze", [True, False], ids=["frozen", "restarted"])
def test_an_idle_kernel_gives_its_gpu_back_and_its_next_cell_gets_one_first(
    tmp_path: Path, freeze: bool
) -> None:
    args = ["--poll-interval", "0.2", *([] if freeze else ["--no-freeze"])]
    with AgentProcess(tmp_path / "agent", "2x2GiB", args) as agent:
        server = start_server(tmp_path / "server", agent.socket, CONFIG)
        try:
            nb = server.open_notebook("park.ipynb")
            first_pid = int(nb.ok(STATE).split()[1])
            # What an undisturbed kernel would draw next, for the comparison after the park.
            drawn = nb.run("state = random.getstate(); print(random.random()); "
                           "random.setstate(state)")
            assert drawn.status == "ok" and isinstance(drawn.execution_count, int), drawn
            expected = drawn.stdout.strip()
            lease = parked(server, agent, nb)
            assert lease["physical_gpus"] == [] and lease["usage"] == 0
            assert lease["request"] > 0  # what it will need again
            shown = next(x for x in status_json(agent)["leases"] if x["id"] == lease["id"])
            assert shown["state"] == "parked" and shown["physical_gpus"] == []
            kept = "frozen in host memory" if freeze else "checkpoint on disk"
            assert lease["frozen"] is freeze and shown["protection"] == kept
            assert server.kernel_status(nb.kernel_id)["protection"] == kept
            if not freeze:
                assert "freezing is turned off" in shown["fallback"]
            assert "parked" in server.events(nb.kernel_id)
            # A parked kernel never blocks a job: both GPUs whole, at once, nobody moved.
            whole = job(agent, 2, "true")
            assert whole.wait(90) == 0, whole.stderr.read() if whole.stderr else ""
            assert "migrating" not in server.events(nb.kernel_id)
            # The next cell gets a GPU first, then runs with every variable and the same draws,
            # numbered after the last (thawed, or restarted from the checkpoint).
            reply = nb.run(CHECK)
            assert reply.status == "ok", reply.error
            assert reply.execution_count == drawn.execution_count + 1
            out = reply.stdout
            assert "gpufrac: back on GPU" in out, out
            draw = next(line.split()[1] for line in out.splitlines() if line.startswith("DRAW"))
            assert draw == expected
            words = next(line.split() for line in out.splitlines() if line.startswith("PID"))
            active = lease_of(agent, nb.kernel_id)
            assert active["state"] == "active" and words[3] == ",".join(active["physical_gpus"])
            if freeze:  # the very process, thawed
                assert int(words[1]) == first_pid and "thawed (" in out
                # When and why it was parked, then the way back, however late the cell.
                assert out.startswith("gpufrac: parked at "), out
            else:  # a process that had not touched CUDA
                assert int(words[1]) != first_pid
            wait_for(lambda: "unparked" in server.events(nb.kernel_id), 30, "the unparked event",
                     interval=0.2)
            assert server.kernel_status(nb.kernel_id)["state"] in ("guaranteed", "bursting")
            assert "this kernel runs on GPU" in nb.ok("%gpu unpark")
            nb.close()
        finally:
            stop_server(server)


@pytest.mark.parametrize("freeze", [True, False], ids=["frozen", "restarted"])
def test_a_cell_waits_for_a_gpu_visibly_can_be_cancelled_and_runs_once_there_is_room(
    tmp_path: Path, freeze: bool
) -> None:
    args = ["--poll-interval", "0.2", *([] if freeze else ["--no-freeze"])]
    with AgentProcess(tmp_path / "agent", "2x2GiB", args) as agent:
        server = start_server(tmp_path / "server", agent.socket,
                              CONFIG.replace("park_after = 2", "park_after = 0"))
        try:
            nb = server.open_notebook("wait.ipynb")
            nb.ok(STATE)
            out = nb.ok("%gpu park")
            assert "parking once this cell ends, as you asked." in out
            parked(server, agent, nb)
            # The user's own park, told as one (not as an idle kernel's).
            told = wait_for(lambda: [e["message"] for e in server.kernel_status(nb.kernel_id)[
                "events"] if e["event"] == "parked"], 30, "the parked event", interval=0.2)
            assert told[-1].startswith("Parked at its user's request (`%gpu park`)"), told
            holder = job(agent, 2, sys.executable, "-c", "import time; time.sleep(600)")
            wait_for(lambda: any(x.get("kind") != "notebook" and x["state"] == "active"
                                 for x in agent.client().leases()), 60, "the job to start")
            # No GPU has room: the cell says so and waits; an interrupt stops the wait.
            cell = nb.send(CHECK)
            nb.printed(cell, "waiting for a GPU")
            assert server.api(f"/api/kernels/{nb.kernel_id}/interrupt", "POST")[0] == 204
            reply = nb.wait(cell)
            assert reply.status == "error" and "stopped waiting for a GPU" in reply.error
            assert "PID" not in reply.stdout  # the cell did not run
            assert lease_of(agent, nb.kernel_id)["state"] == "parked"
            # Waiting again; the job ends, the agent places the kernel, the cell runs.
            cell = nb.send(CHECK)
            nb.printed(cell, "waiting for a GPU")
            holder.terminate()
            holder.wait(30)
            reply = nb.wait(cell, timeout=90)
            assert reply.status == "ok", reply.error
            assert "gpufrac: back on GPU" in reply.stdout and "PID" in reply.stdout
            assert lease_of(agent, nb.kernel_id)["state"] == "active"
            nb.close()
        finally:
            stop_server(server)


def gpu_says(nb: Notebook) -> tuple[str, str | None]:
    """The ``state:`` and ``last:`` lines of ``%gpu``, as the notebook prints them."""
    lines = [line.strip() for line in nb.ok("%gpu").splitlines()]
    state = next(line for line in lines if line.startswith("state:"))
    return state, next((line for line in lines if line.startswith("last:")), None)


@pytest.mark.parametrize("freeze", [True, False], ids=["frozen", "restarted"])
def test_gpu_says_what_the_kernel_view_says_after_a_park_and_its_unpark(
    tmp_path: Path, freeze: bool
) -> None:
    args = ["--poll-interval", "0.2", *([] if freeze else ["--no-freeze"])]
    with AgentProcess(tmp_path / "agent", "2x2GiB", args) as agent:
        server = start_server(tmp_path / "server", agent.socket,
                              CONFIG.replace("park_after = 2", "park_after = 0"))
        try:
            nb = server.open_notebook("account.ipynb")
            nb.ok(STATE)
            # The event of its first launch, written once the kernel manager lists it.
            wait_for(lambda: "Running on GPU" in str(gpu_says(nb)[1]), 30,
                     "%gpu to tell where the kernel started", interval=0.2)
            nb.ok("%gpu park")
            parked(server, agent, nb)
            # The next cell gets the kernel a GPU (a restarted one: a process that has not
            # received an account yet); the server then sends it its account.
            assert "gpufrac: back on GPU" in nb.ok("print('back')")
            wait_for(lambda: "unparked" in server.events(nb.kernel_id), 30, "the unparked event",
                     interval=0.2)
            wait_for(lambda: "Back on GPU" in str(gpu_says(nb)[1]), 30, "%gpu to tell the unpark",
                     interval=0.2)
            state, last = gpu_says(nb)
            view = server.kernel_status(nb.kernel_id)
            words = contract.KERNEL_STATE_WORDS[view["state"]]
            reason = f" ({view['reason'].rstrip('.')})" if view["reason"] else ""
            assert state == f"state:   {words}{reason}", (state, view["state"], view["reason"])
            assert last is not None and last.endswith(f" ago: {view['last_event']['message']}")
            assert view["last_event"]["event"] == "unparked", view["last_event"]
            nb.close()
        finally:
            stop_server(server)
