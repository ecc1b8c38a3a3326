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

    python bench/migration_bench.py --sizes 64,512 --repeat 2
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from harness.agent import AgentProcess, wait_for  # noqa: E402
from harness.jupyter import Notebook, Server, running_server  # noqa: E402

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


def one_round(server: Server, socket: str, nbytes: int, round_no: int) -> dict[str, float]:
    cold, first = cold_start(server, f"first-{round_no}.ipynb")
    _, second = cold_start(server, f"second-{round_no}.ipynb")
    second.ok(STATE.format(n=nbytes))
    raw = float(next(
        line.split()[1] for line in second.ok(RAW_IO).splitlines() if line.startswith("RAW ")
    ))
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
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="64,512", help="state sizes in MB, comma-separated")
    parser.add_argument("--repeat", type=int, default=1, help="rounds per size")
    args = parser.parse_args()
    sizes = [int(size) for size in args.sizes.split(",")]
    with tempfile.TemporaryDirectory(prefix="gpufrac-bench-") as tmp:
        agent_args = ("--poll-interval", "0.1", "--migrate-grace", "300")
        with AgentProcess(Path(tmp) / "agent", "2x16GiB", agent_args) as agent:
            config = "c.GpuFrac.lease_poll_interval = 60\n"
            with running_server(Path(tmp) / "server", agent.socket, config) as server:
                print(f"{'state':>8} {'migration':>10} {'cold start':>11} {'raw I/O':>8} "
                      f"{'ratio':>6} {'ckpt+restart':>13} {'restore':>8}")
                round_no = 0
                for size in sizes:
                    rounds = []
                    for _ in range(args.repeat):
                        round_no += 1
                        rounds.append(one_round(server, agent.socket, size * 10**6, round_no))
                    m = {key: statistics.median(r[key] for r in rounds) for key in rounds[0]}
                    ratio = m["migration"] / (m["cold"] + m["raw_io"])
                    note = "" if m["moved_state"] else "  (the empty notebook was moved)"
                    print(f"{size:>6}MB {m['migration']:>9.2f}s {m['cold']:>10.2f}s "
                          f"{m['raw_io']:>7.2f}s {ratio:>6.2f} {m['checkpoint_restart']:>12.2f}s "
                          f"{m['restore']:>7.2f}s{note}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
