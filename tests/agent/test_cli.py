"""The command line: the README's demo, and `run`'s exit status, signals and clean-up."""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from support import AgentProcess, wait_for

from node_agent.client import AgentClient, AgentUnavailable


def test_demo_places_spreads_and_compacts() -> None:
    out = subprocess.run([sys.executable, "-m", "node_agent", "demo"], capture_output=True,
                         text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "simulated node: 2 GPU(s)" in text
    assert "migrate GPU 1 -> GPU 0" in text
    assert "job: running on GPU-" in text
    assert "waiting for 1 notebook(s) to move" in out.stderr


def _run(agent: AgentProcess, *cmd: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "node_agent", "--socket", agent.socket, "run",
                             "--gpus", "1", "--", *cmd], stderr=subprocess.PIPE, text=True)


def test_run_exits_with_the_command_status_and_releases(
    start_agent: Callable[..., AgentProcess]
) -> None:
    agent = start_agent()
    job = _run(agent, "sh", "-c", "exit 3")
    assert job.wait(timeout=30) == 3
    assert agent.client().leases() == []
    job = _run(agent, "no-such-command-here")
    assert job.wait(timeout=30) == 1
    assert job.stderr is not None and "cannot run 'no-such-command-here'" in job.stderr.read()
    assert agent.client().leases() == []


def test_run_forwards_signals(start_agent: Callable[..., AgentProcess], tmp_path: Path) -> None:
    agent = start_agent()
    marker, up = tmp_path / "got-term", tmp_path / "up"
    job = _run(agent, sys.executable, "-c",
               "import pathlib, signal, sys, time\n"
               f"signal.signal(signal.SIGTERM, lambda *a: (pathlib.Path({str(marker)!r}).touch(),"
               " sys.exit(7)))\n"
               f"pathlib.Path({str(up)!r}).touch()\n"
               "time.sleep(60)\n")
    c = agent.client()
    wait_for(up.exists, what="the command started")
    assert any(len(x["pids"]) == 2 for x in c.leases()), "run and its command are registered"
    job.send_signal(signal.SIGTERM)
    assert job.wait(timeout=30) == 7
    assert marker.exists(), "the command received the signal"
    assert c.leases() == []


def test_run_refuses_bad_arguments(start_agent: Callable[..., AgentProcess]) -> None:
    agent = start_agent()
    out = subprocess.run([sys.executable, "-m", "node_agent", "--socket", agent.socket, "run",
                          "--request", "lots", "--", "true"], capture_output=True, text=True,
                         timeout=30, check=False)
    assert out.returncode == 2 and "--request: expected a fraction" in out.stderr
    out = subprocess.run([sys.executable, "-m", "node_agent", "--socket", agent.socket, "run"],
                         capture_output=True, text=True, timeout=30, check=False)
    assert out.returncode == 2 and "give the command after --" in out.stderr
    out = subprocess.run([sys.executable, "-m", "node_agent", "--socket", agent.socket + ".no",
                          "status"], capture_output=True, text=True, timeout=30, check=False)
    assert out.returncode == 1 and "no gpufrac agent answers" in out.stderr


def test_hints_to_start_an_agent_give_the_exact_command(tmp_path: Path) -> None:
    sock, state = str(tmp_path / "a b.sock"), str(tmp_path / "state")
    out = subprocess.run([sys.executable, "-m", "node_agent", "--socket", sock, "--state-dir",
                          state, "status"], capture_output=True, text=True, timeout=30,
                         check=False)
    assert out.returncode == 1
    assert f"start one with `gpufrac-agent serve --socket '{sock}' --state-dir {state}`" in (
        out.stderr)
    # Without a state directory, the hint names none rather than guess.
    try:
        AgentClient(sock).node()
    except AgentUnavailable as exc:
        assert exc.path == sock and exc.state_dir is None
        assert f"`gpufrac-agent serve --socket '{sock}'`" in str(exc)
    else:
        raise AssertionError("nothing listens there")
    with pytest.raises(AgentUnavailable, match=f"--state-dir {state}`"):
        AgentClient(sock, state_dir=state).leases()
