"""Usage: what a stopped or replaced process held is free the moment the agent knows it is gone;
what a kernel starts counts as its; compute use; and the notices its follower hears.

A killed kernel restarts in a spare within a tenth of a second and asks the agent for room
to restore into; it must not wait for the agent's next measurement to get it. Each test runs
the agent with a poll interval longer than the checks take, so no measurement can hide a
stale figure.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from harness.agent import AgentProcess, wait_for
from node_agent.client import AgentError
from node_agent.quantities import parse_quantity
from node_agent.service import ACTIONS, NOTICES, Agent, Caller, Resize

from ..conftest import Holder, notebook_holding, until_stopped
from .conftest import ME, ask

MiB = 2**20


def _used(agent: AgentProcess, uuid: str) -> int:
    return int(next(g for g in agent.client().node()["gpus"] if g["uuid"] == uuid)["memory_used"])


def test_a_borrower_killed_by_reclaim_frees_its_memory_at_once(
    start_agent: Callable[..., AgentProcess], holders: Callable[..., Holder]
) -> None:
    # Polls 3 s apart: the checks after the kill take a fraction of that.
    # Kills are the fallback where freezing cannot be used (test_freezing.py freezes instead).
    agent = start_agent("--poll-interval", "3", "--reclaim-grace", "0.5", "--headroom", "0.25",
                        "--no-freeze", spec="1x1GiB")
    c = agent.client()
    owner, owner_proc = notebook_holding(agent, holders, "512Mi", "1", 100)
    borrower, _ = notebook_holding(agent, holders, "128Mi", "1", 450)
    notebook_holding(agent, holders, "128Mi", "1", 1)
    gpu = borrower["physical_gpu"]
    _, cursor = c.directives(client="jupyter", after=-1, timeout=0)
    owner_proc.hold(300)  # the owner grows into what the borrower holds
    found = until_stopped(c, cursor, client="jupyter")
    assert [d["kind"] for d in found] == ["shrink", "killed"]
    assert found[1]["cause"] == "reclaim"
    assert found[1]["usage"] > 450 * MiB, "the notice says what it held"

    # Right after the kill, before any measurement: nothing of the borrower counts.
    assert c.lease(borrower["id"])["usage"] == 0
    assert _used(agent, gpu) < 500 * MiB, "the GPU no longer counts the killed 450 MiB"
    # The owner may grow into all of it (the GPU less what the quiet lease is owed).
    assert c.lease(owner["id"])["room"] > 450 * MiB
    # The kernel restarts at once and asks for room to restore into: its request at least.
    restarted = holders(CUDA_VISIBLE_DEVICES=gpu)
    lease = c.register_pid(borrower["id"], restarted.pid)
    assert (lease["state"], lease["usage"]) == ("active", 0)
    assert c.lease(borrower["id"])["room"] >= 128 * MiB


def test_a_kernel_stopped_for_a_move_that_timed_out_restarts_with_room(
    start_agent: Callable[..., AgentProcess], holders: Callable[..., Holder]
) -> None:
    # No poll at all within the test: the agent measures only at the move's deadline.
    agent = start_agent("--poll-interval", "3600", "--migrate-grace", "0.5")
    c = agent.client()
    gpu0, gpu1 = (g["uuid"] for g in c.node()["gpus"])
    notebook_holding(agent, holders, "0.25", "1", 10)
    moving, _ = notebook_holding(agent, holders, "0.25", "1", 400)
    assert moving["physical_gpu"] == gpu1
    _, cursor = c.directives(client="jupyter", after=-1, timeout=0)
    job = c.create_lease(client="job", kind="job", request="1")
    found = until_stopped(c, cursor, client="jupyter")
    assert [d["kind"] for d in found] == ["migrate", "killed"]
    assert found[1]["cause"] == "migrate_timeout"
    assert found[1]["usage"] > 400 * MiB, "measured at the deadline, before the kill"

    lease = c.lease(moving["id"])
    assert (lease["state"], lease["physical_gpu"], lease["usage"]) == ("killed", gpu0, 0)
    assert _used(agent, gpu1) == 0, "the job's GPU is empty"
    assert c.lease(job["id"])["state"] == "active"
    restarted = holders(CUDA_VISIBLE_DEVICES=gpu0)
    c.register_pid(moving["id"], restarted.pid)
    # What the killed process held on GPU 1 is not charged against its limit on GPU 0:
    # all of GPU 0 but the other notebook's 10 MiB and the headroom is its to restore into.
    assert c.lease(moving["id"])["room"] > 900 * MiB


@pytest.mark.parametrize("moved", [False, True])
def test_a_restarted_kernel_starts_from_what_its_new_process_holds(
    start_agent: Callable[..., AgentProcess], holders: Callable[..., Holder], moved: bool
) -> None:
    """The Jupyter server restarts a kernel itself (a restart, a move): the old process ended
    without the agent's doing, and the new one is registered; then, for a move, reported done."""
    agent = start_agent("--poll-interval", "3")
    c = agent.client()
    gpu1 = c.node()["gpus"][1]["uuid"]
    notebook_holding(agent, holders, "0.25", "1", 10)
    lease, old = notebook_holding(agent, holders, "0.25", "1", 400)
    assert lease["physical_gpu"] == gpu1
    wait_for(lambda: c.lease(lease["id"])["usage"] > 400 * MiB, what="the 400 MiB measured")
    # Within the next 3 s, no poll measures anything again.
    target = gpu1
    if moved:
        _, cursor = c.directives(client="jupyter", after=-1, timeout=0)
        c.create_lease(client="job", kind="job", request="1")
        found, _ = c.directives(client="jupyter", after=cursor, timeout=5)
        assert [(d["kind"], d["lease_id"]) for d in found] == [("migrate", lease["id"])]
        target = found[0]["to_gpu"]
    old.stop()
    new = holders(CUDA_VISIBLE_DEVICES=target)
    assert c.register_pid(lease["id"], new.pid)["usage"] == 0
    if moved:
        assert c.migrated(lease["id"])["usage"] == 0
    assert _used(agent, gpu1) == 0, "the ended process's 400 MiB no longer counts"
    assert c.lease(lease["id"])["room"] > 900 * MiB


def test_a_move_reported_done_counts_only_what_runs_on_the_new_gpu(
    start_agent: Callable[..., AgentProcess], holders: Callable[..., Holder]
) -> None:
    """The old process may still be ending when the move is reported: what it holds on the GPU
    it left is not the lease's usage on the one it runs on now."""
    agent = start_agent("--poll-interval", "3")
    c = agent.client()
    notebook_holding(agent, holders, "0.25", "1", 10)
    lease, old = notebook_holding(agent, holders, "0.25", "1", 400)
    wait_for(lambda: c.lease(lease["id"])["usage"] > 400 * MiB, what="the 400 MiB measured")
    _, cursor = c.directives(client="jupyter", after=-1, timeout=0)
    c.create_lease(client="job", kind="job", request="1")
    found, _ = c.directives(client="jupyter", after=cursor, timeout=5)
    assert [(d["kind"], d["lease_id"]) for d in found] == [("migrate", lease["id"])]
    new = holders(CUDA_VISIBLE_DEVICES=found[0]["to_gpu"])
    c.register_pid(lease["id"], new.pid)
    moved = c.migrated(lease["id"])
    assert old.alive() and moved["physical_gpu"] == found[0]["to_gpu"]
    assert moved["usage"] == 0
    assert c.lease(lease["id"])["room"] > 900 * MiB


def kinds(agent: Agent) -> list[tuple[str, dict[str, object]]]:
    directives, _ = asyncio.run(
        agent.wait_directives(ME, client="t", lease_id=None, after=0, timeout=0,
                              kinds=(*ACTIONS, *NOTICES)))
    return [(d.kind, d.body) for d in directives]


def test_the_follower_hears_of_a_new_share_and_of_a_burst_as_they_happen(
    agent: Agent, holders: Callable[..., Holder]
) -> None:
    """No polling: a resize and the start of a burst each leave one notice for the lease."""
    lease = agent.create_lease(ME, ask("0.25", "1"))
    agent.resize(ME, lease.id, Resize(request=parse_quantity("0.5", "request")))
    [(kind, body)] = kinds(agent)
    assert kind == "resized" and (body["request_spec"], body["limit_spec"]) == ("0.5", "1")
    kernel = holders(CUDA_VISIBLE_DEVICES=lease.physical[0])
    agent.register_pid(Caller(uid=0, admin=True), lease.id, kernel.pid)  # root's process
    kernel.hold(600)  # above its request of 512 MiB
    asyncio.run(agent.tick())
    kernel.hold(0)
    asyncio.run(agent.tick())
    kernel.hold(600)
    asyncio.run(agent.tick())  # bursting again at once: not said twice in a minute
    said = [body for kind, body in kinds(agent) if kind == "bursting"]
    assert len(said) == 1 and said[0]["usage"] > 600 * 2**20
    assert said[0]["request"] == 2 * lease.request
    # Asked for by default are only the directives that ask for something.
    actions, last = asyncio.run(
        agent.wait_directives(ME, client="t", lease_id=None, after=0, timeout=0))
    assert actions == [] and last == 2, "notices skipped, and not read again"


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
