"""A hostile neighbour's floods against a real agent, and what another user's requests take meanwhile.

Issue #36: a user in a PID namespace of its own with 1,000 sleepers registering pids nobody has
(10 a second), 256 connections scraping /metrics, and connections without the token filling the
TCP slots. For each: another user's GET /v1/node, median and p95 (goal: p95 <= 50 ms), and over
TCP how many of the token holder's requests were answered. Needs root (other uids, a PID
namespace); the uids need no accounts.
Run: python bench/neighbour_bench.py [--seconds 10]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import selectors
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

VICTIM, ATTACKER = 60001, 60002
TOKEN = "neighbour-bench-token-0123456789"
CLONE_NEWPID = 0x20000000
GOAL_P95_MS = 50.0


def request(method: str, target: str, body: bytes = b"", token: str | None = None) -> bytes:
    auth = f"Authorization: token {token}\r\n" if token else ""
    return (f"{method} {target} HTTP/1.1\r\nHost: agent\r\n{auth}Content-Length: {len(body)}"
            "\r\n\r\n").encode() + body


def read_response(sock: socket.socket) -> tuple[int, bytes]:
    """One HTTP response from a keep-alive connection: (status, body)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("closed")
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                   if line.lower().startswith(b"content-length:")), 0)
    while len(body) < length:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("closed")
        body += chunk
    return int(head.split()[1]), body[:length]


def call(path: str, method: str, target: str, body: bytes = b"") -> tuple[int, Any]:
    with socket.socket(socket.AF_UNIX) as sock:
        sock.settimeout(30)
        sock.connect(path)
        sock.sendall(request(method, target, body))
        status, data = read_response(sock)
    return status, json.loads(data) if data else None


def as_uid(uid: int, fn: Callable[[], Any]) -> tuple[int, int]:
    """Run ``fn`` in a child as ``uid``: (pid, pipe of its JSON answer)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        try:
            os.setgroups([])
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)
            out = {"ok": fn()}
        except BaseException as exc:
            out = {"crash": repr(exc)}
        os.write(write, json.dumps(out).encode())
        os._exit(0)
    os.close(write)
    return pid, read


def answer(child: tuple[int, int]) -> Any:
    pid, read = child
    data = b""
    while chunk := os.read(read, 65536):
        data += chunk
    os.close(read)
    os.waitpid(pid, 0)
    out = json.loads(data)
    if "ok" not in out:
        raise RuntimeError(out)
    return out["ok"]


def victim_latencies(path: str, seconds: float) -> list[float]:
    """The victim: GET /v1/node on one keep-alive connection, 20 a second, for ``seconds``."""
    times: list[float] = []
    with socket.socket(socket.AF_UNIX) as sock:
        sock.settimeout(30)
        sock.connect(path)
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            started = time.perf_counter()
            sock.sendall(request("GET", "/v1/node"))
            status, _ = read_response(sock)
            times.append((time.perf_counter() - started) * 1000)
            assert status == 200, status
            time.sleep(0.05)
    return times


def scrape_flood(path: str, connections: int, seconds: float) -> int:
    """The attacker: ``connections`` keep-alive connections, each asking for /metrics again as
    soon as it is answered; how many answers it got."""
    sel = selectors.DefaultSelector()
    pending: dict[socket.socket, bytes] = {}
    for _ in range(connections):
        sock = socket.socket(socket.AF_UNIX)
        sock.connect(path)
        sock.setblocking(False)
        sock.send(request("GET", "/metrics"))
        pending[sock] = b""
        sel.register(sock, selectors.EVENT_READ)
    answered = 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for key, _ in sel.select(0.5):
            sock = key.fileobj
            assert isinstance(sock, socket.socket)
            data = pending[sock] + sock.recv(1 << 20)
            head, sep, body = data.partition(b"\r\n\r\n")
            if not sep:
                pending[sock] = data
                continue
            length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length:"))
            if len(body) < length:
                pending[sock] = data
                continue
            answered += 1
            pending[sock] = body[length:]
            sock.send(request("GET", "/metrics"))
    for sock in pending:
        sock.close()
    return answered


def pid_flood(path: str, sleepers: int, rate: float, seconds: float) -> Any:
    """The attacker in a PID namespace of its own with ``sleepers`` processes: ``rate``
    registrations a second of pids nobody has. Runs as root until the fork inside."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWPID) != 0:
        raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWPID)")

    def inside() -> dict[str, int]:
        children = []
        for _ in range(sleepers):
            pid = os.fork()
            if pid == 0:
                signal.pause()
                os._exit(0)
            children.append(pid)
        status, lease = call(path, "POST", "/v1/leases", b'{"client": "m", "request": "0.1"}')
        assert status == 201, (status, lease)
        asked = refused = 0
        end = time.monotonic() + seconds
        try:
            while time.monotonic() < end:
                status, _ = call(path, "POST", f"/v1/leases/{lease['id']}/pids",
                                 json.dumps({"pid": 100000 + asked}).encode())
                asked += 1
                refused += status >= 400
                time.sleep(1 / rate)
        finally:
            for pid in children:
                os.kill(pid, signal.SIGKILL)
        return {"asked": asked, "refused": refused}

    return answer(as_uid(ATTACKER, inside))


def tcp_holder(port: int, idle: int) -> dict[str, int]:
    """Others hold ``idle`` token-less connections from each of 127.0.0.1-6; then the token
    holder asks 50 times from 127.0.0.1, a fresh connection each time."""
    held = []
    for n in range(1, 7):
        for _ in range(idle):
            sock = socket.socket()
            sock.bind((f"127.0.0.{n}", 0))
            sock.connect(("127.0.0.1", port))
            held.append(sock)
    answered = 0
    for _ in range(50):
        with socket.socket() as sock:
            sock.settimeout(10)
            sock.connect(("127.0.0.1", port))
            sock.sendall(request("GET", "/v1/node", token=TOKEN))
            with suppress(ConnectionError, TimeoutError):
                answered += read_response(sock)[0] == 200
    for sock in held:
        sock.close()
    return {"asked": 50, "answered": answered}


@contextmanager
def running_agent(port: int) -> Iterator[str]:
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        tmp.chmod(0o755)
        token = tmp / "token"
        token.write_text(TOKEN)
        token.chmod(0o600)
        sock = str(tmp / "agent.sock")
        proc = subprocess.Popen(
            [sys.executable, "-m", "node_agent", "serve", "--simulate", "4x80GiB", "--socket",
             sock, "--state-dir", str(tmp / "state"), "--log-level", "warning",
             "--tcp", f"127.0.0.1:{port}", "--token-file", str(token)],
            stdout=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parents[1])
        try:
            assert proc.stdout is not None and "ready" in proc.stdout.readline()
            yield sock
        finally:
            proc.terminate()
            proc.wait()


def line(name: str, times: list[float]) -> str:
    p95 = statistics.quantiles(times, n=20)[-1]
    verdict = "ok" if p95 <= GOAL_P95_MS else "OVER"
    return (f"{name:<44} median {statistics.median(times):7.1f} ms   p95 {p95:7.1f} ms "
            f"({len(times)} requests; goal p95 <= {GOAL_P95_MS:g} ms: {verdict})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=10.0)
    seconds = parser.parse_args().seconds
    if os.geteuid() != 0:
        raise SystemExit("run it as root: it acts as other uids and makes a PID namespace")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with running_agent(port) as path:
        for uid in (VICTIM, ATTACKER):  # eight leases each
            answer(as_uid(uid, lambda: [call(path, "POST", "/v1/leases",
                                            b'{"client": "x", "request": "0.01"}')
                                       for _ in range(8)]))
        print(line("alone", answer(as_uid(VICTIM, lambda: victim_latencies(path, seconds)))))

        flood = as_uid(0, lambda: pid_flood(path, 1000, 10, seconds + 2))
        time.sleep(1)  # the sleepers are forked
        print(line("pid registrations from a namespace (10/s)",
                   answer(as_uid(VICTIM, lambda: victim_latencies(path, seconds)))))
        print(f"  the attacker's registrations: {answer(flood)}")

        flood = as_uid(ATTACKER, lambda: scrape_flood(path, 256, seconds + 1))
        print(line("/metrics from 256 connections",
                   answer(as_uid(VICTIM, lambda: victim_latencies(path, seconds)))))
        print(f"  the attacker's scrapes answered: {answer(flood)}")

        held = tcp_holder(port, 60)
        print(f"{'TCP: token holder among 360 token-less':<44} answered {held['answered']} of "
              f"{held['asked']} (goal: all)")


if __name__ == "__main__":
    main()
