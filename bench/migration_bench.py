"""Migration time end to end, as a ratio to a kernel's cold start plus a raw write and read of its state.

Runs a real agent (simulated 2-GPU node), a real jupyter_server and real ipykernel kernels.
For each state size: two notebooks are spread over both GPUs, the second holds the state
(torch tensors, a model and its optimizer); a whole-GPU job arrives and the second notebook
is moved. Measured:

- migration: from the job's start until the moved notebook answers a cell that checks its state
  (directive latency + checkpoint + restart on the other GPU + restore);
- cold start: from opening a notebook until ``import torch`` has run in its new kernel;
- raw I/O: ``torch.save`` (fsynced) then ``torch.load`` of the same state, inside the kernel,
  on the checkpoint disk.

Side by side in one run, two servers on the same agent: one without spare kernels, one with
(``c.GpuFrac.spare_kernels``); rounds alternate between them, each move on the second starts
in a ready spare (torch already imported), and the table ends with the ratios spares/none.

    python bench/migration_bench.py --sizes 64,512 --repeat 3
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from harness.agent import AgentProcess, wait_for  # noqa: E402
from harness.jupyter import Notebook, Server, start_server, stop_server  # noqa: E402

STATE = """
import torch
torch.manual_seed(0)
state = {{"blob": torch.randn({n} // 4), "small": [torch.randn(64, 64) for _ in range(8)]}}
model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
opt = torch.optim.Adam(model.parameters())
model(torch.randn(4, 256)).sum().backward()
opt.step()
checksum = float(state["blob"].sum())
"""
CHECK = (
    "assert float(state['blob'].sum()) == checksum\n"
    "assert opt.param_groups[0]['params'][0] is model[0].weight"
)
RAW_IO = """
import os, time, torch
_path = os.path.join(os.environ["GPUFRAC_CHECKPOINT_DIR"], "raw-io.pt")
_t0 = time.perf_counter()
with open(_path, "wb") as _f:
    torch.save({"state": state, "model": model, "opt": opt}, _f)
    _f.flush()
    os.fsync(_f.fileno())  # as durable as a checkpoint, which fsyncs what it writes
_back = torch.load(_path, weights_only=False)
print("RAW", time.perf_counter() - _t0)
os.remove(_path)
del _back
"""


def cold_start(server: Server, name: str) -> tuple[float, Notebook]:
    t0 = time.perf_counter()
    nb = server.open_notebook(name)
    nb.ok("import torch")
    return time.perf_counter() - t0, nb


def spare_ready(server: Server) -> bool:
    """A spare kernel is ready that no move has taken yet (the server's log says both)."""
    log = server.log_text()
    return len(re.findall(r"spare kernel \d+ ready in", log)) > log.count("started in spare kernel")


def one_round(server: Server, socket: str, nbytes: int, round_no: int,
              spares: bool) -> dict[str, float]:
    cold, first = cold_start(server, f"first-{round_no}.ipynb")
    _, second = cold_start(server, f"second-{round_no}.ipynb")
    second.ok(STATE.format(n=nbytes))
    raw = float(next(
        line.split()[1] for line in second.ok(RAW_IO).splitlines() if line.startswith("RAW ")
    ))
    if spares:
        wait_for(lambda: spare_ready(server), 120, "a ready spare kernel", interval=0.1)
    t0 = time.perf_counter()
    job = subprocess.Popen(
        [sys.executable, "-m", "node_agent", "--socket", socket, "run", "--gpus", "1", "--", "true"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    mover = wait_for(
        lambda: next((nb for nb in (first, second) if "restored" in server.events(nb.kernel_id)), None),
        300, "a notebook to be moved and restored", interval=0.05,
    )
    mover.ok(CHECK if mover is second else "pass")
    total = time.perf_counter() - t0
    job.wait(120)
    events = {e["event"]: e["time"] for e in server.kernel_status(mover.kernel_id)["events"]}
    for nb in (first, second):
        nb.close()
        server.api(f"/api/kernels/{nb.kernel_id}", "DELETE")
    return {
        "migration": total,
        "cold": cold,
        "raw_io": raw,
        "checkpoint_restart": events["migrated"] - events["migrating"],
        "restore": events["restored"] - events["migrated"],
        "moved_state": float(mover is second),
        "adopted": float(f"kernel {mover.kernel_id}: started in spare kernel" in server.log_text()),
    }


def report(size: int, label: str, rounds: list[dict[str, float]]) -> dict[str, float]:
    m = {key: statistics.median(r[key] for r in rounds) for key in rounds[0]}
    ratio = m["migration"] / (m["cold"] + m["raw_io"])
    note = "" if m["moved_state"] else "  (the empty notebook was moved)"
    adopted = sum(int(r["adopted"]) for r in rounds)
    print(f"{size:>6}MB {label:>7} {m['migration']:>9.2f}s {m['cold']:>10.2f}s "
          f"{m['raw_io']:>7.2f}s {ratio:>6.2f} {m['checkpoint_restart']:>12.2f}s "
          f"{m['restore']:>7.2f}s {adopted:>3}/{len(rounds)}{note}", flush=True)
    return m


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="64,512", help="state sizes in MB, comma-separated")
    parser.add_argument("--repeat", type=int, default=3, help="moves per size and server")
    parser.add_argument("--spares", choices=("both", "on", "off"), default="both",
                        help="servers with spare kernels, without, or both side by side")
    args = parser.parse_args()
    sizes = [int(size) for size in args.sizes.split(",")]
    modes = {"both": ["off", "on"], "on": ["on"], "off": ["off"]}[args.spares]
    with tempfile.TemporaryDirectory(prefix="gpufrac-bench-") as tmp:
        agent_args = ("--poll-interval", "0.1", "--migrate-grace", "300")
        with AgentProcess(Path(tmp) / "agent", "2x16GiB", agent_args) as agent:
            servers: dict[str, Server] = {}
            try:
                for mode in modes:
                    config = ("c.GpuFrac.lease_poll_interval = 60\n"
                              f"c.GpuFrac.spare_kernels = {mode == 'on'}\n")
                    servers[mode] = start_server(Path(tmp) / f"server-{mode}", agent.socket, config)
                print(f"{'state':>8} {'spares':>7} {'migration':>10} {'cold start':>11} "
                      f"{'raw I/O':>8} {'ratio':>6} {'ckpt+restart':>13} {'restore':>8} {'adopted':>7}")
                round_no = 0
                for size in sizes:
                    rounds: dict[str, list[dict[str, float]]] = {mode: [] for mode in modes}
                    for _ in range(args.repeat):
                        for mode in modes:  # alternating: drift on the machine hits both alike
                            round_no += 1
                            rounds[mode].append(one_round(servers[mode], agent.socket,
                                                          size * 10**6, round_no, mode == "on"))
                    medians = {mode: report(size, mode, rounds[mode]) for mode in modes}
                    if len(modes) == 2:
                        on, off = medians["on"], medians["off"]
                        print(f"{size:>6}MB {'on/off':>7} {on['migration'] / off['migration']:>9.2f}x "
                              f"{'':>11} {'':>8} {'':>6} "
                              f"{on['checkpoint_restart'] / off['checkpoint_restart']:>12.2f}x "
                              f"{on['restore'] / off['restore']:>7.2f}x "
                              f"(saved {off['migration'] - on['migration']:.2f} s a move)", flush=True)
            finally:
                for server in servers.values():
                    stop_server(server)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
