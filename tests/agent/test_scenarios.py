"""The headline flows at agent level, with real processes: compaction for a job, and reclaim."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from harness.agent import AgentProcess, wait_for
from node_agent.client import AgentClient, AgentError

from .conftest import Holder, notebook_holding

MiB = 2**20


def _run_job(agent: AgentProcess, out: Path) -> subprocess.Popen[str]:
    script = f"import os, pathlib; pathlib.Path({str(out)!r}).write_text(os.environ['CUDA_VISIBLE_DEVICES'])"
    return subprocess.Popen(
        [sys.executable, "-m", "node_agent", "--socket", agent.socket, "run", "--gpus", "1", "--",
         sys.executable, "-c", script],
        stderr=subprocess.PIPE, text=True,
    )


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
    job = _run_job(agent, out)
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
    job = _run_job(agent, out)
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


def _reclaim_setup(
    start_agent: Callable[..., AgentProcess], holders: Callable[..., Holder], *args: str
) -> tuple[AgentProcess, dict, Holder, dict, Holder, dict, Holder]:
    # Kills are the fallback where freezing cannot be used (test_freeze.py freezes instead).
    agent = start_agent("--reclaim-grace", "1", "--headroom", "0.25", "--no-freeze", *args,
                        spec="1x1GiB")
    owner, owner_proc = notebook_holding(agent, holders, "512Mi", "512Mi", 100)
    borrower, borrower_proc = notebook_holding(agent, holders, "128Mi", "1", 450)
    quiet, quiet_proc = notebook_holding(agent, holders, "128Mi", "1", 1)
    c = agent.client()
    wait_for(lambda: c.lease(borrower["id"])["bursting"], what="borrower bursting")
    assert c.lease(borrower["id"])["state"] == "active", "no reclaim while nobody is owed"
    return agent, owner, owner_proc, borrower, borrower_proc, quiet, quiet_proc


@pytest.mark.parametrize("scheduler", ["--node-scheduler", "--no-node-scheduler"])
def test_reclaim_shrinks_then_kills_a_borrower(
    start_agent: Callable[..., AgentProcess], holders: Callable[..., Holder], scheduler: str
) -> None:
    """Reclaim is the same whether the node scheduler spreads notebooks or not."""
    agent, owner, owner_proc, borrower, borrower_proc, quiet, quiet_proc = _reclaim_setup(
        start_agent, holders, scheduler)
    c = agent.client()
    _, cursor = c.directives(client="jupyter", after=-1, timeout=0)
    owner_proc.hold(300)  # the owner grows into memory the borrower holds
    found, cursor = c.directives(client="jupyter", after=cursor, timeout=10)
    assert [(d["kind"], d["lease_id"]) for d in found] == [("shrink", borrower["id"])]
    shrink = found[0]
    assert shrink["request"] == 128 * MiB and shrink["usage"] > 128 * MiB
    assert "above its request" in shrink["reason"]
    found, _ = c.directives(client="jupyter", after=cursor, timeout=10)
    assert [(d["kind"], d["lease_id"]) for d in found] == [("killed", borrower["id"])]
    killed = found[0]
    assert killed["cause"] == "reclaim" and "stopped to return" in killed["reason"]
    assert (killed["stops_in_window"], killed["kill_window"]) == (1, 600)
    assert killed["pids"] == [borrower_proc.pid] and killed["gpu"] == borrower["physical_gpu"]
    wait_for(lambda: not borrower_proc.alive(), what="borrower killed")
    assert c.lease(borrower["id"])["state"] == "killed"
    # The owner and the lease under its request are untouched.
    assert owner_proc.alive() and quiet_proc.alive()
    assert c.lease(owner["id"])["state"] == "active" and c.lease(quiet["id"])["state"] == "active"


def test_a_borrower_that_shrinks_is_spared(
    start_agent: Callable[..., AgentProcess], holders: Callable[..., Holder]
) -> None:
    agent, _owner, owner_proc, borrower, borrower_proc, _quiet, _ = _reclaim_setup(
        start_agent, holders)
    c = agent.client()
    _, cursor = c.directives(lease=borrower["id"], after=-1, timeout=0)
    owner_proc.hold(300)
    found, cursor = c.directives(lease=borrower["id"], after=cursor, timeout=10)
    assert [d["kind"] for d in found] == ["shrink"]
    borrower_proc.hold(0)  # complies: lets go of its loan
    wait_for(lambda: c.lease(borrower["id"])["state"] == "active", what="back to active")
    # RSS falls over a few reads, so the pressure may be gone before all of the loan is.
    assert c.lease(borrower["id"])["reason"] in ("gave its loan back",
                                                 "the owner no longer needs the memory")
    assert c.directives(lease=borrower["id"], after=cursor, timeout=1.5)[0] == []
    assert borrower_proc.alive()


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
        job = _run_job(agent, out)
        reader = follow(job)
        wait_for(lambda: "waiting for it" in "".join(said).lower(), 30,
                 "run to wait for the agent")
        agent.start()  # same socket, same ledger
    else:
        job = _run_job(agent, out)
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
    job = _run_job(agent, tmp_path / "never.txt")
    # Its pid registered: `run` holds the lease's id and waits (before that, a lease whose
    # answer it never read is an orphan, which --orphan-grace releases instead).
    wait_for(lambda: any(x["kind"] == "job" and x["pids"] for x in c.leases()),
             what="the job lease")
    job.terminate()
    assert job.wait(timeout=30) == 128 + signal.SIGTERM
    assert [x["kind"] for x in c.leases()] == ["notebook", "notebook"]
    assert job.stderr is not None and "stopped by SIGTERM" in job.stderr.read()


def _come_back(c: AgentClient, holders: Callable[..., Holder], lease: dict, old: Holder) -> Holder:
    """The kernel restarts: a new process registered to the same lease (a restore grace)."""
    old.stop()
    new = holders()
    back = c.register_pid(lease["id"], new.pid)
    assert back["restore_until"] > time.time() + 30, "the default grace is 60 s"
    return new


def test_a_restoring_kernel_is_spared_while_another_borrower_covers(
    start_agent: Callable[..., AgentProcess], holders: Callable[..., Holder]
) -> None:
    agent = start_agent("--reclaim-grace", "1", "--headroom", "0.25", "--no-freeze",
                        spec="1x1GiB")
    c = agent.client()
    owner, owner_proc = notebook_holding(agent, holders, "512Mi", "512Mi", 100)
    settled, settled_proc = notebook_holding(agent, holders, "128Mi", "1", 1)
    restoring, restoring_proc = notebook_holding(agent, holders, "128Mi", "1", 1)
    assert settled["restore_until"] is None, "a first start restores nothing"
    restoring_proc = _come_back(c, holders, restoring, restoring_proc)
    restoring_proc.hold(300)
    settled_proc.hold(300)
    wait_for(lambda: c.lease(settled["id"])["bursting"] and c.lease(restoring["id"])["bursting"],
             what="both bursting")
    _, cursor = c.directives(client="jupyter", after=-1, timeout=0)
    owner_proc.hold(300)  # owed 112 MiB, ~20 MiB free: the settled borrower's loan covers it
    found, cursor = c.directives(client="jupyter", after=cursor, timeout=10)
    assert [(d["kind"], d["lease_id"]) for d in found] == [("shrink", settled["id"])]
    found, cursor = c.directives(client="jupyter", after=cursor, timeout=10)
    assert [(d["kind"], d["lease_id"]) for d in found] == [("killed", settled["id"])]
    # Its memory is back; the restoring kernel was never asked.
    assert c.directives(lease=restoring["id"], after=0, timeout=1)[0] == []
    assert restoring_proc.alive() and c.lease(restoring["id"])["state"] == "active"
    assert c.lease(owner["id"])["state"] == "active"


def test_a_restoring_kernel_still_gives_back_when_nothing_else_covers(
    start_agent: Callable[..., AgentProcess], holders: Callable[..., Holder]
) -> None:
    # The owner's guarantee comes before the grace: the only borrower is shrunk, then killed.
    agent, owner, owner_proc, borrower, borrower_proc, _quiet, _ = _reclaim_setup(
        start_agent, holders)
    c = agent.client()
    borrower_proc = _come_back(c, holders, borrower, borrower_proc)
    borrower_proc.hold(450)
    wait_for(lambda: c.lease(borrower["id"])["bursting"], what="restoring and bursting")
    _, cursor = c.directives(lease=borrower["id"], after=-1, timeout=0)
    owner_proc.hold(300)
    found, cursor = c.directives(lease=borrower["id"], after=cursor, timeout=10)
    assert [d["kind"] for d in found] == ["shrink"]
    found, _ = c.directives(lease=borrower["id"], after=cursor, timeout=10)
    assert [d["kind"] for d in found] == ["killed"]
    wait_for(lambda: not borrower_proc.alive(), what="the borrower killed")
    assert owner_proc.alive() and c.lease(owner["id"])["state"] == "active"


def test_the_third_stop_in_the_window_says_why_and_what_to_do(
    start_agent: Callable[..., AgentProcess], holders: Callable[..., Holder]
) -> None:
    agent = start_agent("--reclaim-grace", "0.5", "--headroom", "0.25", "--restore-grace", "0",
                        "--no-freeze", spec="1x1GiB")
    c = agent.client()
    owner, owner_proc = notebook_holding(agent, holders, "512Mi", "512Mi", 400)
    borrower, proc = notebook_holding(agent, holders, "128Mi", "1", 1)
    notebook_holding(agent, holders, "128Mi", "1", 1)
    _, cursor = c.directives(lease=borrower["id"], after=-1, timeout=0)
    stops: list[tuple[dict, dict]] = []
    for n in range(3):
        if n == 2:
            # The kill times are in the ledger: an agent restart does not forget them.
            agent.kill()
            agent.start()
            # A simulated GPU measures from re-adoption on: the owner holds its 400 MiB anew.
            owner_proc.stop()
            owner_proc = holders()
            c.register_pid(owner["id"], owner_proc.pid)
            owner_proc.hold(400)
        proc.hold(450)  # the kernel comes back and restores what it held: too much again
        shrink = None
        while True:
            found, cursor = c.directives(lease=borrower["id"], after=cursor, timeout=10)
            assert found, "a reclaim directive"
            shrink = next((d for d in found if d["kind"] == "shrink"), shrink)
            killed = [d for d in found if d["kind"] == "killed"]
            if killed:
                assert shrink is not None
                stops.append((shrink, killed[0]))
                break
        wait_for(lambda p=proc: not p.alive(), what="the borrower killed")
        proc = holders()
        c.register_pid(borrower["id"], proc.pid)
    for shrink, killed in stops[:2]:
        assert "stop of this kernel" not in shrink["reason"] + killed["reason"]
    shrink, killed = stops[2]
    assert [k["stops_in_window"] for _, k in stops] == [1, 2, 3]
    assert shrink["stops_in_window"] == 2
    assert ("If it does not shrink, this will be the 3rd stop of this kernel within 10 minutes"
            in shrink["reason"])
    assert "This is the 3rd stop of this kernel within 10 minutes" in killed["reason"]
    for text in (shrink["reason"], killed["reason"]):
        assert "the state it restores needs more than its request of 128.0 MiB" in text
        assert "`%gpu request 512Mi`" in text and "free memory" in text


def test_four_quarter_shares_that_use_all_of_them_are_never_disturbed(
    start_agent: Callable[..., AgentProcess], holders: Callable[..., Holder]
) -> None:
    """A GPU as real ones are: the driver keeps a reserve and every process pays a CUDA context.
    Shares are cut from what processes can hold and count their context, as NVML's per-process
    figures do, so four quarter shares used to the last byte fit and nobody is a borrower."""
    agent = start_agent("--reclaim-grace", "0.5", "--headroom", "0.25",
                        spec="1x4GiB:reserved=528Mi:context=500Mi")
    c = agent.client()
    gpu = c.node()["gpus"][0]
    assert (gpu["memory_reserved"], gpu["context_size"]) == (528 * MiB, 500 * MiB)
    usable = 4 * 1024 * MiB - 528 * MiB
    _, cursor = c.directives(client="jupyter", after=-1, timeout=0)
    kernels = [notebook_holding(agent, holders, "0.25", "0.25", 0) for _ in range(4)]
    assert all(abs(lease["request"] - usable // 4) < MiB for lease, _ in kernels)
    with pytest.raises(AgentError) as refused:
        c.create_lease(client="jupyter", request="0.25")
    assert refused.value.status == 409 and refused.value.field == "request"
    for lease, proc in kernels:
        # Everything the share leaves beside the context (less a little for the interpreter).
        proc.hold(lease["request"] // MiB - 500 - 16)
    wait_for(lambda: all(c.lease(lease["id"])["usage"] > lease["request"] - 40 * MiB
                         for lease, _ in kernels), what="all four using their whole share")
    found, _ = c.directives(client="jupyter", after=cursor, timeout=2)
    assert found == [], [d["reason"] for d in found]
    for lease, proc in kernels:
        now = c.lease(lease["id"])
        assert proc.alive() and now["state"] == "active" and not now["bursting"], now


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


def test_a_lease_above_its_limit_is_asked_back_then_stopped_with_nobody_owed(
    start_agent: Callable[..., AgentProcess], holders: Callable[..., Holder]
) -> None:
    """What no allocator cap holds (JAX without its variables, a child process, raw CUDA) is
    caught by measurement: the same ladder as a reclaim, though no other lease is owed."""
    agent = start_agent("--reclaim-grace", "0.5", "--enforce-limits", "--no-freeze",
                        spec="1x2GiB")
    c = agent.client()
    lease, proc = notebook_holding(agent, holders, "128Mi", "256Mi", 0)
    _, cursor = c.directives(client="jupyter", after=-1, timeout=0)
    proc.hold(100)
    assert c.directives(client="jupyter", after=cursor, timeout=1)[0] == [], "within its limit"
    proc.hold(300)
    found, cursor = c.directives(client="jupyter", after=cursor, timeout=10)
    assert [(d["kind"], d["cause"]) for d in found] == [("shrink", "limit")]
    assert "above its limit of 256.0 MiB" in found[0]["reason"]
    found, _ = c.directives(client="jupyter", after=cursor, timeout=10)
    assert [(d["kind"], d["cause"]) for d in found] == [("killed", "limit")]
    assert "stayed" in found[0]["reason"] and "above its limit of 256.0 MiB" in found[0]["reason"]
    wait_for(lambda: not proc.alive(), what="the process over its limit stopped")
    assert c.lease(lease["id"])["state"] == "killed"


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


# A kernel that starts a worker (a DataLoader worker, `!python train.py`) once told to.
PARENT = """
import subprocess, sys, time
sys.stdin.readline()
child = subprocess.Popen([sys.executable, "-c",
    "import sys, time\\nx = bytearray(400 * 2**20)\\nx[::4096] = b'x' * len(x[::4096])\\n"
    "print('held', flush=True)\\ntime.sleep(600)"])
print(child.pid, flush=True)
time.sleep(600)
"""


def test_what_a_kernel_starts_uses_its_share_and_goes_with_it(
    start_agent: Callable[..., AgentProcess]
) -> None:
    agent = start_agent("--reclaim-grace", "0.5", "--enforce-limits", spec="1x2GiB")
    c = agent.client()
    lease = c.create_lease(client="jupyter", request="128Mi", limit="256Mi")
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        c.register_pid(lease["id"], parent.pid)
        assert parent.stdin is not None and parent.stdout is not None
        parent.stdin.write("go\n")
        parent.stdin.flush()
        child = int(parent.stdout.readline())
        assert parent.stdout.readline().strip() == "held"
        # Not registered, yet counted: it is the kernel's.
        wait_for(lambda: c.lease(lease["id"])["usage"] > 300 * MiB, what="the child counted")
        def killed() -> dict | None:
            found, _ = c.directives(lease=lease["id"], after=0, timeout=1)
            return next((d for d in found if d["kind"] == "killed"), None)

        stop = wait_for(killed, what="the lease stopped above its limit")
        assert stop["cause"] == "limit" and child in stop["pids"]
        wait_for(lambda: parent.poll() is not None and not _alive(child),
                 what="the kernel and what it started stopped")
    finally:
        parent.kill()
        parent.wait()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(") ")[1][0] != "Z"
    except OSError:
        return False


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


def test_a_compute_share_is_recorded_measured_and_shown(
    start_agent: Callable[..., AgentProcess], holders: Callable[..., Holder], tmp_path: Path
) -> None:
    """Run:ai's dynamic fractions cover compute too: the share is kept with the lease, the
    processes' utilization is measured against it (the simulated node samples CPU use), and
    status, metrics and `run` carry it; without CUDA MPS it is said to be unenforced."""
    agent = start_agent()
    c = agent.client()
    lease = c.create_lease(client="t", request="0.25", limit="0.5", compute_request="0.25",
                           compute_limit="0.5")
    assert (lease["compute_request"], lease["compute_limit"]) == (0.25, 0.5)
    # Registered first, then it touches the device (8 MiB) and keeps it busy.
    busy = subprocess.Popen([sys.executable, "-c", "import sys\nsys.stdin.readline()\n"
                             "x = bytearray(8 << 20)\nx[::4096] = b'x' * len(x[::4096])\n"
                             "while True: x[0] = (x[0] + 1) % 256"],
                            stdin=subprocess.PIPE, text=True)
    try:
        c.register_pid(lease["id"], busy.pid)
        assert busy.stdin is not None
        busy.stdin.write("go\n")
        busy.stdin.flush()
        wait_for(lambda: (c.lease(lease["id"])["compute_usage"] or 0) >= 50,
                 what="the busy process's utilization to be measured")
    finally:
        busy.kill()
        busy.wait()
    status = subprocess.run([sys.executable, "-m", "node_agent", "--socket", agent.socket,
                             "status"], capture_output=True, text=True, check=True).stdout
    assert "% of 0.25-0.5" in status
    assert "compute shares: recorded, not enforced (no CUDA MPS on this node)" in status
    from prometheus_client.parser import text_string_to_metric_families

    assert [s.value for f in text_string_to_metric_families(c.metrics()) for s in f.samples
            if s.name == "gpufrac_lease_compute_limit_ratio" and s.labels["lease"] == lease["id"]
            ] == [0.5]
    # A compute share is a fraction, whole, with its limit not below its request.
    for body, field in (({"compute_request": "4Gi"}, "compute_request"),
                        ({"compute_request": "0.5", "compute_limit": "0.25"}, "compute_limit"),
                        ({"compute_limit": "0.5"}, "compute_limit")):
        with pytest.raises(AgentError) as bad:
            c.create_lease(client="t", request="0.25", **body)
        assert (bad.value.status, bad.value.field) == (400, field)
    # `run` hands the compute limit to CUDA MPS.
    out = tmp_path / "env"
    subprocess.run(
        [sys.executable, "-m", "node_agent", "--socket", agent.socket, "run", "--gpus", "1",
         "--compute", "0.3", "--", sys.executable, "-c",
         f"import os, pathlib; pathlib.Path({str(out)!r}).write_text("
         "os.environ['CUDA_MPS_ACTIVE_THREAD_PERCENTAGE'])"], check=True, timeout=60)
    assert out.read_text() == "30"
