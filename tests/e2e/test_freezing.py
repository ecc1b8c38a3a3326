"""A whole-GPU job on a one-GPU node, through a real server: the two notebooks in its way are
frozen (their processes, open files, generators and threads kept), a cell sent meanwhile waits
visibly, and both thaw when the job ends with nothing restarted."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from harness.agent import AgentProcess, wait_for
from harness.jupyter import start_server, stop_server

pytestmark = pytest.mark.e2e

CONFIG = "c.GpuFrac.lease_poll_interval = 0.5\nc.GpuFrac.default_request = '0.25'\n"
# What a checkpoint cannot carry: an open file, a generator half-way, a live thread.
STATE = """
import os, threading, time, torch
t = torch.arange(6, dtype=torch.float32) * {n}
f = open(os.devnull)
g = iter(range(100)); next(g)
stop = threading.Event()
ticks = []
worker = threading.Thread(target=lambda: [ticks.append(1) or time.sleep(0.05)
                                          for _ in iter(stop.is_set, True)], daemon=True)
worker.start()
print("PID", os.getpid())
"""
CHECK = """
assert torch.equal(t, torch.arange(6, dtype=torch.float32) * {n})
assert not f.closed and next(g) == 1 and worker.is_alive()
print("PID", os.getpid())
"""


def test_a_whole_gpu_job_on_a_one_gpu_node_freezes_two_notebooks_and_thaws_them(
    tmp_path: Path,
) -> None:
    with AgentProcess(tmp_path / "agent", "1x4GiB", ["--poll-interval", "0.2"]) as agent:
        server = start_server(tmp_path / "server", agent.socket, CONFIG)
        c = agent.client()
        try:
            books = [server.open_notebook(f"nb{n}.ipynb") for n in (1, 2)]
            pids = [int(nb.ok(STATE.format(n=n)).split()[1]) for n, nb in enumerate(books, 1)]
            gate = tmp_path / "go"
            job = subprocess.Popen(
                [sys.executable, "-m", "node_agent", "--socket", agent.socket, "run", "--gpus",
                 "1", "--timeout", "60", "--", sys.executable, "-c",
                 f"import os, time\nwhile not os.path.exists({str(gate)!r}): time.sleep(0.05)"],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            # The job waits while they are frozen, then runs: nobody was refused or restarted.
            wait_for(lambda: any(x["kind"] == "job" and x["state"] == "active"
                                 for x in c.leases()), 60, "the job to run", interval=0.1)
            for nb in books:
                lease = next(x for x in c.leases() if x.get("kernel_id") == nb.kernel_id)
                assert lease["frozen"] and lease["physical_gpus"] == []
                wait_for(lambda nb=nb: "frozen" in server.events(nb.kernel_id), 30,
                         "the server to tell of the freeze", interval=0.1)
                status = server.kernel_status(nb.kernel_id)
                assert status["protection"] == "frozen in host memory"
                assert status["state"] == "waiting-for-gpu"
            # A cell sent to a frozen kernel waits, saying why, and runs once it is thawed.
            cell = books[0].send(CHECK.format(n=1))
            said = books[0].printed(cell, "waiting for a GPU")
            assert "held whole by" in said
            gate.touch()
            assert job.wait(60) == 0, job.stderr.read() if job.stderr else ""
            reply = books[0].wait(cell, timeout=60)
            assert reply.status == "ok", reply.error
            # Why first (the freeze, with the job it was for), then the way back.
            said = reply.stdout.split("\n")
            assert said[0].startswith("gpufrac: frozen in host memory at ") and "job" in said[0]
            assert "thawed (" in reply.stdout and "Nothing was restarted" in reply.stdout
            assert int(reply.stdout.split("PID")[1].split()[0]) == pids[0]
            # The other notebook thawed by itself meanwhile: its next cell, however late, says
            # it was frozen and is back, once.
            wait_for(lambda: "unparked" in server.events(books[1].kernel_id), 30,
                     "the second notebook thawed", interval=0.1)
            out = books[1].ok(CHECK.format(n=2))
            news = out.split("\n")
            assert news[0].startswith("gpufrac: frozen in host memory at ") and "job" in news[0]
            assert news[1].startswith("gpufrac: thawed at ") and ", back on GPU " in news[1]
            assert int(out.split("PID")[1].split()[0]) == pids[1]
            assert books[1].ok("print('again')") == "again\n"
            for nb in books:
                wait_for(lambda nb=nb: "unparked" in server.events(nb.kernel_id), 30,
                         "the thaw told", interval=0.1)
                assert "oom_killed" not in server.events(nb.kernel_id)
                assert "restored" not in server.events(nb.kernel_id)
            for nb in books:
                nb.close()
        finally:
            stop_server(server)


def test_a_frozen_kernel_whose_process_dies_comes_back_from_its_durable_checkpoint(
    tmp_path: Path,
) -> None:
    """Frozen GPU state lives in the kernel's own process: when the host's OOM killer (here a
    SIGKILL) takes it, the checkpoint written before the freeze brings the variables back."""
    config = CONFIG + "c.GpuFrac.park_after = 1\n"
    with AgentProcess(tmp_path / "agent", "1x4GiB", ["--poll-interval", "0.2"]) as agent:
        server = start_server(tmp_path / "server", agent.socket, config)
        c = agent.client()
        try:
            nb = server.open_notebook("dies.ipynb")
            pid = int(nb.ok("import os, torch\nt = torch.arange(4.0)\nprint('PID', os.getpid())")
                      .split()[1])

            def lease() -> dict[str, object]:
                return next(x for x in c.leases() if x.get("kernel_id") == nb.kernel_id)

            wait_for(lambda: lease()["frozen"], 60, "the idle kernel frozen", interval=0.1)
            os.kill(pid, signal.SIGKILL)
            wait_for(lambda: not lease()["frozen"] and lease()["pids"] not in ([], [pid]), 60,
                     "the kernel restarted, its frozen state gone", interval=0.1)
            assert lease()["state"] == "parked" and "frozen process ended" in str(
                lease()["fallback"])
            out = nb.ok("assert torch.equal(t, torch.arange(4.0)); print('PID', os.getpid())",
                        timeout=120)
            assert int(out.split("PID")[1].split()[0]) != pid
            assert "back on GPU" in out
            nb.close()
        finally:
            stop_server(server)
