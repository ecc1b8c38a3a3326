"""Fixtures for the kernel hook tests."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from .kernels import REPO

with warnings.catch_warnings():
    # torch warns once when numpy is absent; it is optional here.
    warnings.simplefilter("ignore")
    import torch  # noqa: F401


@pytest.fixture
def ckdir(tmp_path: Path) -> Path:
    """A checkpoint directory path (not created yet: the checkpointer creates it 0700)."""
    return tmp_path / "checkpoints" / "kernel-1"


class Agent:
    """A real node agent on a simulated node, in a subprocess."""

    def __init__(self, root: Path, spec: str = "2x16GiB", args: tuple[str, ...] = ()) -> None:
        self.socket = str(root / "agent.sock")
        self.state_dir = str(root / "state")
        self.spec = spec
        self.args = args
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        from node_agent.client import AgentClient

        self.proc = subprocess.Popen(
            [sys.executable, "-m", "node_agent", "--socket", self.socket, "serve",
             "--simulate", self.spec, "--state-dir", self.state_dir, "--log-level", "warning",
             *self.args],
            cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        client = AgentClient(self.socket, timeout=2.0)
        deadline = time.monotonic() + 30
        while not client.ping():
            assert self.proc.poll() is None, "the agent exited"
            assert time.monotonic() < deadline, "the agent did not answer within 30 s"
            time.sleep(0.05)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def client(self) -> Any:
        from node_agent.client import AgentClient

        return AgentClient(self.socket, timeout=5.0)


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[Agent]:
    """A running simulated agent (2x16GiB)."""
    running = Agent(tmp_path / "agent")
    (tmp_path / "agent").mkdir()
    running.start()
    try:
        yield running
    finally:
        running.stop()
