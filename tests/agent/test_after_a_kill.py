"""What a stopped or replaced process held is free the moment the agent knows it is gone.

A killed kernel restarts in a spare within a tenth of a second and asks the agent for room
to restore into; it must not wait for the agent's next measurement to get it. Each test runs
the agent with a poll interval longer than the checks take, so no measurement can hide a
stale figure.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from harness.agent import AgentProcess, wait_for

from .conftest import Holder, notebook_holding

MiB = 2**20


def _used(agent: AgentProcess, uuid: str) -> int:
    return int(next(g for g in agent.client().node()["gpus"] if g["uuid"] == uuid)["memory_used"])


def test_a_borrower_killed_by_reclaim_frees_its_memory_at_once(
    start_agent: Callable[..., AgentProcess], holders: Callable[..., Holder]
) -> None:
    # Polls 3 s apart: the checks after the kill take a fraction of that.
    # Kills are the fallback where freezing cannot be used (test_freeze.py freezes instead).
    agent = start_agent("--poll-interval", "3", "--reclaim-grace", "0.5", "--headroom", "0.25",
                        "--no-freeze", spec="1x1GiB")
    c = agent.client()
    owner, owner_proc = notebook_holding(agent, holders, "512Mi", "1", 100)
    borrower, _ = notebook_holding(agent, holders, "128Mi", "1", 450)
    notebook_holding(agent, holders, "128Mi", "1", 1)
    gpu = borrower["physical_gpu"]
    _, cursor = c.directives(client="jupyter", after=-1, timeout=0)
    owner_proc.hold(300)  # the owner grows into what the borrower holds
    found, cursor = c.directives(client="jupyter", after=cursor, timeout=20)
    assert [d["kind"] for d in found] == ["shrink"]
    found, cursor = c.directives(client="jupyter", after=cursor, timeout=20)
    assert [(d["kind"], d["cause"]) for d in found] == [("killed", "reclaim")]
    assert found[0]["usage"] > 450 * MiB, "the notice says what it held"

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
    found, _ = c.directives(client="jupyter", after=cursor, timeout=20)
    assert [d["kind"] for d in found] == ["migrate"]
    found, _ = c.directives(client="jupyter", after=found[-1]["seq"], timeout=20)
    assert [(d["kind"], d["cause"]) for d in found] == [("killed", "migrate_timeout")]
    assert found[0]["usage"] > 400 * MiB, "measured at the deadline, before the kill"

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
