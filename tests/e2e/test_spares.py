"""A moved notebook starts in a pre-warmed spare kernel; no spare outlives its server."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from harness.agent import AgentProcess, wait_for
from harness.jupyter import Server, start_server, stop_server

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]

CONFIG = (
    "c.GpuFrac.migrate_grace_period = 3\n"
    "c.GpuFrac.lease_poll_interval = 1\n"
    "c.GpuFrac.spare_kernels = True\n"
)
STATE = """
import os, torch
t = torch.arange(6, dtype=torch.float32)
model = torch.nn.Linear(3, 1)
print("PID", os.getpid())
"""
CHECK = """
import os, sys
assert torch.equal(t, torch.arange(6, dtype=torch.float32)) and isinstance(model, torch.nn.Linear)
print("PID", os.getpid(), os.environ["CUDA_VISIBLE_DEVICES"], os.environ["JPY_PARENT_PID"])
"""


def pids_logged(server: Server, pattern: str) -> list[int]:
    return [int(pid) for pid in re.findall(pattern, server.log_text())]


def spares_started(server: Server) -> list[int]:
    return pids_logged(server, r"starting spare kernel (\d+)")


def spares_ready(server: Server) -> list[int]:
    return pids_logged(server, r"spare kernel (\d+) ready in")


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def move_one(agent: AgentProcess, server: Server, more: str = "") -> tuple[str, int, list[str]]:
    """Two notebooks spread over both GPUs, a whole-GPU job: (moved kernel, its new pid, output)."""
    notebooks = [server.open_notebook(f"n{i}.ipynb") for i in range(2)]
    for nb in notebooks:
        nb.ok(STATE + more)
    wait_for(lambda: spares_ready(server), 60, "a spare kernel to be ready", interval=0.2)
    job = subprocess.run(
        [sys.executable, "-m", "node_agent", "--socket", agent.socket, "run", "--gpus", "1",
         "--timeout", "120", "--", "true"], capture_output=True, text=True, timeout=180)
    assert job.returncode == 0, job.stderr
    [mover] = [nb for nb in notebooks if "migrated" in server.events(nb.kernel_id)]
    # The next cell goes at once, as a script's would: a restore in a spare can take 80 ms,
    # and the page's connection must have found the new process by then (see _reconnect_soon).
    wait_for(lambda: "restored" in server.events(mover.kernel_id), 60, "the restore", interval=0.01)
    words = next(line.split() for line in mover.ok(CHECK).splitlines() if line.startswith("PID "))
    for nb in notebooks:
        nb.close()
    return mover.kernel_id, int(words[1]), words[2:]


# The user's own module: importing it leaves a mark, with the process and kernel it ran in.
USERS_MODULE = """
import os
with open(os.path.join(os.path.dirname(__file__), "imported.txt"), "a") as f:
    f.write(f"{os.getpid()} {os.environ.get('GPUFRAC_KERNEL_ID', '-')}\\n")
"""


def test_a_move_starts_in_the_spare_and_the_server_reaps_every_spare(tmp_path: Path) -> None:
    mods = tmp_path / "mods"
    mods.mkdir()
    (mods / "notes_helper.py").write_text(USERS_MODULE)
    env = {"PYTHONPATH": os.pathsep.join([str(mods), str(REPO)])}
    with AgentProcess(tmp_path / "agent", "2x2GiB",
                      ["--poll-interval", "0.2", "--migrate-grace", "90"]) as agent:
        server = start_server(tmp_path / "server", agent.socket, CONFIG, env=env)
        try:
            spares = server.get("/api/gpufrac/node")["spares"]
            assert spares["max"] >= 1 and isinstance(spares["spares"], list)
            kernel_id, pid, (gpu, parent) = move_one(agent, server, "import yaml, notes_helper")
            # Made ready for this kernel before its launch: what it had imported that is
            # installed (yaml), never the user's own module, which ran only in kernels.
            ready = re.search(rf"spare kernel {pid} ready for kernel {kernel_id} .*", server.log_text())
            assert ready and "yaml" in ready.group(0), server.log_text()[-3000:]
            assert re.search(rf"spare kernel {pid} left to the kernel: .*notes_helper: not an "
                             "installed package", server.log_text())
            marks = (mods / "imported.txt").read_text().split()
            assert marks and all(kernel != "-" for kernel in marks[1::2]), marks
            assert str(pid) in marks[0::2]  # the restore imported it, in the kernel
            # The moved kernel runs in the spare that was ready, on the GPU it was moved to,
            # with its variables, under the same kernel id and websocket.
            assert pid in spares_ready(server)
            assert f"kernel {kernel_id}: started in spare kernel process {pid}" in server.log_text()
            assert gpu == server.kernel_status(kernel_id)["gpu"]["uuid"]
            assert parent == str(server.process.pid)
            # A replacement follows in the background.
            wait_for(lambda: len(spares_ready(server)) >= 2, 60, "a replacement spare", interval=0.2)
        finally:
            stop_server(server)
        started = spares_started(server)
        assert len(started) >= 2
        for spare in started:
            wait_for(lambda s=spare: gone(s), 10, f"spare {spare} to be reaped", interval=0.1)
        assert re.search(r"reaped \d+ spare kernel", server.log_text())


def test_a_server_killed_outright_leaves_no_spare_and_no_kernel_behind(tmp_path: Path) -> None:
    """SIGKILL: nobody reaps. Spares read EOF on their order pipe; a kernel started in a spare
    watches its parent as any kernel does (ipykernel reads JPY_PARENT_PID at import)."""
    with AgentProcess(tmp_path / "agent", "2x2GiB",
                      ["--poll-interval", "0.2", "--migrate-grace", "90"]) as agent:
        server = start_server(tmp_path / "server", agent.socket, CONFIG)
        try:
            _, adopted, _ = move_one(agent, server)
            wait_for(lambda: len(spares_ready(server)) >= 2, 60, "a replacement spare", interval=0.2)
            kernels = [p.pid for p in psutil.Process(server.process.pid).children()]
            server.process.send_signal(signal.SIGKILL)
            server.process.wait(30)
        finally:
            stop_server(server)
        assert adopted in kernels
        for pid in {*kernels, *spares_started(server)}:
            wait_for(lambda p=pid: gone(p), 20, f"process {pid} to exit", interval=0.1)
