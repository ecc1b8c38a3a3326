"""Headline: a whole-GPU job arrives, a notebook is moved, its variables and references survive."""

from __future__ import annotations

import json
import random
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from harness.agent import AgentProcess, wait_for
from harness.jupyter import Server, running_server

pytestmark = pytest.mark.e2e

STATE = """
import os, random, torch
torch.manual_seed(0)
random.seed(1)
shared = [1, 2, 3]
data = {"a": shared, "b": shared, "text": "hello"}
t = torch.arange(10, dtype=torch.float32)
holder = {"t": t}
model = torch.nn.Linear(4, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
model(torch.ones(3, 4)).sum().backward()
opt.step()
weight_sum = float(model.weight.sum())
print("WHERE", os.getpid(), os.environ["CUDA_VISIBLE_DEVICES"])
"""

CHECK = """
import os
assert data["a"] is data["b"] is shared and shared == [1, 2, 3], "aliases"
assert holder["t"] is t and torch.equal(t, torch.arange(10, dtype=torch.float32)), "tensor"
assert opt.param_groups[0]["params"][0] is model.weight, "optimizer shares the parameters"
assert "momentum_buffer" in opt.state[model.weight], "optimizer state"
assert abs(float(model.weight.sum()) - weight_sum) < 1e-6, "weights"
print("WHERE", os.getpid(), os.environ["CUDA_VISIBLE_DEVICES"])
print("DRAWS", random.random(), float(torch.rand(1)))
"""


def where(output: str) -> list[str]:
    """The pid and GPU a cell printed (the first cell after a restore also shows why)."""
    return next(line.split()[1:] for line in output.splitlines() if line.startswith("WHERE "))


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[AgentProcess, Server]]:
    """One agent on a simulated 2x2GiB node and one server for the module."""
    tmp = tmp_path_factory.mktemp("migration")
    with AgentProcess(tmp / "agent", "2x2GiB", ["--poll-interval", "0.2", "--migrate-grace", "90"]) as agent:
        config = "c.GpuFrac.migrate_grace_period = 3\nc.GpuFrac.lease_poll_interval = 1\n"
        with running_server(tmp / "server", agent.socket, config) as server:
            yield agent, server


def test_job_moves_a_notebook_and_its_state_survives(
    node: tuple[AgentProcess, Server], tmp_path: Path
) -> None:
    agent, server = node
    server_pid = server.process.pid
    first, second = server.open_notebook("first.ipynb"), server.open_notebook("second.ipynb")
    before = {nb.kernel_id: where(nb.ok(STATE)) for nb in (first, second)}
    numbers = {nb.kernel_id: nb.run("1 + 1").execution_count for nb in (first, second)}
    # Spread: each notebook has a GPU of its own.
    assert {gpu for _, gpu in before.values()} == {
        gpu["uuid"] for gpu in server.get("/api/gpufrac/node")["gpus"]
    }

    out = tmp_path / "job-gpu"
    job = subprocess.run(
        [sys.executable, "-m", "node_agent", "--socket", agent.socket, "run", "--gpus", "1",
         "--timeout", "120", "--", "sh", "-c", f'echo "$CUDA_VISIBLE_DEVICES" > {out}; sleep 1'],
        capture_output=True, text=True, timeout=180,
    )
    assert job.returncode == 0, job.stderr

    moved = [nb for nb in (first, second) if "migrated" in server.events(nb.kernel_id)]
    assert len(moved) == 1, [server.events(nb.kernel_id) for nb in (first, second)]
    [mover] = moved
    [stayer] = [nb for nb in (first, second) if nb is not mover]
    freed = before[mover.kernel_id][1]
    # The job ran on the GPU the notebook left.
    assert out.read_text().strip() == freed

    def restored_status() -> dict[str, Any] | None:
        status = server.kernel_status(mover.kernel_id)
        return status if status["events"][-1]["event"] == "restored" else None

    status = wait_for(restored_status, 60, "the restore report", interval=0.2)
    kinds = [event["event"] for event in status["events"]]
    assert kinds[:4] == ["placed", "migrating", "migrated", "restored"], kinds
    restored = status["events"][-1]
    # Nothing of the user's was lost (interpreter bookkeeping such as __warningregistry__ aside).
    assert restored["lost"] == []
    assert {"shared", "data", "t", "holder", "model", "opt", "weight_sum"} <= set(restored["restored"])
    assert "free GPU" in restored["message"]
    assert re.search(r"; restored (\d+) of \1 variables\.", restored["message"]), restored["message"]
    assert status["state"] == "restored" and status["gpu"]["uuid"] != freed

    # Same kernel id, same websocket: the page never reconnected; its cell numbers go on.
    reply = mover.run(CHECK)
    assert reply.status == "ok", reply.error
    assert reply.execution_count == numbers[mover.kernel_id] + 1
    output = reply.stdout
    pid, gpu = where(output)
    # The generators continue exactly: the draws of a notebook that never moved.
    python_rng = random.Random(1)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        torch.nn.Linear(4, 2)  # the cell drew the model's initial weights from torch's generator
        expected = f"DRAWS {python_rng.random()} {float(torch.rand(1))}"
    assert expected in output, output
    assert pid != before[mover.kernel_id][0] and gpu == status["gpu"]["uuid"]
    # The first cell after the move tells the user what happened.
    assert "free GPU" in output
    # The other notebook and the server were not touched.
    assert where(stayer.ok(CHECK)) == before[stayer.kernel_id]
    assert "migrating" not in server.events(stayer.kernel_id)
    assert server.process.pid == server_pid and server.process.poll() is None
    for nb in (first, second):
        nb.close()


def test_busy_notebook_moves_after_the_grace_period_from_its_last_checkpoint(
    node: tuple[AgentProcess, Server],
) -> None:
    agent, server = node
    # The node is compacted after the first test: a new notebook gets the idle GPU.
    nb = server.open_notebook("busy.ipynb")
    gpu = where(nb.ok("import os\nsaved = 'before'\n%gpu checkpoint\n"
                      "print('WHERE', os.getpid(), os.environ['CUDA_VISIBLE_DEVICES'])"))[1]
    nb.send("unsaved = 'after'\nimport time\ntime.sleep(600)")
    job = subprocess.Popen(
        [sys.executable, "-m", "node_agent", "--socket", agent.socket, "run", "--gpus", "1",
         "--timeout", "120", "--", "sleep", "1"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    try:
        def restored() -> dict[str, Any] | None:
            status = server.kernel_status(nb.kernel_id)
            return status if status["events"][-1]["event"] == "restored" else None

        status = wait_for(restored, 90, "the busy notebook to be moved", interval=0.2)
        assert job.wait(60) == 0, job.stderr.read() if job.stderr else ""
    finally:
        if job.poll() is None:
            job.kill()
    assert status["gpu"]["uuid"] != gpu
    message = status["events"][-1]["message"]
    assert "the running cell [2] unsaved = 'after' was cut off: re-run it" in message, message
    assert "lost" not in message, message
    output = nb.ok("print(saved, 'unsaved' in globals())")
    assert "before False" in output
    nb.close()
    server.api(f"/api/kernels/{nb.kernel_id}", "DELETE")


def test_larger_request_moves_the_notebook(node: tuple[AgentProcess, Server]) -> None:
    _, server = node
    for kernel in server.get("/api/kernels"):  # start from an empty node
        server.api(f"/api/kernels/{kernel['id']}", "DELETE")
    # Spread: the first two notebooks get a GPU each, the third shares one with the first.
    notebooks = [server.open_notebook(f"n{i}.ipynb") for i in range(3)]
    grower = notebooks[2]
    gpus = [server.kernel_status(nb.kernel_id)["gpu"]["uuid"] for nb in notebooks]
    assert gpus[0] != gpus[1] and gpus[2] == gpus[0], gpus
    gpu = gpus[2]
    grower.ok("x = 41")
    # 0.8 of a GPU does not fit beside the first notebook's guarantee: the agent moves it.
    assert "moving this kernel" in grower.ok("%gpu request 0.8")

    def restored() -> dict[str, Any] | None:
        status = server.kernel_status(grower.kernel_id)
        return status if status["events"][-1]["event"] == "restored" else None

    status = wait_for(restored, 60, "the grown notebook to be moved", interval=0.2)
    assert status["gpu"]["uuid"] != gpu and status["lease"]["request_spec"] == "0.8"
    assert "because its request changed" in status["events"][-1]["message"]
    assert "request or limit changed" in grower.ok("print(x + 1)")
    for nb in notebooks:
        nb.close()
        server.api(f"/api/kernels/{nb.kernel_id}", "DELETE")


def test_gpu_request_errors_and_the_next_kernel_remembers(node: tuple[AgentProcess, Server]) -> None:
    agent, server = node
    nb = server.open_notebook("magic.ipynb")
    reply = nb.run("%gpu request lots")
    assert reply.status == "error" and "UsageError" in reply.error
    assert "request" in reply.error and "fraction" in reply.error
    reply = nb.run("%gpu request 0.5 --limit 0.25")
    assert reply.status == "error" and "limit" in reply.error and "at least the request" in reply.error
    # A change that fits where the kernel is: in place, for this notebook only unless asked,
    # and then the user's next kernel asks the same, as the answer says.
    folder = server.root.parent / "data" / "gpufrac" / "checkpoints"
    changed = nb.ok("%gpu request 0.3 --limit 0.5 --no-checkpoint")
    assert "now 0.3 of GPU " in changed and ": 614.4 MiB guaranteed, up to 1.0 GiB." in changed
    assert ("For this notebook only; `%gpu request 0.3 --limit 0.5 --remember` gives new "
            "notebooks here the same.") in changed
    assert not list(folder.glob("last-request-*.json"))
    changed = nb.ok("%gpu request 0.3 --limit 0.5 --remember --no-checkpoint")
    assert ("Request 0.3, limit 0.5 kept for new notebooks in this environment; "
            "`%gpu request --reset` forgets it.") in changed
    lease = server.kernel_status(nb.kernel_id)["lease"]
    assert (lease["request_spec"], lease["limit_spec"]) == ("0.3", "0.5")
    assert "(from %gpu request in this notebook)" in nb.ok("%gpu")
    # Remembered for this environment (the server's Python), in the user's own data folder.

    def remembered() -> Path | None:
        found = list(folder.glob("last-request-*.json"))
        return found[0] if found and json.loads(found[0].read_text())["request"] == "0.3" else None

    path = wait_for(remembered, 10, "the server to remember the request", interval=0.2)
    after = server.open_notebook("after.ipynb")
    status = server.kernel_status(after.kernel_id)
    assert (status["lease"]["request_spec"], status["lease"]["limit_spec"]) == ("0.3", "0.5")
    source = "your last %gpu request here"
    assert status["share_source"] == {"request": source, "limit": source}
    assert "(from your request remembered here)" in after.ok("%gpu")
    # --reset forgets it: the next kernel takes the server's default again.
    assert ("forgot your remembered request: new notebooks in this environment get the default "
            "share (request 0.25, limit 1) unless their kernelspec names one; this kernel keeps "
            "its own.") in after.ok("%gpu request --reset")
    assert not path.exists()
    fresh = server.open_notebook("fresh.ipynb")
    assert server.kernel_status(fresh.kernel_id)["share_source"]["request"] == "c.GpuFrac"

    # A remembered request no GPU has room for: the new kernel says that is why it has none
    # (not that the provisioner did not start it), and --reset there gets it a GPU.
    # Three notebooks (0.85) fill one GPU as the agent plans; 0.2 more goes on the other.
    filler = agent.client().create_lease(client="test", kind="notebook", request="0.2")
    path.write_text(json.dumps({"request": "0.9", "limit": None}))
    full = server.open_notebook("full.ipynb")
    status = server.kernel_status(full.kernel_id)
    assert status["lease"] is None
    said = "The agent had no room for your remembered request of 0.9 (1.8 GiB): no GPU has room"
    assert said in status["reason"], status
    shown = full.ok("%gpu")
    assert shown.startswith(f"gpufrac: no GPU lease. {said}"), shown
    assert "`%gpu request --reset` or a smaller `%gpu request`" in shown
    assert "provisioner" not in shown
    assert "this kernel, which has no GPU lease yet, asks for it too." in full.ok(
        "%gpu request --reset")
    wait_for(lambda: server.kernel_status(full.kernel_id)["lease"] is not None, 30,
             "a GPU for the kernel once the remembered request is forgotten", interval=0.2)
    agent.client().release(filler["id"])
    for notebook in (nb, after, fresh, full):
        notebook.close()
        server.api(f"/api/kernels/{notebook.kernel_id}", "DELETE")
