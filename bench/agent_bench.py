"""Agent benchmark: placement latency through the socket, compaction decision time, idle CPU.

Prints figures and ratios measured side by side in one run; medians, since machines are noisy.
Run: python bench/agent_bench.py
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from node_agent import policy
from node_agent.client import AgentClient

GiB = 2**30


def start_agent(tmp: Path, *args: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "node_agent", "serve", "--socket", str(tmp / "agent.sock"),
         "--state-dir", str(tmp / "state"), "--log-level", "warning", *args],
        stdout=subprocess.PIPE, text=True,
    )
    assert proc.stdout is not None and "ready" in proc.stdout.readline()
    return proc


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def placement_latency() -> None:
    print("== placement latency through the socket: 64 leases on 8 simulated GPUs")
    with tempfile.TemporaryDirectory() as d:
        agent = start_agent(Path(d), "--simulate", "8x80GiB")
        try:
            c = AgentClient(str(Path(d) / "agent.sock"))
            leases = [c.create_lease(client="bench", request="0.0625", limit="0.5")["id"]
                      for _ in range(64)]
            floor, place, release = [], [], []
            for i in range(400):
                t0 = time.perf_counter()
                c.node()
                t1 = time.perf_counter()
                lease = c.create_lease(client="bench", request="0.0625", limit="0.5")
                t2 = time.perf_counter()
                c.release(leases[i % 64])
                t3 = time.perf_counter()
                leases[i % 64] = lease["id"]
                floor.append(t1 - t0)
                place.append(t2 - t1)
                release.append(t3 - t2)
            for name, xs in (("GET /v1/node (floor)", floor), ("POST /v1/leases", place),
                             ("DELETE /v1/leases/<id>", release)):
                print(f"   {name:24s} p50 {statistics.median(xs) * 1e3:6.2f} ms   "
                      f"p99 {pct(xs, 0.99) * 1e3:6.2f} ms")
            print(f"   placement / floor (p50): {statistics.median(place) / statistics.median(floor):.2f}x")
        finally:
            agent.terminate()
            agent.wait()


def compaction_decision() -> None:
    print("== compaction decision time: 8 GPUs x 256 leases (pure policy)")
    devices = [policy.Device(f"GPU-{i}", i, 80 * GiB) for i in range(8)]
    leases: list[policy.Placement] = []
    request = 80 * GiB // 64
    for i in range(256):
        logical = policy.plan_logical(devices, leases, request)
        assert logical is not None
        physical = policy.plan_physical(devices, leases, policy.NOTEBOOK, request, logical)
        leases.append(policy.Placement(f"l-{i:03d}", policy.NOTEBOOK, request, logical, physical,
                                       usage=((i * 7919) % 61 + 1) * 64 * 2**20, created=float(i)))
    for label, need in (("whole GPU", 80 * GiB), ("0.75 GPU", 60 * GiB)):
        target = policy.plan_logical(devices, leases, need)
        assert target is not None
        times, moves = [], []
        for _ in range(15):
            t0 = time.perf_counter()
            moves = policy.plan_compaction(devices, leases, {target[0]: need}) or []
            times.append(time.perf_counter() - t0)
        moved = sum(m.moved_bytes for m in moves) / GiB
        everyone = sum(p.usage for p in leases if target[0] in p.physical) / GiB
        print(f"   job of {label:9s}: median {statistics.median(times) * 1e3:6.2f} ms, "
              f"{len(moves)} moves, {moved:.1f} GiB moved "
              f"(moving every notebook off that GPU: {everyone:.1f} GiB)")
    times = []
    for _ in range(15):
        t0 = time.perf_counter()
        policy.plan_logical(devices, leases, request)
        times.append(time.perf_counter() - t0)
    print(f"   logical placement of one more lease: median {statistics.median(times) * 1e3:.3f} ms")


def idle_cpu() -> None:
    print("== agent CPU use at the default poll interval (1 s), 64 leases with live processes")
    with tempfile.TemporaryDirectory() as d:
        agent = start_agent(Path(d), "--simulate", "8x80GiB")
        sleepers = [subprocess.Popen(["sleep", "600"]) for _ in range(64)]
        try:
            c = AgentClient(str(Path(d) / "agent.sock"))
            for s in sleepers:
                c.register_pid(c.create_lease(client="bench", request="0.125")["id"], s.pid)
            me = psutil.Process(agent.pid)
            samples = []
            for _ in range(3):
                cpu0, t0 = sum(me.cpu_times()[:2]), time.monotonic()
                time.sleep(5)
                samples.append((sum(me.cpu_times()[:2]) - cpu0) / (time.monotonic() - t0))
            print(f"   CPU: median {statistics.median(samples) * 100:.2f}% of one core "
                  f"(samples {', '.join(f'{s * 100:.2f}%' for s in samples)})")
            rss = me.memory_info().rss / 2**20
            print(f"   agent resident memory: {rss:.0f} MiB")
        finally:
            for s in sleepers:
                s.kill()
                s.wait()
            agent.terminate()
            agent.wait()


if __name__ == "__main__":
    placement_latency()
    compaction_decision()
    idle_cpu()
