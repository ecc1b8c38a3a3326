"""Load benchmark: N clients loop status, lease, release, a connection each; prints figures beside goals."""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import math
import multiprocessing
import os
import random
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from multiprocessing.queues import Queue
from multiprocessing.synchronize import Barrier
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parents[1]
READY = "gpufrac-agent: ready on"
ENDPOINTS = ("GET /v1/node", "POST /v1/leases", "DELETE /v1/leases/<id>")
# 8 x 80 GiB holds 2560 leases of 256 MiB: far more than the clients can hold at once,
# so a 409 (node full) would mean leases leak rather than that the node is too small.
NODE = "8x80GiB"
REQUEST = "256Mi"

# Goals: p99 latency, refused connections, RSS growth over the run, CPU while idle.
GOAL_P99_MS = 50.0
GOAL_RSS_RATIO = 1.10
GOAL_IDLE_CPU = 1.0


class UnixHTTPConnection(http.client.HTTPConnection):
    """HTTP/1.1 over AF_UNIX; connect() raises as the socket does, without waiting or retrying
    (unlike AgentClient, which waits out a full listen queue: here a refusal is a figure)."""

    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("agent", timeout=timeout)
        self.unix_path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self.unix_path)
        except OSError:
            sock.close()
            raise
        self.sock = sock


class Refused(Exception):
    """The agent did not take the connection: ECONNREFUSED, or EAGAIN (listen queue full)."""


class Stats:
    """What one client (or, merged, all of them) saw during the measured window."""

    # A plain class, not a dataclass: tests/test_bench_scripts.py loads this file without
    # registering it in sys.modules, where dataclasses cannot resolve postponed annotations.
    def __init__(self) -> None:
        self.latencies: list[list[float]] = [[] for _ in ENDPOINTS]  # seconds, per endpoint
        self.statuses: Counter[int] = Counter()
        self.refused = 0
        self.errors: Counter[str] = Counter()
        self.leftover: list[str] = []  # leases whose release failed

    def merge(self, other: Stats) -> None:
        for mine, theirs in zip(self.latencies, other.latencies, strict=True):
            mine.extend(theirs)
        self.statuses.update(other.statuses)
        self.refused += other.refused
        self.errors.update(other.errors)
        self.leftover.extend(other.leftover)


def call(path: str, timeout: float, method: str, target: str,
         body: dict[str, Any] | None = None) -> tuple[int, bytes]:
    """One request on a fresh connection: (status, body). Raises Refused, or what the socket raised."""
    conn = UnixHTTPConnection(path, timeout)
    try:
        try:
            conn.connect()
        except (ConnectionRefusedError, BlockingIOError) as exc:
            raise Refused from exc
        payload = None if body is None else json.dumps(body)
        headers = {"Content-Type": "application/json"} if payload is not None else {}
        conn.request(method, target, body=payload, headers=headers)
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def timed(stats: Stats | None, endpoint: int, path: str, timeout: float, method: str, target: str,
          body: dict[str, Any] | None = None) -> tuple[int, bytes] | None:
    """``call`` with its outcome recorded in ``stats`` (None: warm-up, nothing recorded);
    None when no response came back."""
    t0 = time.perf_counter()
    try:
        status, raw = call(path, timeout, method, target, body)
    except Refused:
        if stats is not None:
            stats.refused += 1
        return None
    except TimeoutError:
        if stats is not None:
            stats.errors["timeout"] += 1
        return None
    except (OSError, http.client.HTTPException) as exc:
        if stats is not None:
            stats.errors[type(exc).__name__] += 1
        return None
    if stats is not None:
        stats.latencies[endpoint].append(time.perf_counter() - t0)
        stats.statuses[status] += 1
    return status, raw


def cycle(stats: Stats | None, path: str, timeout: float, client: str) -> None:
    """What a notebook server does for one kernel: look at the node, take a lease, give it back."""
    timed(stats, 0, path, timeout, "GET", "/v1/node")
    created = timed(stats, 1, path, timeout, "POST", "/v1/leases",
                    {"kind": "notebook", "client": client, "request": REQUEST, "devices": 1})
    if created is None or created[0] != 201:
        return  # refused, failed, or 409 (node full): nothing to give back
    lease_id = json.loads(created[1])["id"]
    released = timed(stats, 2, path, timeout, "DELETE", f"/v1/leases/{lease_id}")
    if (released is None or released[0] != 204) and stats is not None:
        stats.leftover.append(lease_id)


def client_thread(stats: Stats, path: str, timeout: float, client: str, warmup: int,
                  deadline: float | None, pace: float) -> None:
    """``warmup`` unrecorded cycles when ``deadline`` is None, else recorded cycles until it,
    one every ``pace`` seconds (0: back to back)."""
    if deadline is None:
        for _ in range(warmup):
            cycle(None, path, timeout, client)
        return
    # Paced clients start at random offsets, as independent notebooks would.
    start = time.monotonic() + random.uniform(0, pace)
    while start < deadline:
        time.sleep(max(0.0, start - time.monotonic()))
        cycle(stats, path, timeout, client)
        start = max(start + pace, time.monotonic()) if pace else time.monotonic()


def run_threads(clients: int, worker: int, path: str, timeout: float, warmup: int,
                deadline: float | None, pace: float) -> Stats:
    """``clients`` threads of ``client_thread``; what they saw, merged."""
    per_client = [Stats() for _ in range(clients)]
    threads = [threading.Thread(target=client_thread, daemon=True,
                                args=(per_client[i], path, timeout, f"load-{worker}-{i}", warmup,
                                      deadline, pace))
               for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    merged = Stats()
    for stats in per_client:
        merged.merge(stats)
    return merged


def worker_main(worker: int, clients: int, path: str, timeout: float, warmup: int, seconds: float,
                pace: float, barrier: Barrier, results: Queue[tuple[Stats, float, float]]) -> None:
    """One process of client threads: warm up, wait while the parent reads RSS, then load.
    Sends back its stats, when it ended (CLOCK_MONOTONIC is system-wide) and the CPU it used."""
    run_threads(clients, worker, path, timeout, warmup, None, pace)
    barrier.wait()  # warmed up
    barrier.wait()  # the parent has its starting RSS: go
    cpu = time.process_time()
    stats = run_threads(clients, worker, path, timeout, warmup, time.monotonic() + seconds, pace)
    results.put((stats, time.monotonic(), time.process_time() - cpu))


def start_agent(tmp: Path) -> subprocess.Popen[bytes]:
    """The agent on a simulated node at its default poll interval, once it says it is ready."""
    log = tmp / "agent.log"
    with open(log, "wb") as out:
        # One uid here stands for many users: lift the per-user lease cap (root has none anyway).
        agent = subprocess.Popen(
            [sys.executable, "-m", "node_agent", "serve", "--simulate", NODE,
             "--socket", str(tmp / "agent.sock"), "--state-dir", str(tmp / "state"),
             "--max-leases-per-user", "100000", "--log-level", "warning"],
            cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        )
    deadline = time.monotonic() + 30
    while READY not in log.read_text(errors="replace"):
        if agent.poll() is not None or time.monotonic() > deadline:
            agent.kill()
            sys.exit(f"the agent did not start:\n{log.read_text(errors='replace')}")
        time.sleep(0.05)
    return agent


def leases_after(path: str, lease_ids: list[str]) -> int:
    """Give back leases whose release failed under load (not measured), then count what the
    agent still holds: anything left is a lease it lost track of."""
    for lease_id in lease_ids:
        # One that fails again is counted below, since it is still there.
        with contextlib.suppress(Refused, OSError, http.client.HTTPException):
            call(path, 10.0, "DELETE", f"/v1/leases/{lease_id}")
    status, raw = call(path, 10.0, "GET", "/v1/leases")
    return len(json.loads(raw)["leases"]) if status == 200 else -1


def pct(values: list[float], q: float) -> float:
    """The ``q`` quantile (nearest rank), nan for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1)]


def latency_line(name: str, xs: list[float]) -> str:
    ms = [x * 1e3 for x in xs]
    return (f"   {name:24s} n {len(ms):7d}   p50 {pct(ms, 0.5):7.2f}   p90 {pct(ms, 0.9):7.2f}   "
            f"p99 {pct(ms, 0.99):7.2f}   max {max(ms, default=math.nan):8.2f} ms")


def report(stats: Stats, window: float, rss_start: int, rss_end: int, idle_cpu: float,
           leases_left: int, log_text: str, load_cpu: tuple[float, float]) -> None:
    """Print the figures, then each goal beside what was measured. ``load_cpu``: the agent's
    and the client processes' CPU during the load, in % of one core."""
    every = [x for xs in stats.latencies for x in xs]
    done = len(every)
    failed = sum(stats.errors.values())
    attempts = done + stats.refused + failed
    status_5xx = sum(n for s, n in stats.statuses.items() if s >= 500)
    status_409 = stats.statuses[409]
    status_4xx = sum(n for s, n in stats.statuses.items() if 400 <= s < 500) - status_409
    print(f"== results over {window:.1f} s")
    print(f"   requests done: {done} ({done / window:.0f} req/s), attempts {attempts}")
    print(latency_line("all requests", every))
    for name, xs in zip(ENDPOINTS, stats.latencies, strict=True):
        print(latency_line(name, xs))
    print(f"   refused connections: {stats.refused} ({100 * stats.refused / max(attempts, 1):.2f}% "
          "of attempts)")
    print(f"   HTTP 5xx: {status_5xx}   HTTP 409 (node full): {status_409}   other 4xx: {status_4xx}"
          f"   timeouts: {stats.errors['timeout']}")
    others = {k: v for k, v in stats.errors.items() if k != "timeout"}
    print(f"   other errors: {', '.join(f'{k} {v}' for k, v in sorted(others.items())) or 'none'}")
    print(f"   status codes: {', '.join(f'{s}: {n}' for s, n in sorted(stats.statuses.items()))}")
    print(f"   leases still held after the run: {leases_left}")
    print(f"   agent RSS: start {rss_start / 2**20:.1f} MiB, end {rss_end / 2**20:.1f} MiB "
          f"(end/start {rss_end / rss_start:.3f})")
    # The agent and the clients share the machine's cores: this says which side was saturated.
    print(f"   CPU during the load ({os.cpu_count()} cores): agent {load_cpu[0]:.0f}% of one core, "
          f"client processes {load_cpu[1]:.0f}% of one core in all")
    print(f"   agent CPU while idle: {idle_cpu:.2f}% of one core")
    warnings = [line for line in log_text.splitlines()
                if any(f" {level} " in line for level in ("WARNING", "ERROR", "CRITICAL"))]
    print(f"   agent log lines (warning and above): {len(warnings)}"
          + (f"; first: {warnings[0][:160]}" if warnings else ""))

    p99 = pct(every, 0.99) * 1e3
    goals = (
        ("p99 latency", f"<= {GOAL_P99_MS:g} ms", f"{p99:.2f} ms", p99 <= GOAL_P99_MS),
        ("refused connections", "0", str(stats.refused), stats.refused == 0),
        ("RSS end / start", f"<= {GOAL_RSS_RATIO:.2f}", f"{rss_end / rss_start:.3f}",
         rss_end <= rss_start * GOAL_RSS_RATIO),
        ("idle CPU", f"<= {GOAL_IDLE_CPU:g} %", f"{idle_cpu:.2f} %", idle_cpu <= GOAL_IDLE_CPU),
    )
    print("== goals")
    for name, goal, measured, met in goals:
        print(f"   {name:20s} goal {goal:10s} measured {measured:10s} {'met' if met else 'not met'}")


def split(total: int, parts: int) -> list[int]:
    """``total`` clients over ``parts`` processes, as evenly as it goes (no empty process)."""
    parts = max(1, min(parts, total))
    return [total // parts + (i < total % parts) for i in range(parts)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=200, help="concurrent clients (default 200)")
    parser.add_argument("--seconds", type=float, default=60.0, help="measured load (default 60)")
    parser.add_argument("--idle-seconds", type=float, default=10.0,
                        help="CPU measured while idle after the load (default 10)")
    parser.add_argument("--workers", type=int, default=min(8, 2 * (os.cpu_count() or 2)),
                        help="client processes, so that Python's GIL is not what limits the clients")
    parser.add_argument("--warmup-cycles", type=int, default=3,
                        help="unmeasured cycles per client before the starting RSS (default 3)")
    parser.add_argument("--timeout", type=float, default=10.0, help="per-request timeout (default 10 s)")
    parser.add_argument("--pace", type=float, default=0.0, metavar="S",
                        help="each client starts a cycle every S seconds (default 0: back to "
                             "back, which measures the agent saturated)")
    args = parser.parse_args()

    shares = split(args.clients, args.workers)
    print(f"== load: {args.clients} clients in {len(shares)} processes for {args.seconds:g} s, "
          f"each looping GET /v1/node + POST /v1/leases ({REQUEST}) + DELETE "
          f"{f'every {args.pace:g} s' if args.pace else 'back to back'}, a connection per "
          f"request; simulated node {NODE}, default poll interval")
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        path = str(tmp / "agent.sock")
        agent = start_agent(tmp)
        try:
            me = psutil.Process(agent.pid)
            # fork: the workers need nothing from a fresh interpreter, and start at once.
            ctx = multiprocessing.get_context("fork")
            # Time limits, so that a worker that died ends the run instead of hanging it.
            barrier = ctx.Barrier(len(shares) + 1, timeout=3 * args.warmup_cycles * args.timeout + 60)
            results: Queue[tuple[Stats, float, float]] = ctx.Queue()
            workers = [ctx.Process(target=worker_main, daemon=True,
                                   args=(w, n, path, args.timeout, args.warmup_cycles, args.seconds,
                                         args.pace, barrier, results))
                       for w, n in enumerate(shares)]
            for w in workers:
                w.start()
            barrier.wait()  # every client has warmed up; nothing is in flight
            rss_start = me.memory_info().rss
            barrier.wait()
            started = time.monotonic()
            me.cpu_percent()  # starts the agent's CPU count over the load
            stats, ended, client_cpu = Stats(), started, 0.0
            for _ in workers:  # drain before join: a large result would block its sender
                part, finished, cpu = results.get(timeout=args.seconds + 3 * args.timeout + 60)
                stats.merge(part)
                ended, client_cpu = max(ended, finished), client_cpu + cpu
            load_cpu = me.cpu_percent()
            for w in workers:
                w.join()
            leases_left = leases_after(path, stats.leftover)
            rss_end = me.memory_info().rss
            idle_cpu = me.cpu_percent(interval=args.idle_seconds)
        finally:
            agent.terminate()
            agent.wait()
        window = ended - started
        report(stats, window, rss_start, rss_end, idle_cpu, leases_left,
               (tmp / "agent.log").read_text(errors="replace"),
               (load_cpu, 100 * client_cpu / window))


if __name__ == "__main__":
    main()
