"""Reclaim: a borrower above its request is asked to shrink, then stopped; it comes back restored."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from harness.agent import AgentProcess, wait_for
from harness.jupyter import Server, running_server

pytestmark = pytest.mark.e2e

KERNELSPECS = {
    # 256 MiB guaranteed, may burst to the whole 2 GiB GPU.
    "borrower": {"gpufrac": {"request": "0.125", "limit": "1"}},
    # 1 GiB guaranteed, no bursting.
    "owner": {"gpufrac": {"request": "0.5", "limit": "0.5"}},
}


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[AgentProcess, Server]]:
    """One simulated 2 GiB GPU, a short reclaim grace period, and a server. Freezing is off:
    this is the stop and restore that stands in where it cannot be used (the sequences and
    tests/e2e/test_freezing.py freeze)."""
    tmp = tmp_path_factory.mktemp("reclaim")
    args = ("--poll-interval", "0.2", "--reclaim-grace", "2", "--headroom", "0.25", "--no-freeze")
    with AgentProcess(tmp / "agent", "1x2GiB", args) as agent:
        config = "c.GpuFrac.lease_poll_interval = 0.5\n"
        with running_server(tmp / "server", agent.socket, config, KERNELSPECS) as server:
            yield agent, server


def test_borrower_is_shrunk_then_killed_and_restored(node: tuple[AgentProcess, Server]) -> None:
    _, server = node
    borrower = server.open_notebook("borrower.ipynb", kernel="borrower")
    borrower.ok("import torch\nkeep = {'numbers': [1, 2, 3]}\ng = (i for i in range(3))\n"
                "%gpu checkpoint")
    # A long cell holding 1 GB of (simulated device) memory: far above its 256 MiB request.
    # The running cell sees its kernel hear the shrink: the server wakes the kernel's directive
    # thread (it does not poll for 25 s), while the 2 s grace still runs.
    cell = borrower.send("big = torch.ones(1000 * 2**20 // 4)\nimport time\n"
                         "from jupyter_gpufrac import kernel as gpufrac\n"
                         "while not gpufrac.summary()['shrinking']:\n    time.sleep(0.02)\n"
                         "print('heard the shrink', flush=True)\ntime.sleep(600)")

    def state() -> str:
        return str(server.kernel_status(borrower.kernel_id)["state"])

    wait_for(lambda: state() == "bursting", 60, "the borrower to burst", interval=0.2)
    wait_for(lambda: "bursting" in server.events(borrower.kernel_id), 10, "the bursting event", interval=0.2)

    owner = server.open_notebook("owner.ipynb", kernel="owner")
    owner_pid = owner.ok("import os, torch\nprint(os.getpid())").strip()
    # The owner grows within its guarantee, into memory the borrower holds.
    owner.ok("mine = torch.ones(400 * 2**20 // 4)")
    borrower.printed(cell, "heard the shrink", timeout=30)

    def restored() -> dict[str, Any] | None:
        # The restore after the kill (a bursting notice may follow it at once).
        status = server.kernel_status(borrower.kernel_id)
        kinds = [event["event"] for event in status["events"]]
        after = kinds[kinds.index("oom_killed"):] if "oom_killed" in kinds else []
        return status if "restored" in after else None

    status = wait_for(restored, 120, "the borrower to be stopped and restored", interval=0.2)
    kinds = [event["event"] for event in status["events"]]
    assert kinds.index("shrink_requested") < kinds.index("oom_killed") < kinds.index("restored"), kinds
    shrink = status["events"][kinds.index("shrink_requested")]
    assert shrink["request"] == 2**30 // 4 and shrink["usage"] > shrink["request"]
    killed = status["events"][kinds.index("oom_killed")]
    assert "loaned memory" in killed["message"]
    assert "restores the state after its last completed cell" in killed["message"]
    report = status["events"][kinds.index("restored")]
    assert "keep" in report["restored"]
    # The generator could not be saved; the running cell is named as cut off, and nothing
    # claims a full restore.
    assert report["lost"] == ["g"] and report["ok"] is False, report
    assert "not restored: g (TypeError: cannot pickle 'generator' object)" in report["message"]
    assert ("the running cell [2] big = torch.ones(1000 * 2**20 // 4) was cut off: re-run it"
            in report["message"])
    assert status["state"] == "restore-incomplete"

    # The same page goes on: the first cell says what happened, the checkpointed state is back.
    output = borrower.ok("print(keep['numbers'], 'big' in globals())")
    assert "[1, 2, 3] False" in output and "g" in output.split("[1, 2, 3]")[0]
    assert server.kernel_status(borrower.kernel_id)["lease"]["state"] == "active"
    # Restarted at the kill's notice and once only: jupyter_client's restarter did not start
    # the kernel a second time.
    kinds = server.events(borrower.kernel_id)
    assert kinds[kinds.index("oom_killed"):].count("restored") == 1, kinds
    # The owner was never touched.
    assert owner.ok("print(os.getpid(), mine.numel())").split() == [owner_pid, str(400 * 2**20 // 4)]
    borrower.close()
    owner.close()
