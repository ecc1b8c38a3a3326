"""On a real GPU through a real Jupyter server: park, reclaim and a whole-GPU job by freezing.

``pytest -m gpu tests/gpu`` runs these where CUDA is and the driver has its checkpoint API
(r570 / CUDA 12.8); elsewhere they skip, saying why. The kernels hold a few hundred MiB each so
that the driver's copies stay short; what takes the GPU memory of an owner is never written.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import pytest

from harness.agent import AgentProcess, nvml_memory_of, wait_for
from harness.jupyter import Notebook, running_server
from node_agent.client import AgentClient

pytestmark = pytest.mark.gpu

MiB, GiB = 2**20, 2**30
# What a frozen process may still show on the GPU (the driver's figure was 4 MiB).
FROZEN_MAX = 64 * MiB
# Floats in each notebook's tensor: 256 MiB.
N = 64 * MiB


def _probe() -> tuple[int, str | None]:
    """CUDA devices, and why the driver cannot freeze (None: it can); asked in a fresh process
    so that no CUDA state enters pytest's own."""
    code = ("import json, torch\n"
            "from node_agent.devices.cuda import DriverFreezer\n"
            "n = torch.cuda.device_count() if torch.cuda.is_available() else 0\n"
            "print(json.dumps([n, DriverFreezer().unavailable() if n else None]))")
    try:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              timeout=120)
    except subprocess.TimeoutExpired:
        return 0, None
    if done.returncode != 0:
        return 0, None
    count, why = json.loads(done.stdout.strip().splitlines()[-1])
    return int(count), why


DEVICES, CANNOT_FREEZE = _probe()
if not DEVICES:
    pytest.skip("no CUDA device here", allow_module_level=True)
if CANNOT_FREEZE:
    pytest.skip(f"the driver cannot freeze processes: {CANNOT_FREEZE}", allow_module_level=True)

# A notebook's state: GPU tensors, an open file read half-way, a generator part-drawn.
STATE = """
import os, torch
x = torch.arange({n}, dtype=torch.float32, device="cuda") * {k}
y = torch.full((1024, 1024), 3.0, device="cuda")
log = open({path!r})
first = log.readline().strip()
gen = (i * i for i in range(10))
drawn = [next(gen), next(gen)]
torch.cuda.synchronize()
print("PID", os.getpid(), "FIRST", first, "DRAWN", drawn)
"""
# The same state after a thaw: read on the host, so that nothing new is allocated on the GPU
# (a kernel asked to shrink keeps its cap at its request), then a new GPU kernel where allowed.
CHECK = """
assert x.device.type == "cuda" and y.device.type == "cuda", (x.device, y.device)
assert torch.equal(x.cpu(), torch.arange({n}, dtype=torch.float32) * {k})
assert float(y.cpu().sum()) == 3.0 * 1024 * 1024
{compute}print("PID", os.getpid(), "LINE", log.readline().strip(), "NEXT", next(gen))
"""
COMPUTE = "assert float((y * 2).sum()) == 6.0 * 1024 * 1024  # a new kernel, thawed context\n"


def _lines(path: Path) -> str:
    path.write_text("one\ntwo\nthree\n")
    return str(path)


def _hold(nb: Notebook, path: Path, k: int = 1) -> int:
    """Give the notebook its state; returns its kernel's pid."""
    out = nb.ok(STATE.format(n=N, k=k, path=_lines(path)), timeout=180)
    words = out.split()
    assert words[2:4] == ["FIRST", "one"] and "[0, 1]" in out, out
    return int(words[1])


def _check(nb: Notebook, pid: int, k: int = 1, compute: bool = True) -> str:
    """The notebook's next cell: the tensors, the file and the generator as they were, in the
    same process; returns what it printed."""
    out = nb.ok(CHECK.format(n=N, k=k, compute=COMPUTE if compute else ""), timeout=180)
    assert f"PID {pid} LINE two NEXT 4" in out, out
    return out


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _lease_of(c: AgentClient, kernel_id: str) -> dict[str, Any]:
    return next(x for x in c.leases() if x.get("kernel_id") == kernel_id)


def _active(c: AgentClient, kernel_id: str) -> dict[str, Any] | None:
    """The kernel's lease once it is active again, else None."""
    lease = _lease_of(c, kernel_id)
    return lease if lease["state"] == "active" else None


def _usable(c: AgentClient) -> int:
    gpu = c.node()["gpus"][0]
    return int(gpu["memory_total"]) - int(gpu.get("memory_reserved") or 0)


def _hold_other_gpus(c: AgentClient) -> None:
    """On a node of several GPUs, whole-GPU leases on all but one: the test's notebooks then
    share one GPU and have nowhere else to go, as on a one-GPU node."""
    for _ in range(len(c.node()["gpus"]) - 1):
        c.create_lease(client="gpu-test", kind="job", name="holds another GPU")


def _not_simulated(c: AgentClient) -> None:
    node = c.node()
    assert node["simulated"] is False, f"the agent simulates a node instead of NVML: {node}"


@contextlib.contextmanager
def nvml_agent(tmp_path: Path, *args: str) -> Iterator[AgentProcess]:
    """An agent on NVML with ``args``, one GPU left to the test's notebooks."""
    # Leases that never register a process (the other GPUs' holders) must outlive the test.
    with AgentProcess(tmp_path / "agent", None,
                      ["--poll-interval", "0.2", "--orphan-grace", "3600", *args]) as agent:
        c = agent.client()
        _not_simulated(c)
        _hold_other_gpus(c)
        yield agent


def test_park_freezes_the_kernel_and_its_next_cell_thaws_it_with_everything_kept(
    tmp_path: Path,
) -> None:
    """``%gpu park`` through the server's embedded agent on NVML: the kernel's process gives
    the GPU back (NVML sees nothing of it) and keeps running; the next cell thaws it in place,
    its tensors, open file and generator as they were."""
    socket = str(tmp_path / "a" / "agent.sock")  # nothing answers there: the server starts one
    config = ("c.GpuFrac.lease_poll_interval = 0.5\n"
              "c.GpuFrac.embedded_agent_simulate = ''\n")  # NVML or nothing
    with running_server(tmp_path / "server", socket, config) as server:
        c = AgentClient(socket)
        # The server starts its embedded agent in the background.
        wait_for(c.ping, 60, "the embedded agent to answer", interval=0.2)
        _not_simulated(c)
        nb = server.open_notebook("park.ipynb")
        pid = _hold(nb, tmp_path / "lines.txt")
        lease = _lease_of(c, nb.kernel_id)
        assert lease["state"] == "active" and pid in lease["pids"]
        wait_for(lambda: nvml_memory_of(pid) > N * 4, 30, "NVML to see the kernel's tensors")

        started = time.monotonic()
        assert "parking once this cell ends" in nb.ok("%gpu park")
        frozen = wait_for(lambda: (x := _lease_of(c, nb.kernel_id))["frozen"] and x, 120,
                          "the kernel to be frozen", interval=0.1)
        print(f"%gpu park until frozen: {time.monotonic() - started:.2f} s")
        assert (frozen["state"], frozen["physical_gpus"], frozen["pids"]) == ("parked", [], [pid])
        assert frozen["protection"] == "frozen in host memory" and not frozen["fallback"]
        assert frozen["frozen_bytes"] >= N * 4 and frozen["frozen_gpus"] == [lease["physical_gpu"]]
        assert nvml_memory_of(pid) < FROZEN_MAX and _alive(pid)
        wait_for(lambda: server.kernel_status(nb.kernel_id)["state"] == "parked", 30,
                 "the server to say parked", interval=0.2)
        assert "parked" in server.events(nb.kernel_id)
        # The kernel hears of the freeze on its own channel: a user's next cell comes later.
        time.sleep(1)

        started = time.monotonic()
        out = _check(nb, pid)
        print(f"first cell after the park: {time.monotonic() - started:.2f} s")
        assert "The process waited frozen in host memory" in out, out
        back = _lease_of(c, nb.kernel_id)
        assert back["state"] == "active" and not back["frozen"] and back["pids"] == [pid]
        assert back["physical_gpus"] == [lease["physical_gpu"]]
        assert nvml_memory_of(pid) > N * 4
        wait_for(lambda: "unparked" in server.events(nb.kernel_id), 30, "the unparked event",
                 interval=0.2)
        nb.close()


def test_reclaim_freezes_a_borrower_instead_of_killing_it_and_it_thaws_when_room_returns(
    tmp_path: Path,
) -> None:
    """An owner grows within its guarantee into memory a borrower holds: the borrower is asked
    to shrink, then frozen (not killed) after the grace; once the owner gives the memory back
    it thaws by itself, the same process with the same tensors."""
    with nvml_agent(tmp_path, "--reclaim-grace", "2", "--headroom", "0.5", "--no-node-scheduler") as agent:
        c = agent.client()
        usable = _usable(c)
        # The owner is guaranteed all but 1 GiB; the borrower, guaranteed 256 MiB, holds more than
        # that 1 GiB with its context. Reclaim starts once free memory is under half the GPU (the
        # headroom) while the owner is owed more than is free: the owner's tensor takes it there.
        owner_request = usable - GiB
        grow = int(max(GiB, 0.5 * usable - 2 * GiB)) + GiB
        specs = {"borrower": {"gpufrac": {"request": "256Mi", "limit": "1"}},
                 "owner": {"gpufrac": {"request": str(owner_request), "limit": str(owner_request)}}}
        config = "c.GpuFrac.lease_poll_interval = 0.5\n"
        with running_server(tmp_path / "server", agent.socket, config, specs) as server:
            borrower = server.open_notebook("borrower.ipynb", kernel="borrower")
            pid = _hold(borrower, tmp_path / "lines.txt", k=3)
            # 1 GiB more, so that its loan is far above the margins of the arithmetic above.
            borrower.ok("z = torch.ones(2**28, device='cuda'); torch.cuda.synchronize()")
            b_lease = _lease_of(c, borrower.kernel_id)
            wait_for(lambda: _lease_of(c, borrower.kernel_id)["bursting"], 30, "the borrower to burst")
            owner = server.open_notebook("owner.ipynb", kernel="owner")
            owner_pid = int(owner.ok("import os, torch\nprint(os.getpid())").strip())
            assert _lease_of(c, owner.kernel_id)["physical_gpu"] == b_lease["physical_gpu"]

            started = time.monotonic()
            owner.ok(f"mine = torch.empty({grow}, dtype=torch.uint8, device='cuda')\n"
                     "torch.cuda.synchronize()")
            frozen = wait_for(lambda: (x := _lease_of(c, borrower.kernel_id))["frozen"] and x, 120,
                              "the borrower to be frozen", interval=0.1)
            print(f"owner's allocation until the borrower was frozen: "
                  f"{time.monotonic() - started:.2f} s (a 2 s grace included)")
            assert frozen["state"] == "pending" and frozen["physical_gpus"] == []
            assert "frozen to return" in frozen["reason"] and frozen["pids"] == [pid]
            assert frozen["frozen_bytes"] >= N * 4 + GiB
            assert nvml_memory_of(pid) < FROZEN_MAX and _alive(pid)
            wait_for(lambda: "frozen" in server.events(borrower.kernel_id), 30, "the frozen event",
                     interval=0.2)
            kinds = server.events(borrower.kernel_id)
            assert "oom_killed" not in kinds and kinds.index("shrink_requested") < kinds.index("frozen")
            assert owner.ok("print(os.getpid(), mine.numel())").split() == [str(owner_pid), str(grow)]

            # Room returns: the borrower thaws by itself, before any cell of it asks.
            owner.ok("del mine\ntorch.cuda.empty_cache()")
            back = wait_for(lambda: (x := _lease_of(c, borrower.kernel_id))["state"] == "active"
                            and x, 120, "the borrower to thaw once room returned", interval=0.1)
            assert not back["frozen"] and back["pids"] == [pid]
            assert back["physical_gpus"] == [b_lease["physical_gpu"]]
            assert nvml_memory_of(pid) > N * 4 + GiB
            # Shrunk to its request, it may not allocate: the check reads on the host only.
            _check(borrower, pid, k=3, compute=False)
            assert borrower.ok("print(bool((z.cpu() == 1).all()))").strip() == "True"
            assert "oom_killed" not in server.events(borrower.kernel_id)
            borrower.close()
            owner.close()


def test_a_whole_gpu_job_freezes_two_notebooks_runs_and_they_thaw_intact(
    tmp_path: Path,
) -> None:
    """``gpufrac-agent run --gpus 1`` on a one-GPU node shared by two notebooks: both are
    frozen, the job runs with the GPU to itself, and when it ends both thaw, the same
    processes with the same tensors."""
    with nvml_agent(tmp_path, "--poll-interval", "0.5") as agent:
        c = agent.client()
        config = "c.GpuFrac.lease_poll_interval = 0.5\n"
        with running_server(tmp_path / "server", agent.socket, config) as server:
            books = [server.open_notebook(f"nb{k}.ipynb") for k in (1, 2)]
            pids = [_hold(nb, tmp_path / f"lines{k}.txt", k=k) for k, nb in enumerate(books, 1)]
            gpu = _lease_of(c, books[0].kernel_id)["physical_gpu"]
            assert _lease_of(c, books[1].kernel_id)["physical_gpu"] == gpu

            ran, release = tmp_path / "job-ran", tmp_path / "job-may-end"
            job_code = (
                "import os, sys, time, torch\n"
                "t = torch.ones(2**28, device='cuda'); torch.cuda.synchronize()\n"
                f"open({str(ran)!r}, 'w').write(os.environ['CUDA_VISIBLE_DEVICES'])\n"
                "deadline = time.monotonic() + 180\n"
                f"while not os.path.exists({str(release)!r}) and time.monotonic() < deadline:\n"
                "    time.sleep(0.1)\n"
                "sys.exit(0 if float(t.sum()) == 2**28 else 3)\n")
            started = time.monotonic()
            job = subprocess.Popen(
                [sys.executable, "-m", "node_agent", "--socket", agent.socket, "run", "--gpus",
                 "1", "--timeout", "120", "--", sys.executable, "-c", job_code],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            try:
                wait_for(lambda: ran.exists() or job.poll() is not None, 150, "the job to run",
                         interval=0.1)
                assert ran.exists(), job.communicate(timeout=30)
                print(f"job asked for the GPU until it ran: {time.monotonic() - started:.2f} s")
                assert ran.read_text() == gpu
                for nb, pid in zip(books, pids, strict=True):
                    lease = _lease_of(c, nb.kernel_id)
                    assert lease["frozen"] and lease["state"] == "pending", lease
                    assert lease["frozen_gpus"] == [gpu] and lease["physical_gpus"] == []
                    assert "frozen in host memory" in lease["reason"], lease["reason"]
                    assert nvml_memory_of(pid) < FROZEN_MAX and _alive(pid)
                shares = next(g for g in c.node()["gpus"] if g["uuid"] == gpu)["shares"]
                assert [s["kind"] for s in shares] == ["job"], shares
            finally:
                release.touch()
            out, err = job.communicate(timeout=60)
            assert job.returncode == 0, (out, err)

            for nb, pid in zip(books, pids, strict=True):
                back = wait_for(partial(_active, c, nb.kernel_id), 120,
                                "a notebook to thaw after the job", interval=0.1)
                assert not back["frozen"] and back["physical_gpus"] == [gpu] and back["pids"] == [pid]
            for k, (nb, pid) in enumerate(zip(books, pids, strict=True), 1):
                _check(nb, pid, k=k)
                kinds = server.events(nb.kernel_id)
                assert "frozen" in kinds and "oom_killed" not in kinds and "migrating" not in kinds
                nb.close()
