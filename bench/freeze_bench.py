"""Freezing S GiB on a real GPU: the driver's own checkpoint, pinned copies, and the project's park."""

from __future__ import annotations

import argparse
import json
import logging
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from harness.agent import AgentProcess, nvml_memory_of, wait_for  # noqa: E402
from harness.jupyter import Server, start_server, stop_server  # noqa: E402
from node_agent.client import AgentClient  # noqa: E402
from node_agent.devices.cuda import DriverFreezer  # noqa: E402

GiB = 2**30
GOAL_S = 2.0  # the goals for 16 GiB on one H100: park and first cell each within 2 s
NEEDS_GPU = "freeze_bench: needs a CUDA GPU (and the driver's checkpoint API); nothing measured"

EPILOG = """\
Side by side, in one run, S GiB of float32 tensors (1 GiB each):
  (i)   the driver's own checkpoint of a plain process: lock+checkpoint, restore+unlock, and
        what NVML says the process holds before and after;
  (ii)  pinned host copies of the same S GiB (device to host, host to device): S / bandwidth;
  (iii) offload into pinned host memory first, freeze what is left (the context), then thaw
        and copy back;
  (iv)  through the project: a kernel of a real Jupyter server (embedded agent on NVML)
        holding S: %gpu park until frozen, its first cell after that; and a reclaim that
        freezes a borrower holding S (its own agent, a 2 s grace).
Medians of --runs; progress on stderr, results on stdout (and --out FILE as JSON).

    python bench/freeze_bench.py --gib 16 --runs 3 --out freeze.json
"""

# A process holding S GiB; it answers one JSON line per command read from stdin. CUDA calls
# block while it is frozen, so commands come only while it runs.
WORKER = r"""
import json, os, sys, time, torch
gib, n = int(sys.argv[1]), 2**28
dev = [torch.full((n,), float(i + 1), device="cuda") for i in range(gib)]
host = []
torch.cuda.synchronize()

def used():
    free, total = torch.cuda.mem_get_info()
    return total - free

def timed(work):
    t0 = time.perf_counter()
    work()
    torch.cuda.synchronize()
    return time.perf_counter() - t0

def pin():
    host[:] = [torch.empty(n, pin_memory=True) for _ in range(gib)]

def d2h():
    for d, h in zip(dev, host):
        h.copy_(d, non_blocking=True)

def h2d():
    for d, h in zip(dev, host):
        d.copy_(h, non_blocking=True)

def offload():
    d2h()
    torch.cuda.synchronize()
    dev.clear()
    torch.cuda.empty_cache()

def reload():
    dev[:] = [h.to("cuda", non_blocking=True) for h in host]

def check():
    return len(dev) == gib and all(bool((d == i + 1).all()) for i, d in enumerate(dev))

print(json.dumps({"pid": os.getpid(), "used": used()}), flush=True)
for line in sys.stdin:
    cmd = line.strip()
    if cmd == "quit":
        break
    if cmd == "check":
        print(json.dumps({"ok": check(), "used": used()}), flush=True)
        continue
    seconds = timed({"pin": pin, "d2h": d2h, "h2d": h2d, "offload": offload,
                     "reload": reload}[cmd])
    print(json.dumps({"seconds": seconds, "used": used()}), flush=True)
"""

STATE = """
import torch
xs = [torch.full((2**28,), float(i + 1), device="cuda") for i in range({gib})]
torch.cuda.synchronize()
"""
CHECK = "print(all(bool((x == i + 1).all()) for i, x in enumerate(xs)))"
# Shrunk to its request, a reclaimed kernel may not allocate on the GPU: read on the host.
CHECK_ON_HOST = ("print(all(bool((x[-4096:].cpu() == i + 1).all()) and float(x[:1].cpu()) == i + 1"
                 " for i, x in enumerate(xs)))")
FROZEN_IN = re.compile(r"frozen in host memory in ([0-9.]+) s")
BACK = re.compile(r"back on GPU \S+ in ([0-9.]+) s")


def say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def cuda_ready() -> str | None:
    """Why this machine cannot run the bench (None: it can); asked in a fresh process."""
    code = "import torch\nprint(torch.cuda.device_count() if torch.cuda.is_available() else 0)"
    try:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              timeout=120)
    except (OSError, subprocess.TimeoutExpired) as err:
        return str(err)
    if done.returncode != 0 or not int((done.stdout.strip() or "0").splitlines()[-1]):
        return "no CUDA device"
    return DriverFreezer().unavailable()


class Worker:
    """The WORKER process, on the first GPU."""

    def __init__(self, gib: int) -> None:
        self.process = subprocess.Popen([sys.executable, "-c", WORKER, str(gib)],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        hello = self.read()
        self.pid = int(hello["pid"])

    def read(self) -> dict[str, Any]:
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"the worker exited with status {self.process.wait()}")
        return dict(json.loads(line))

    def ask(self, command: str) -> dict[str, Any]:
        assert self.process.stdin is not None
        self.process.stdin.write(command + "\n")
        self.process.stdin.flush()
        return self.read()

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


def freeze_thaw(freezer: DriverFreezer, pid: int) -> dict[str, float]:
    """The driver's four calls on ``pid``, each timed, and what NVML lists before and frozen."""
    before = nvml_memory_of(pid)
    lock = timed(lambda: freezer.lock(pid, timeout=60))
    checkpoint = timed(lambda: freezer.checkpoint(pid))
    after = nvml_memory_of(pid)
    restore = timed(lambda: freezer.restore(pid))
    unlock = timed(lambda: freezer.unlock(pid))
    return {"freeze_s": lock + checkpoint, "thaw_s": restore + unlock, "nvml_before": before,
            "nvml_frozen": after, "lock_s": lock, "checkpoint_s": checkpoint,
            "restore_s": restore, "unlock_s": unlock}


def driver_rounds(gib: int, runs: int, freezer: DriverFreezer) -> list[dict[str, float]]:
    """(i): a plain process holding S, frozen and thawed by the driver."""
    worker = Worker(gib)
    try:
        rounds = []
        for i in range(runs):
            got = freeze_thaw(freezer, worker.pid)
            if not worker.ask("check")["ok"]:
                raise RuntimeError("the tensors changed across the driver's freeze and thaw")
            rounds.append(got)
            say(f"  driver round {i + 1}/{runs}: freeze {got['freeze_s']:.2f} s, "
                f"thaw {got['thaw_s']:.2f} s")
        return rounds
    finally:
        worker.close()


def pinned_rounds(gib: int, runs: int, freezer: DriverFreezer
                  ) -> tuple[float, list[dict[str, float]]]:
    """(ii) and (iii): pinned bandwidth, then offload + freeze the context + thaw + reload."""
    worker = Worker(gib)
    try:
        pin_s = worker.ask("pin")["seconds"]
        rounds = []
        for i in range(runs):
            d2h, h2d = worker.ask("d2h")["seconds"], worker.ask("h2d")["seconds"]
            offload = worker.ask("offload")
            got = freeze_thaw(freezer, worker.pid)
            reload = worker.ask("reload")["seconds"]
            if not worker.ask("check")["ok"]:
                raise RuntimeError("the tensors changed across offload, freeze, thaw and reload")
            rounds.append({"d2h_s": d2h, "h2d_s": h2d, "d2h_gbps": gib * GiB / d2h / 1e9,
                           "h2d_gbps": gib * GiB / h2d / 1e9, "offload_s": offload["seconds"],
                           "context_freeze_s": got["freeze_s"], "context_thaw_s": got["thaw_s"],
                           "context_nvml_before": got["nvml_before"],
                           "context_nvml_frozen": got["nvml_frozen"], "reload_s": reload,
                           "offload_park_s": offload["seconds"] + got["freeze_s"],
                           "offload_back_s": got["thaw_s"] + reload})
            say(f"  pinned round {i + 1}/{runs}: d2h {d2h:.2f} s, h2d {h2d:.2f} s, offload+freeze "
                f"{rounds[-1]['offload_park_s']:.2f} s, thaw+reload {rounds[-1]['offload_back_s']:.2f} s")
        return pin_s, rounds
    finally:
        worker.close()


def lease_of(c: AgentClient, kernel_id: str) -> dict[str, Any]:
    return next(x for x in c.leases() if x.get("kernel_id") == kernel_id)


def timed(work: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    work()
    return time.perf_counter() - t0


@contextmanager
def server_on(tmp: Path, socket: str, config: str = "",
              specs: dict[str, dict[str, Any]] | None = None) -> Iterator[Server]:
    server = start_server(tmp, socket, "c.GpuFrac.lease_poll_interval = 0.5\n" + config, specs)
    try:
        yield server
    finally:
        stop_server(server)


def park_round(server: Server, c: AgentClient, gib: int, i: int) -> dict[str, float]:
    """(iv): %gpu park until frozen, and the first cell after it, less the same cell unparked."""
    nb = server.open_notebook(f"freeze-{i}.ipynb")
    try:
        nb.ok(STATE.format(gib=gib), timeout=600)
        checkpoint = timed(lambda: nb.ok("%gpu checkpoint", timeout=900))  # idle, saved
        baseline = timed(lambda: nb.ok(CHECK))
        t0 = time.perf_counter()
        nb.ok("%gpu park")
        wait_for(lambda: lease_of(c, nb.kernel_id)["frozen"], 900, "the park", interval=0.02)
        park = time.perf_counter() - t0
        said = next((float(m.group(1)) for e in server.kernel_status(nb.kernel_id)["events"]
                     if (m := FROZEN_IN.search(str(e.get("message") or "")))), float("nan"))
        time.sleep(1)  # the kernel hears of the freeze; a user's next cell comes later anyway
        t0 = time.perf_counter()
        out = nb.ok(CHECK, timeout=600)
        first = time.perf_counter() - t0
        if "True" not in out:
            raise RuntimeError(f"the tensors changed across the park: {out}")
        back = BACK.search(out)
        return {"checkpoint_s": checkpoint, "park_s": park, "park_freeze_call_s": said,
                "first_cell_s": first, "first_cell_extra_s": first - baseline,
                "kernel_says_s": float(back.group(1)) if back else float("nan")}
    finally:
        nb.close()
        server.api(f"/api/kernels/{nb.kernel_id}", "DELETE")


def reclaim_round(server: Server, c: AgentClient, gib: int, usable: int, i: int
                  ) -> dict[str, float]:
    """(iv): an owner grows into what a borrower holding S borrowed; the borrower is frozen
    after the grace, and thaws once the owner is gone."""
    borrower = server.open_notebook(f"borrower-{i}.ipynb", kernel="borrower")
    owner = server.open_notebook(f"owner-{i}.ipynb", kernel="owner")
    try:
        borrower.ok(STATE.format(gib=gib), timeout=600)
        owner.ok("import torch\ntorch.empty(1, device='cuda')")
        lease = lease_of(c, borrower.kernel_id)
        _, cursor = c.directives(lease=lease["id"], after=-1, timeout=0)
        # Free memory under the headroom (half the GPU) while the owner is owed more than is free.
        grow = max(GiB, usable // 2 - gib * GiB) + GiB
        owner.ok(f"mine = torch.empty({grow}, dtype=torch.uint8, device='cuda')")
        t0 = time.perf_counter()
        wait_for(lambda: lease_of(c, borrower.kernel_id)["frozen"], 900, "the reclaim",
                 interval=0.02)
        frozen = time.perf_counter() - t0
        t0 = time.perf_counter()
        server.api(f"/api/kernels/{owner.kernel_id}", "DELETE")
        wait_for(lambda: lease_of(c, borrower.kernel_id)["state"] == "active", 900,
                 "the thaw", interval=0.02)
        thawed = time.perf_counter() - t0
        said = c.directives(lease=lease["id"], after=cursor, timeout=0,
                            kinds=("frozen", "unparked"))[0]
        seconds = {d["kind"]: float(d.get("seconds") or 0) for d in said}
        out = borrower.ok(CHECK_ON_HOST, timeout=600)
        if "True" not in out:
            raise RuntimeError(f"the tensors changed across the reclaim: {out}")
        return {"reclaim_until_frozen_s": frozen, "reclaim_freeze_s": seconds.get("frozen", 0.0),
                "room_until_thawed_s": thawed, "reclaim_thaw_s": seconds.get("unparked", 0.0)}
    finally:
        borrower.close()
        owner.close()
        server.api(f"/api/kernels/{borrower.kernel_id}", "DELETE")


def medians(rounds: list[dict[str, float]]) -> dict[str, float]:
    return {k: statistics.median(r[k] for r in rounds) for k in rounds[0]} if rounds else {}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, epilog=EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=int, default=16, help="GiB of tensors (default 16)")
    parser.add_argument("--runs", type=int, default=3, help="rounds of each (medians)")
    parser.add_argument("--skip-project", action="store_true",
                        help="only (i)-(iii): no Jupyter server")
    parser.add_argument("--out", help="also write the figures to this JSON file")
    args = parser.parse_args()
    why = cuda_ready()
    if why is not None:
        print(f"{NEEDS_GPU}: {why}")
        return 0
    freezer = DriverFreezer()
    logging.getLogger("node_agent.devices.cuda").setLevel(logging.INFO)
    gib, runs = args.gib, args.runs
    say(f"(i) the driver's checkpoint of {gib} GiB")
    driver = medians(driver_rounds(gib, runs, freezer))
    say(f"(ii)+(iii) pinned copies of {gib} GiB, and offload before the freeze")
    pin_s, pinned_list = pinned_rounds(gib, runs, freezer)
    pinned = medians(pinned_list)
    project: dict[str, float] = {}
    if not args.skip_project:
        with tempfile.TemporaryDirectory(prefix="gpufrac-freeze-bench-") as tmp:
            root = Path(tmp)
            socket = str(root / "embedded" / "agent.sock")
            say(f"(iv) %gpu park of a kernel holding {gib} GiB (embedded agent)")
            config = "c.GpuFrac.embedded_agent_simulate = ''\nc.GpuFrac.default_limit = '1'\n"
            with server_on(root / "server", socket, config) as server:
                c = AgentClient(socket)
                # The server starts its embedded agent in the background.
                wait_for(c.ping, 60, "the embedded agent to answer", interval=0.2)
                if c.node()["simulated"]:
                    raise RuntimeError("the embedded agent simulates a node: NVML did not start")
                rounds = []
                for i in range(runs):
                    rounds.append(park_round(server, c, gib, i))
                    say(f"  park round {i + 1}/{runs}: park {rounds[-1]['park_s']:.2f} s, "
                        f"first cell {rounds[-1]['first_cell_s']:.2f} s")
                project.update(medians(rounds))
            say(f"(iv) a reclaim that freezes a borrower holding {gib} GiB")
            with AgentProcess(root / "agent", None, ["--poll-interval", "0.2", "--reclaim-grace",
                                                     "2", "--headroom", "0.5",
                                                     "--no-node-scheduler"]) as agent:
                c = agent.client()
                gpu = c.node()["gpus"][0]
                usable = int(gpu["memory_total"]) - int(gpu.get("memory_reserved") or 0)
                owner = str(usable - GiB)
                specs = {"borrower": {"gpufrac": {"request": "256Mi", "limit": "1"}},
                         "owner": {"gpufrac": {"request": owner, "limit": owner}}}
                with server_on(root / "server2", agent.socket, "", specs) as server:
                    rounds = []
                    for i in range(runs):
                        rounds.append(reclaim_round(server, c, gib, usable, i))
                        say(f"  reclaim round {i + 1}/{runs}: frozen after "
                            f"{rounds[-1]['reclaim_until_frozen_s']:.2f} s")
                    project.update(medians(rounds))
    report(gib, runs, pin_s, driver, pinned, project, args.out)
    return 0


def report(gib: int, runs: int, pin_s: float, driver: dict[str, float],
           pinned: dict[str, float], project: dict[str, float], out: str | None) -> None:
    copy_s = gib * GiB / (pinned["d2h_gbps"] * 1e9)
    back_s = gib * GiB / (pinned["h2d_gbps"] * 1e9)
    print(f"freeze_bench: {gib} GiB, medians of {runs} run(s)")
    print(f"(i)   driver: lock+checkpoint {driver['freeze_s']:.2f} s (lock "
          f"{driver.get('lock_s', float('nan')):.3f}, checkpoint "
          f"{driver.get('checkpoint_s', float('nan')):.2f}); restore+unlock "
          f"{driver['thaw_s']:.2f} s; NVML {driver['nvml_before'] / 2**20:.0f} MiB -> "
          f"{driver['nvml_frozen'] / 2**20:.0f} MiB")
    print(f"(ii)  pinned: device->host {pinned['d2h_gbps']:.1f} GB/s (S/bw {copy_s:.2f} s), "
          f"host->device {pinned['h2d_gbps']:.1f} GB/s (S/bw {back_s:.2f} s); pinning "
          f"{pin_s:.2f} s once")
    print(f"(iii) offload then freeze the context: {pinned['offload_park_s']:.2f} s (copy "
          f"{pinned['offload_s']:.2f} + freeze {pinned['context_freeze_s']:.2f}, NVML "
          f"{pinned['context_nvml_before'] / 2**20:.0f} -> "
          f"{pinned['context_nvml_frozen'] / 2**20:.0f} MiB); thaw then reload: "
          f"{pinned['offload_back_s']:.2f} s (thaw {pinned['context_thaw_s']:.2f} + copy "
          f"{pinned['reload_s']:.2f})")
    print(f"      driver / offload: freeze x{driver['freeze_s'] / pinned['offload_park_s']:.1f}, "
          f"thaw x{driver['thaw_s'] / pinned['offload_back_s']:.1f}")
    figures: dict[str, Any] = {"gib": gib, "runs": runs, "pin_s": pin_s, "driver": driver,
                               "pinned": pinned, "project": project}
    if project:
        park, first = project["park_s"], project["first_cell_s"]
        print(f"(iv)  project: %gpu park until frozen {park:.2f} s (durable checkpoint before "
              f"it {project['checkpoint_s']:.2f} s; the freeze call {project['park_freeze_call_s']:.2f}"
              f" s); first cell {first:.2f} s ({project['first_cell_extra_s']:.2f} s more than "
              f"unparked; the kernel says {project['kernel_says_s']:.2f} s)")
        print(f"      reclaim: frozen {project['reclaim_until_frozen_s']:.2f} s after the "
              f"owner's allocation (2 s grace; freeze {project['reclaim_freeze_s']:.2f} s); "
              f"thawed {project['room_until_thawed_s']:.2f} s after room returned (thaw "
              f"{project['reclaim_thaw_s']:.2f} s)")
        ratios = {"park/driver_checkpoint": park / driver["freeze_s"],
                  "park/S_over_d2h": park / copy_s,
                  "first_cell/driver_restore": first / driver["thaw_s"],
                  "first_cell/S_over_h2d": first / back_s}
        print("      ratios: " + ", ".join(f"{k} {v:.2f}" for k, v in ratios.items()))
        goals = {"park <= 2 s": park <= GOAL_S, "first cell <= 2 s": first <= GOAL_S}
        scale = "" if gib == 16 else f" (the goals are for 16 GiB; this run held {gib} GiB)"
        print("goals" + scale + ": " + ", ".join(
            f"{k}: {'pass' if ok else 'FAIL'}" for k, ok in goals.items()))
        figures.update(ratios=ratios, goals=goals)
    if out:
        Path(out).write_text(json.dumps(figures, indent=2) + "\n")
        say(f"wrote {out}")


if __name__ == "__main__":
    sys.exit(main())
