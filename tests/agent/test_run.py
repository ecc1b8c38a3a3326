"""`gpufrac-agent run` through agent restarts: it keeps waiting, and never leaves its lease."""

from __future__ import annotations

import fcntl
import os
import pty
import re
import select
import shlex
import signal
import sqlite3
import struct
import subprocess
import sys
import termios
from collections.abc import Callable
from pathlib import Path

import pytest

from harness.agent import AgentProcess, wait_for

from .conftest import Holder


def _spread_pair(agent: AgentProcess, holders: Callable[..., Holder]) -> tuple[dict, Holder]:
    """Two notebooks bin-packed on GPU 0, spread one per GPU: the one on GPU 1 must move for a
    whole-GPU job. Returns that one (named ``b.ipynb``, as a server names it) and its process."""
    c = agent.client()
    spread: tuple[dict, Holder] | None = None
    for name in ("a.ipynb", "b.ipynb"):
        lease = c.create_lease(client="jupyter", request="0.25", limit="1", name=name)
        h = holders(CUDA_VISIBLE_DEVICES=lease["physical_gpu"])
        lease = c.register_pid(lease["id"], h.pid)
        h.hold(10)
        if lease["physical_gpu"] != lease["logical_gpu"]:
            spread = (lease, h)
    assert spread is not None
    return spread


def _run(agent: AgentProcess, *args: str, command: list[str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "node_agent", "--socket", agent.socket, "run", "--gpus", "1",
         *args, "--", *command],
        stderr=subprocess.PIPE, text=True,
    )


def _writes(path: Path) -> list[str]:
    """A command that writes the GPUs it was given to ``path``."""
    return [sys.executable, "-c", f"import os, pathlib; pathlib.Path({str(path)!r})"
            ".write_text(os.environ['CUDA_VISIBLE_DEVICES'])"]


def _job_leases(agent: AgentProcess) -> list[dict]:
    return [x for x in agent.client().leases() if x["kind"] == "job"]


def _waiting_job(agent: AgentProcess) -> dict:
    """The job lease once `run` has registered itself and waits for the move."""
    return wait_for(lambda: next((x for x in _job_leases(agent)
                                  if x["pids"] and x["state"] == "pending"), None),
                    what="run waiting with its lease")


def _move(agent: AgentProcess, holders: Callable[..., Holder], lease: dict, old: Holder) -> None:
    """What a Jupyter server does on `migrate`: restart the kernel on the target, say so."""
    c = agent.client()
    target = c.lease(lease["id"])["target_gpus"][0]
    old.stop()
    new = holders(CUDA_VISIBLE_DEVICES=target)
    c.register_pid(lease["id"], new.pid)
    assert c.migrated(lease["id"])["physical_gpu"] == target


def test_run_waits_out_an_agent_restart_and_the_move_completes(
    start_agent: Callable[..., AgentProcess], holders: Callable[..., Holder], tmp_path: Path
) -> None:
    agent = start_agent()
    spread, spread_proc = _spread_pair(agent, holders)
    out = tmp_path / "job.txt"
    job = _run(agent, command=_writes(out))
    job_lease = _waiting_job(agent)
    agent.kill()
    agent.start()  # same socket, same ledger: the job lease and the move come back
    assert agent.client().lease(job_lease["id"])["state"] == "pending"
    _move(agent, holders, spread, spread_proc)
    assert job.wait(timeout=60) == 0
    assert job.stderr is not None
    err = job.stderr.read()
    assert "waiting for it to come back" in err
    index = next(g["index"] for g in agent.client().node()["gpus"]
                 if g["uuid"] == spread["physical_gpu"])
    # Named as the panel and `status` name it; what was done for it, by name; no ids.
    assert f"] running on GPU {index}\n" in err, err
    assert f'made room: notebook "b.ipynb" on GPU {index} moved to GPU ' in err, err
    assert job_lease["id"] not in err and spread["id"] not in err, err
    assert out.read_text() == spread["physical_gpu"], "the command ran on the freed GPU"
    assert _job_leases(agent) == []


def test_run_asks_again_for_a_lease_the_agent_lost(
    start_agent: Callable[..., AgentProcess], holders: Callable[..., Holder], tmp_path: Path
) -> None:
    agent = start_agent()
    spread, spread_proc = _spread_pair(agent, holders)
    out = tmp_path / "job.txt"
    job = _run(agent, command=_writes(out))
    lost = _waiting_job(agent)
    agent.kill()
    # Gone from the ledger while the agent was away, as an orphan released at start-up is.
    with sqlite3.connect(Path(agent.state_dir) / "ledger.sqlite3") as db:
        db.execute("DELETE FROM leases WHERE id = ?", (lost["id"],))
    agent.start()
    again = wait_for(lambda: next((x for x in _job_leases(agent) if x["pids"]), None),
                     what="a new job lease")
    assert again["id"] != lost["id"]
    _move(agent, holders, spread, spread_proc)
    assert job.wait(timeout=60) == 0
    assert job.stderr is not None
    assert f"the agent no longer has lease {lost['id']}; asking again" in job.stderr.read()
    assert out.read_text() == spread["physical_gpu"]
    assert _job_leases(agent) == []


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_run_stopped_while_the_agent_is_down_releases_when_it_is_back(
    start_agent: Callable[..., AgentProcess], holders: Callable[..., Holder], tmp_path: Path,
    signum: int,
) -> None:
    agent = start_agent()
    _spread_pair(agent, holders)
    job = _run(agent, command=_writes(tmp_path / "never.txt"))
    _waiting_job(agent)
    agent.kill()
    job.send_signal(signum)
    assert job.stderr is not None
    # It retries the release until the agent answers again.
    stderr = job.stderr
    wait_for(lambda: "retrying to release lease" in stderr.readline(), what="a retry line")
    assert job.poll() is None
    agent.start()
    assert job.wait(timeout=30) == 128 + signum
    assert _job_leases(agent) == []
    assert not (tmp_path / "never.txt").exists()


def test_run_timeout_gives_the_lease_back_and_says_what_it_waited_for(
    start_agent: Callable[..., AgentProcess], holders: Callable[..., Holder], tmp_path: Path
) -> None:
    agent = start_agent()
    spread, _ = _spread_pair(agent, holders)  # its client never moves it (migrate grace: 120 s)
    job = _run(agent, "--timeout", "1", command=_writes(tmp_path / "never.txt"))
    assert job.wait(timeout=30) == 1
    assert job.stderr is not None
    said = job.stderr.read()
    assert spread["id"] not in said  # the notebook by its name, as people know it
    last = said.splitlines()[-1]
    assert "not granted within 1s; it was waiting for 1 notebook to make room: notebook " \
        '"b.ipynb" moves from GPU 1 to GPU 0 within' in last
    assert "--timeout" in last
    assert _job_leases(agent) == []


# A return to the start of the line (up the rows it wrapped onto), clearing what follows.
_REDRAW = re.compile(r"\r(?:\x1b\[(\d+)A)?\x1b\[J")


def _frames(shown: str) -> list[str]:
    """What a terminal showed, one frame per redraw or new line."""
    return _REDRAW.sub("\n", shown).replace("\r\n", "\n").split("\n")


def _pty_read(fd: int, until: Callable[[str], bool]) -> str:
    """What was written to the terminal ``fd``, once ``until`` holds of it."""
    seen = ""

    def read() -> str | None:
        nonlocal seen
        while select.select([fd], [], [], 0)[0]:
            seen += os.read(fd, 65536).decode(errors="replace")
        return seen if until(seen) else None

    return wait_for(read, timeout=30, what="progress on the terminal")


def test_run_on_a_terminal_names_the_notebook_it_waits_for_with_a_countdown_then_runs(
    start_agent: Callable[..., AgentProcess], holders: Callable[..., Holder], tmp_path: Path
) -> None:
    agent = start_agent()
    spread, spread_proc = _spread_pair(agent, holders)
    term, tty = pty.openpty()
    columns = 80  # narrower than the line: it wraps, and is still rewritten in place
    fcntl.ioctl(tty, termios.TIOCSWINSZ, struct.pack("HHHH", 24, columns, 0, 0))
    out = tmp_path / "job.txt"
    job = subprocess.Popen(
        [sys.executable, "-m", "node_agent", "--socket", agent.socket, "run", "--gpus", "1",
         "--", *_writes(out)], stderr=tty)
    os.close(tty)
    try:
        line = re.compile(r'notebook "b\.ipynb" moves from GPU 1 to GPU 0 within (\d+) s$')

        def countdown(shown: str) -> list[int]:
            return [int(m[1]) for f in _frames(shown) if (m := line.search(f))]

        shown = _pty_read(term, lambda seen: len(set(countdown(seen))) >= 2)
        seconds = countdown(shown)
        assert seconds == sorted(seconds, reverse=True) and seconds[-1] < seconds[0] <= 120
        # Each redraw goes back up the rows the frame before it took, and no new line comes
        # between them.
        frames = [f for f in _frames(shown) if f]
        redraws = [int(m[1] or 0) for m in _REDRAW.finditer(shown)]
        assert len(redraws) == len(frames) >= 2 and "\n" not in shown
        rows = [-(-len(f) // columns) for f in frames]
        assert rows[0] >= 2 and redraws[1:] == [r - 1 for r in rows[:-1]]
        _move(agent, holders, spread, spread_proc)
        assert job.wait(timeout=60) == 0
        assert out.read_text() == spread["physical_gpu"]
    finally:
        os.close(term)
    assert _job_leases(agent) == []


def test_run_that_nothing_can_make_room_for_fails_at_once_saying_why(
    start_agent: Callable[..., AgentProcess], tmp_path: Path
) -> None:
    agent = start_agent()
    c = agent.client()
    held = [c.create_lease(client="t", kind="job", request="1", name=n) for n in ("j0", "j1")]
    # A --timeout far longer than the test waits: it must not wait at all.
    never = tmp_path / "never.txt"
    for args, why in ((("--gpus", "1"), f'GPU 1 is held whole by job "j1" ({held[1]["id"]})'),
                      (("--request", "2Gi"), "could never be placed: ask for at most 1.0 GiB")):
        done = subprocess.run(
            [sys.executable, "-m", "node_agent", "--socket", agent.socket, "run", *args,
             "--timeout", "3600", "--", *_writes(never)],
            capture_output=True, text=True, timeout=60, check=False)
        assert done.returncode == 1
        assert why in done.stderr and "wait for" not in done.stderr
        assert "not granted" not in done.stderr
    assert {x["id"] for x in _job_leases(agent)} == {x["id"] for x in held}
    assert not never.exists()
    documented = subprocess.run([sys.executable, "-m", "node_agent", "run", "--help"],
                                capture_output=True, text=True, timeout=30, check=True).stdout
    assert "1 when it never ran because no lease was granted" in " ".join(documented.split())


def test_run_says_which_lease_is_left_and_how_to_release_it(
    start_agent: Callable[..., AgentProcess], tmp_path: Path
) -> None:
    agent = start_agent()
    go = tmp_path / "go"
    wait = [sys.executable, "-c", "import os, sys, time\n"
            f"while not os.path.exists({str(go)!r}): time.sleep(0.02)\nsys.exit(5)"]
    job = _run(agent, "--release-timeout", "1", command=wait)
    lease = wait_for(lambda: next((x for x in _job_leases(agent) if len(x["pids"]) == 2), None),
                     what="the command running")
    agent.kill()
    go.touch()
    assert job.wait(timeout=30) == 5, "the command's status, whatever became of the lease"
    assert job.stderr is not None
    err = job.stderr.read()
    assert f"lease {lease['id']} is left on the agent" in err
    command = re.search(r"Release it with `([^`]+)`", err)
    assert command is not None
    agent.start()
    words = shlex.split(command.group(1))
    assert words[0] == "gpufrac-agent"
    done = subprocess.run([sys.executable, "-m", "node_agent", *words[1:]], capture_output=True,
                          text=True, timeout=30, check=False)
    assert done.returncode == 0, done.stderr
    assert _job_leases(agent) == []


def test_run_without_an_agent_waits_then_says_how_to_start_one(tmp_path: Path) -> None:
    sock, state = str(tmp_path / "agent.sock"), str(tmp_path / "state")
    out = subprocess.run([sys.executable, "-m", "node_agent", "--socket", sock, "--state-dir",
                          state, "run", "--timeout", "1", "--", "true"], capture_output=True,
                         text=True, timeout=30, check=False)
    assert out.returncode == 1
    assert "Waiting for it while asking for a lease" in out.stderr
    assert f"start one with `gpufrac-agent serve --socket {sock} --state-dir {state}`" in out.stderr
