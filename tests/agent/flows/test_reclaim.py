"""Reclaim against a real agent, where freezing is off: shrink then stop a borrower, spare one
that shrinks or restores, say why at the third stop, and hold a lease to its limit."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from harness.agent import AgentProcess, wait_for
from node_agent.client import AgentClient, AgentError

from ..conftest import Holder, notebook_holding, until_stopped

MiB = 2**20


def _reclaim_setup(
    start_agent: Callable[..., AgentProcess], holders: Callable[..., Holder], *args: str
) -> tuple[AgentProcess, dict, Holder, dict, Holder, dict, Holder]:
    # Kills are the fallback where freezing cannot be used (test_freezing.py freezes instead).
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
    found = until_stopped(c, cursor, client="jupyter")
    assert [(d["kind"], d["lease_id"]) for d in found] == [("shrink", borrower["id"]),
                                                            ("killed", borrower["id"])]
    shrink, killed = found
    assert killed["created"] - shrink["created"] >= 1, "stopped a grace after the shrink"
    assert shrink["request"] == 128 * MiB and shrink["usage"] > 128 * MiB
    assert "above its request" in shrink["reason"]
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
    found = until_stopped(c, cursor, client="jupyter")
    assert [(d["kind"], d["lease_id"]) for d in found] == [("shrink", settled["id"]),
                                                            ("killed", settled["id"])]
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
    found = until_stopped(c, cursor, lease=borrower["id"])
    assert [d["kind"] for d in found] == ["shrink", "killed"]
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
    found = until_stopped(c, cursor, client="jupyter")
    assert [(d["kind"], d["cause"]) for d in found] == [("shrink", "limit"), ("killed", "limit")]
    shrink, killed = found
    assert killed["created"] - shrink["created"] >= 0.5, "stopped a grace after the shrink"
    assert "above its limit of 256.0 MiB" in shrink["reason"]
    assert "stayed" in killed["reason"] and "above its limit of 256.0 MiB" in killed["reason"]
    wait_for(lambda: not proc.alive(), what="the process over its limit stopped")
    assert c.lease(lease["id"])["state"] == "killed"
