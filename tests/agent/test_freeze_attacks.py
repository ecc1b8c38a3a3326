"""Freezing under attack by real Unix users (#36): a path any user can create does not turn
freezing off for the node, and one user's reports and freezes cannot take the host memory
budget for frozen kernels from everyone else."""

from __future__ import annotations

import ctypes
import os
import signal
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from unix_users import ATTACKER, VICTIM, User, as_user, user

from harness.agent import AgentProcess, wait_for

from .conftest import Holder, notebook_holding

MiB = 2**20
PR_SET_NAME = 15


@pytest.fixture(scope="module")
def people() -> dict[str, User]:
    return {"victim": user(VICTIM), "attacker": user(ATTACKER)}


@contextmanager
def process_of(who: User, *, name: str | None = None) -> Iterator[Callable[[int], None]]:
    """A process of user ``who`` (forked: this Python may be unreadable to them), named
    ``name``; the function makes it hold that many MiB more. Yields it with ``.pid``."""
    commands_r, commands_w = os.pipe()
    answers_r, answers_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never return into pytest
        try:
            os.setgroups([])
            os.setresgid(who.gid, who.gid, who.gid)
            os.setresuid(who.uid, who.uid, who.uid)
            if name:
                ctypes.CDLL(None).prctl(PR_SET_NAME, name.encode(), 0, 0, 0)
            blocks = []
            os.write(answers_w, b".")
            while mib := int.from_bytes(os.read(commands_r, 4), "little"):
                blocks.append(bytearray(mib * MiB))
                blocks[-1][::4096] = b"x" * len(blocks[-1][::4096])
                os.write(answers_w, b".")
        finally:
            os._exit(0)
    os.read(answers_r, 1)

    def hold(mib: int) -> None:
        os.write(commands_w, mib.to_bytes(4, "little"))
        os.read(answers_r, 1)

    hold.pid = pid  # type: ignore[attr-defined]
    try:
        yield hold
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        for fd in (commands_r, commands_w, answers_r, answers_w):
            os.close(fd)


def _lease_of(agent: AgentProcess, who: User, **ask: Any) -> dict[str, Any]:
    made = as_user(who, lambda: agent.client().create_lease(client="jupyter", **ask))
    assert "ok" in made, made
    return made["ok"]


def test_a_pipe_directory_any_user_can_make_does_not_turn_freezing_off(
    start_agent: Callable[..., AgentProcess], holders: Callable[..., Holder],
    people: dict[str, User], shared_tmp: Path,
) -> None:
    """#36 (3): `mkdir /tmp/nvidia-mps; touch /tmp/nvidia-mps/control` made the agent believe
    MPS runs, and freezing was off for everyone. Even a daemon of that name run by the
    attacker serves only the attacker's own processes."""
    open_dir = shared_tmp / "tmp"
    open_dir.mkdir()
    open_dir.chmod(0o1777)
    pipes = open_dir / "nvidia-mps"
    agent = start_agent(spec="1x4GiB", env={"CUDA_MPS_PIPE_DIRECTORY": str(pipes)})
    c = agent.client()
    attacker = people["attacker"]
    assert as_user(attacker, lambda: (pipes.mkdir(), (pipes / "control").touch()))["ok"]
    assert c.node()["mps"] is False
    lease, _ = notebook_holding(agent, holders, "512Mi", "1Gi", 20)
    assert c.freeze(lease["id"])["frozen"]
    # The attacker's own daemon, in a directory only they may write, with a control pipe.
    as_user(attacker, lambda: ((pipes / "control").unlink(), pipes.chmod(0o755),
                               os.mkfifo(pipes / "control")))
    with process_of(attacker, name="nvidia-cuda-mps-control"):
        theirs = _lease_of(agent, attacker, request="256Mi", limit="512Mi")
        with process_of(attacker) as kernel:
            c.register_pid(theirs["id"], kernel.pid)  # type: ignore[attr-defined]
            refused = as_user(attacker, lambda: agent.client().freeze(theirs["id"]))
            assert refused["status"] == 409 and "MPS" in refused["message"]
            other, _ = notebook_holding(agent, holders, "512Mi", "1Gi", 20)
            assert c.freeze(other["id"])["frozen"] and c.node()["mps"] is False


def test_one_user_cannot_take_the_node_s_host_memory_for_frozen_kernels(
    start_agent: Callable[..., AgentProcess], people: dict[str, User],
) -> None:
    """#36 (6): a usage report on a process NVML does not list, then a freeze, took the whole
    budget; and one user's real freezes could too. Reports count no more than the node
    confirms, and each user may freeze half the budget."""
    agent = start_agent("--freeze-budget", "1Gi", spec="1x4GiB")
    c = agent.client()
    attacker, victim = people["attacker"], people["victim"]
    claimed = _lease_of(agent, attacker, request="512Mi", limit="2Gi")
    with process_of(attacker) as idle, process_of(victim) as kernel:
        c.register_pid(claimed["id"], idle.pid)  # type: ignore[attr-defined]
        said = as_user(attacker, lambda: agent.client().report_usage(claimed["id"], 1000 * MiB))
        assert said == {"ok": None}
        time.sleep(0.3)  # six polls: the report has been weighed against what the node sees
        assert c.lease(claimed["id"])["usage"] < 100 * MiB
        frozen = as_user(attacker, lambda: agent.client().freeze(claimed["id"]))
        assert frozen["ok"]["frozen_bytes"] < 100 * MiB
        mine = _lease_of(agent, victim, request="512Mi", limit="1Gi")
        c.register_pid(mine["id"], kernel.pid)  # type: ignore[attr-defined]
        kernel(400)
        wait_for(lambda: c.lease(mine["id"])["usage"] >= 350 * MiB, what="measured")
        assert as_user(victim, lambda: agent.client().freeze(mine["id"]))["ok"]["frozen"]

    # Real memory, frozen by one user, past half the budget: refused for them alone.
    hog = _lease_of(agent, attacker, request="512Mi", limit="2Gi")
    fair = _lease_of(agent, victim, request="512Mi", limit="1Gi")
    with process_of(attacker) as big, process_of(victim) as small:
        c.register_pid(hog["id"], big.pid)  # type: ignore[attr-defined]
        c.register_pid(fair["id"], small.pid)  # type: ignore[attr-defined]
        big(600)
        small(80)
        wait_for(lambda: c.lease(hog["id"])["usage"] >= 550 * MiB, what="measured")
        refused = as_user(attacker, lambda: agent.client().freeze(hog["id"]))
        assert refused["status"] == 409
        assert "one user may have frozen on this node" in refused["message"]
        assert as_user(victim, lambda: agent.client().freeze(fair["id"]))["ok"]["frozen"]
