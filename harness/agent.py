"""Helpers every test package shares: polling with a deadline, a real node agent, servers' REST."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

from node_agent.client import AgentClient

T = TypeVar("T")
ROOT = Path(__file__).resolve().parents[1]
READY = "gpufrac-agent: ready on"


def wait_for(
    check: Callable[[], T | None], timeout: float = 10.0, what: str = "condition", interval: float = 0.02
) -> T:
    """Poll ``check`` until it returns something truthy and return that, or fail after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(interval)


def nvml_works() -> bool:
    """Whether NVML initialises here (a machine with an NVIDIA driver), asked in a subprocess."""
    probe = "import pynvml\npynvml.nvmlInit()\npynvml.nvmlShutdown()"
    try:
        done = subprocess.run([sys.executable, "-c", probe], capture_output=True, timeout=30)
    except subprocess.TimeoutExpired:
        return False
    return done.returncode == 0


def nvml_memory_of(pid: int) -> int:
    """Bytes NVML says ``pid`` holds on all GPUs (0 where it is not listed)."""
    import pynvml

    pynvml.nvmlInit()
    try:
        held = 0
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            held += sum(p.usedGpuMemory or 0 for p in
                        pynvml.nvmlDeviceGetComputeRunningProcesses(handle) if p.pid == pid)
        return int(held)
    finally:
        pynvml.nvmlShutdown()


class ChildProcess:
    """A process a test started (``proc``): whether it still runs, and its end."""

    proc: subprocess.Popen[str]

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        """SIGKILL it if it runs, and reap it."""
        if self.alive():
            self.proc.kill()
        self.proc.wait()


def free_port() -> int:
    """A TCP port on loopback that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rest_call(url: str, token: str, method: str = "GET", body: object = None,
              timeout: float = 60) -> tuple[int, Any]:
    """A Jupyter server REST call with a token: (status, parsed JSON, or the text of an error page)."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(
        url, data=data, method=method,
        headers={"Authorization": f"token {token}", "Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            raw = response.read()
            return response.status, (json.loads(raw) if raw else None)
    except urllib.error.HTTPError as err:
        raw = err.read()
        try:
            return err.code, json.loads(raw)
        except ValueError:  # an HTML error page
            return err.code, raw.decode(errors="replace")


class AgentProcess:
    """``python -m node_agent serve --simulate SPEC`` as a child process, restartable on its socket and state.

    Its socket, state directory and log (stdout and stderr) live in ``root``. A context manager:
    ``with AgentProcess(root, "2x2GiB") as agent:`` starts it and stops it at the end.
    """

    def __init__(self, root: Path, spec: str | None, args: Sequence[str] = (),
                 ready_timeout: float = 30.0, env: Mapping[str, str] | None = None) -> None:
        """``spec``: the simulated node; None serves the GPUs NVML sees. ``env``: added to
        the agent's environment."""
        root.mkdir(parents=True, exist_ok=True)
        self.socket = str(root / "agent.sock")
        self.state_dir = str(root / "agent-state")
        self.log = root / "agent.log"
        self.spec = spec
        self.args = list(args)
        self.ready_timeout = ready_timeout
        self.env = {**os.environ, **(env or {})}
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> AgentProcess:
        """Start it and wait (polling its log) until it says it serves; fails with the log if not."""
        offset = self.log.stat().st_size if self.log.exists() else 0
        with open(self.log, "ab") as out:
            process = self.process = subprocess.Popen(
                [sys.executable, "-m", "node_agent", "serve",
                 *(["--simulate", self.spec] if self.spec else []),
                 "--socket", self.socket, "--state-dir", self.state_dir, *self.args],
                cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=self.env,
            )

        def ready() -> bool:
            if READY in self.log_text(offset):
                return True
            if process.poll() is not None:
                raise AssertionError(f"the agent exited with status {process.returncode}")
            return False

        try:
            wait_for(ready, self.ready_timeout, f"the agent to serve on {self.socket}")
        except AssertionError as err:
            self.stop()
            raise AssertionError(f"{err}\n--- agent log ---\n{self.log_text(offset)}") from None
        return self

    def stop(self) -> None:
        """SIGTERM, SIGKILL if it has not ended within 10 s; then its socket is removed."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()
        with contextlib.suppress(OSError):
            os.unlink(self.socket)

    def kill(self) -> None:
        """SIGKILL: no clean-up at all, as in a crash."""
        assert self.process is not None
        self.process.send_signal(signal.SIGKILL)
        self.process.wait()

    def client(self, timeout: float = 10.0) -> AgentClient:
        return AgentClient(self.socket, timeout=timeout)

    def log_text(self, offset: int = 0) -> str:
        """What the agent wrote (from byte ``offset`` on), for failure messages."""
        if not self.log.exists():
            return ""
        with open(self.log, "rb") as log:
            log.seek(offset)
            return log.read().decode(errors="replace")

    def __enter__(self) -> AgentProcess:
        return self.start()

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def http_bytes(method: str, target: str, body: bytes = b"", headers: str = "") -> bytes:
    """One HTTP/1.1 request as bytes (``headers``: extra lines, each ending in CRLF)."""
    return (f"{method} {target} HTTP/1.1\r\nHost: agent\r\nConnection: close\r\n"
            f"Content-Length: {len(body)}\r\n{headers}\r\n").encode() + body


def raw_request(path: str, request: bytes, timeout: float = 5.0) -> tuple[int, Any]:
    """Send ``request`` on a fresh connection to the Unix socket ``path``: (status, the body:
    parsed when it is JSON, else as text)."""
    with socket.socket(socket.AF_UNIX) as sock:
        sock.settimeout(timeout)
        sock.connect(path)
        sock.sendall(request)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    while int(head.split()[1]) < 200:  # interim answers (100 Continue) come first
        head, _, body = body.partition(b"\r\n\r\n")
    if b"content-type: application/json" not in head.lower():
        return int(head.split()[1]), body.decode(errors="replace")
    return int(head.split()[1]), json.loads(body)


@contextlib.contextmanager
def full_listen_queue(path: str) -> Iterator[None]:
    """A Unix socket at ``path`` that accepts nothing and whose listen queue is full: the
    next connect() answers EAGAIN, as a swamped agent's does."""
    with socket.socket(socket.AF_UNIX) as listener:
        listener.bind(path)
        listener.listen(0)
        queued: list[socket.socket] = []
        try:
            while True:
                sock = socket.socket(socket.AF_UNIX)
                sock.setblocking(False)
                try:
                    sock.connect(path)
                except BlockingIOError:
                    sock.close()
                    break
                queued.append(sock)
            yield
        finally:
            for sock in queued:
                sock.close()
