"""A real node agent (``python -m node_agent serve --simulate …``) as a test's child process."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from node_agent.client import AgentClient


@dataclass
class AgentProcess:
    socket: str
    state_dir: str
    log: Path
    process: subprocess.Popen[bytes]

    def client(self) -> AgentClient:
        return AgentClient(self.socket, timeout=10)

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


def start_agent(tmp: Path, simulate: str = "2x2GiB", *args: str, deadline_s: float = 30) -> AgentProcess:
    """Start an agent on a simulated node and wait (polling its socket) until it answers."""
    tmp.mkdir(parents=True, exist_ok=True)
    sock, state, log = str(tmp / "agent.sock"), str(tmp / "agent-state"), tmp / "agent.log"
    with open(log, "wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "node_agent", "serve", "--simulate", simulate,
             "--socket", sock, "--state-dir", state, *args],
            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        )
    agent = AgentProcess(sock, state, log, process)
    end = time.monotonic() + deadline_s
    while not AgentClient(sock, timeout=2).ping():
        if process.poll() is not None or time.monotonic() > end:
            stop_agent(agent)
            raise RuntimeError(f"agent did not start: {agent.log_text()}")
        time.sleep(0.05)
    return agent


def stop_agent(agent: AgentProcess) -> None:
    if agent.process.poll() is None:
        agent.process.send_signal(signal.SIGTERM)
        try:
            agent.process.wait(10)
        except subprocess.TimeoutExpired:
            agent.process.kill()
            agent.process.wait()
    with contextlib.suppress(OSError):
        os.unlink(agent.socket)


@contextlib.contextmanager
def running_agent(tmp: Path, simulate: str = "2x2GiB", *args: str) -> Iterator[AgentProcess]:
    agent = start_agent(tmp, simulate, *args)
    try:
        yield agent
    finally:
        stop_agent(agent)
