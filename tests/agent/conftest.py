"""Fixtures that run a real agent process on a temporary Unix socket."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from node_agent.client import AgentClient

ALLOCATE = (
    "import sys\n"
    "print('ready', flush=True)\n"
    "blocks = []\n"
    "for line in sys.stdin:\n"
    "    if int(line) == 0:\n"
    "        blocks.clear()\n"
    "        print('held', flush=True)\n"
    "        continue\n"
    "    blocks.append(bytearray(int(line) * 2**20))\n"
    "    blocks[-1][::4096] = b'x' * len(blocks[-1][::4096])\n"
    "    print('held', flush=True)\n"
)


@dataclass
class AgentProcess:
    """A `gpufrac-agent serve` subprocess; restartable on the same socket and state."""

    socket: str
    state_dir: str
    args: list[str]
    proc: subprocess.Popen[str] | None = None
    log: Path = field(default_factory=lambda: Path(tempfile.mkstemp(suffix=".log")[1]))

    def start(self) -> AgentProcess:
        with open(self.log, "a") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "node_agent", "serve", "--socket", self.socket,
                 "--state-dir", self.state_dir, *self.args],
                stdout=subprocess.PIPE, stderr=log, text=True,
            )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert "ready" in line, f"agent did not start: {line!r}\n{self.log.read_text()}"
        return self

    def kill(self) -> None:
        """SIGKILL: no clean-up at all, as in a crash."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()

    def client(self, timeout: float = 10.0) -> AgentClient:
        return AgentClient(self.socket, timeout=timeout)


@pytest.fixture
def shared_tmp() -> Iterator[Path]:
    """A temporary directory other uids may enter (pytest's own are 0700)."""
    path = Path(tempfile.mkdtemp(prefix="gpufrac-test-"))
    path.chmod(0o755)
    yield path
    subprocess.run(["rm", "-rf", str(path)], check=False)


@pytest.fixture
def start_agent(shared_tmp: Path) -> Iterator[Callable[..., AgentProcess]]:
    started: list[AgentProcess] = []

    def start(*args: str, spec: str = "2x1GiB") -> AgentProcess:
        agent = AgentProcess(
            socket=str(shared_tmp / f"agent{len(started)}.sock"),
            state_dir=str(shared_tmp / f"state{len(started)}"),
            args=["--simulate", spec, "--poll-interval", "0.05", *args],
        )
        started.append(agent.start())
        return agent

    yield start
    for agent in started:
        agent.stop()


class Holder:
    """A real process that holds as much memory as a test tells it to."""

    def __init__(self, env: dict[str, str] | None = None) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", ALLOCATE], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            text=True, env={**os.environ, **(env or {})},
        )
        assert self.proc.stdout is not None
        assert self.proc.stdout.readline().strip() == "ready"

    @property
    def pid(self) -> int:
        return self.proc.pid

    def hold(self, mib: int) -> None:
        """Hold ``mib`` more MiB; 0 lets go of everything held."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(f"{mib}\n")
        self.proc.stdin.flush()
        assert self.proc.stdout.readline().strip() == "held"

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        if self.alive():
            self.proc.kill()
        self.proc.wait()


@pytest.fixture
def holders() -> Iterator[Callable[..., Holder]]:
    made: list[Holder] = []

    def make(**env: str) -> Holder:
        made.append(Holder(env))
        return made[-1]

    yield make
    for h in made:
        h.stop()


def wait_for(predicate: Callable[[], object], timeout: float = 10.0, what: str = "condition") -> object:
    """Poll ``predicate`` until it returns something truthy, or fail after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.02)
