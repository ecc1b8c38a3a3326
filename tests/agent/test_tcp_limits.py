"""TCP mode and buffered bodies on a real agent: connection and descriptor limits, the token file."""

from __future__ import annotations

import contextlib
import os
import resource
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest

from harness.agent import ROOT, AgentProcess, free_port, http_bytes, raw_request, wait_for
from node_agent.http_server import BODY_BUFFER, BODY_BUFFER_PER_CALLER, TCP_UNAUTHENTICATED

TOKEN = "t0ken-for-the-tests-0123456789"
pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")


@pytest.fixture
def token_file(tmp_path: Path) -> Path:
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    path.chmod(0o600)
    return path


@pytest.fixture
def tcp_agent(start_agent: Callable[..., AgentProcess], token_file: Path
              ) -> tuple[AgentProcess, int]:
    port = free_port()
    agent = start_agent("--tcp", f"127.0.0.1:{port}", "--token-file", str(token_file))
    return agent, port


def _connect(port: int, source: str = "127.0.0.1") -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind((source, 0))
    sock.connect(("127.0.0.1", port))
    return sock


@contextlib.contextmanager
def _flood(port: int, count: int, sources: tuple[str, ...] = ("127.0.0.1",)
           ) -> Iterator[list[socket.socket]]:
    """``count`` token-less TCP connections from each of ``sources`` that send nothing."""
    held: list[socket.socket] = []
    try:
        for source in sources:
            held.extend(_connect(port, source) for _ in range(count))
        yield held
    finally:
        for sock in held:
            sock.close()


def _waiting(sock: socket.socket, timeout: float) -> bool:
    """The agent neither answered nor closed this connection: it waits for the rest."""
    sock.settimeout(timeout)
    try:
        sock.recv(4096)
    except TimeoutError:
        return True
    except OSError:
        pass
    return False


def _node_seconds(agent: AgentProcess) -> float:
    started = time.monotonic()
    agent.client(timeout=5).node()
    return time.monotonic() - started


def _asked(port: int, token: str | None = TOKEN, body: bytes = b"") -> bytes:
    """One request on a fresh connection from 127.0.0.1: the agent's answer (with b" closed"
    added when it is a refusal after which the agent closed the connection)."""
    with _connect(port) as sock:
        sock.settimeout(5)
        headers = f"Authorization: token {token}\r\n" if token else ""
        sock.sendall(http_bytes("POST" if body else "GET", "/v1/leases" if body else "/v1/node",
                                body, headers=headers))
        answer = sock.recv(65536)
        if answer.startswith(b"HTTP/1.1 200"):
            return answer
        try:
            closed = sock.recv(1) == b""
        except ConnectionResetError:  # closed with the body unread
            closed = True
        except TimeoutError:
            closed = False
        return answer + (b" closed" if closed else b"")


def test_connections_without_the_token_never_keep_the_token_holder_out(
        tcp_agent: tuple[AgentProcess, int]) -> None:
    """Finding 5: any local user holds idle connections from 127.0.0.1 and from 127.0.0.2-6,
    more than there are slots. The token holder, from 127.0.0.1 too, is answered every time;
    a request without the token is answered 401 and its connection closed, its body unread."""
    agent, port = tcp_agent
    assert agent.process is not None
    sources = ("127.0.0.1",) * 5 + tuple(f"127.0.0.{n}" for n in range(2, 7))
    with _flood(port, 60, sources):
        answers = [_asked(port) for _ in range(20)]
        assert all(a.startswith(b"HTTP/1.1 200") for a in answers), [a[:40] for a in answers]
        # What the agent holds stays bounded: the oldest token-less connections made room.
        fds = len(os.listdir(f"/proc/{agent.process.pid}/fd"))
        assert fds < TCP_UNAUTHENTICATED + 64, fds
        refused = _asked(port, token=None, body=b"x" * 100_000)
        assert refused.startswith(b"HTTP/1.1 401") and refused.endswith(b" closed"), refused[:80]
        assert b"a token is required over TCP" in refused
    assert _asked(port, token="wrong-token-0123456789").startswith(b"HTTP/1.1 401")


def test_at_the_descriptor_limit_the_tcp_accept_loop_backs_off(
    tcp_agent: tuple[AgentProcess, int]
) -> None:
    agent, port = tcp_agent
    assert agent.process is not None
    resource.prlimit(agent.process.pid, resource.RLIMIT_NOFILE, (64, 64))
    proc = psutil.Process(agent.process.pid)
    with open(agent.log, "rb") as log:
        lines_before = sum(1 for _ in log)
    # Four peers, together past the agent's descriptors.
    with _flood(port, TCP_UNAUTHENTICATED // 4, tuple(f"127.0.0.{n}" for n in range(1, 5))):
        proc.cpu_percent(None)
        time.sleep(3.0)  # the measurement is over an interval: there is no event to wait for
        busy = proc.cpu_percent(None)
        with open(agent.log, "rb") as log:
            grown = sum(1 for _ in log) - lines_before
    assert grown < 20, f"{grown} lines of log in 3 s at the descriptor limit"
    assert busy < 50, f"the agent spun at {busy:.0f} % CPU at its descriptor limit"
    wait_for(lambda: _node_seconds(agent) < 1.0, 15, "the Unix socket to be served again")


def _serve(shared_tmp: Path, token_file: Path) -> subprocess.CompletedProcess[str]:
    root = shared_tmp / "refused"
    root.mkdir(exist_ok=True)
    return subprocess.run(
        [sys.executable, "-m", "node_agent", "serve", "--simulate", "1x1GiB",
         "--socket", str(root / "agent.sock"), "--state-dir", str(root / "state"),
         "--tcp", f"127.0.0.1:{free_port()}", "--token-file", str(token_file)],
        cwd=ROOT, capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL)


@pytest.mark.parametrize("flaw", ["mode 0644", "another owner", "a symlink", "mode 0660"])
def test_a_token_file_others_could_read_or_swap_is_refused(
    shared_tmp: Path, token_file: Path, flaw: str
) -> None:
    named = token_file
    if flaw == "mode 0644":
        token_file.chmod(0o644)
    elif flaw == "mode 0660":
        token_file.chmod(0o660)
    elif flaw == "another owner":
        os.chown(token_file, 65534, 65534)
    else:
        named = token_file.with_name("link")
        named.symlink_to(token_file)
    done = _serve(shared_tmp, named)
    assert done.returncode == 2, done
    message = done.stderr.strip()
    assert len(message.splitlines()) == 1, message
    assert str(named) in message and f"chmod 600 {named}" in message, message


def test_request_bodies_buffered_at_once_are_bounded(
    tcp_agent: tuple[AgentProcess, int]
) -> None:
    """Connections each sending a body of 1 MiB (not its last byte): the agent buffers at most
    a caller's share, and all callers together at most BODY_BUFFER; the rest get a 503."""
    agent, port = tcp_agent
    assert agent.process is not None
    proc = psutil.Process(agent.process.pid)
    size = 1024 * 1024
    head = http_bytes("POST", "/v1/leases", b"x" * size,
                      headers=f"Authorization: token {TOKEN}\r\n")[:-size]
    rss_before = proc.memory_info().rss
    held: list[socket.socket] = []
    buffered = 0
    try:
        for n in range(250):
            # Unix socket connections (root's), then TCP peers past it, each under its own share.
            if n < 100:
                sock = socket.socket(socket.AF_UNIX)
                sock.connect(agent.socket)
            else:
                sock = _connect(port, f"127.0.0.{2 + n % 10}")
            held.append(sock)
            sock.settimeout(5)
            with contextlib.suppress(OSError):  # refused: the agent closed it unread
                sock.sendall(head + b"x" * (size - 1))
            buffered += _waiting(sock, 0.2)
        rss_grown = proc.memory_info().rss - rss_before
        assert buffered * size <= BODY_BUFFER, buffered
        assert buffered * size >= BODY_BUFFER_PER_CALLER, buffered
        assert rss_grown < 3 * BODY_BUFFER, f"{rss_grown / 2**20:.0f} MiB more resident"
        # A request without a body is not held back.
        assert _node_seconds(agent) < 1.0
    finally:
        for sock in held:
            sock.close()
    # The bodies' room comes back as the agent sees their connections closed.
    wait_for(lambda: raw_request(agent.socket, http_bytes(
        "POST", "/v1/leases", b'{"client": "t", "request": "0.25"}'))[0] == 201,
        what="a lease (201) once the held bodies were let go")
