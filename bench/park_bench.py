"""Parking and re-attaching a notebook kernel, as delays a user sees, beside a cold start.

Runs a real agent (simulated 2-GPU node), a real jupyter_server and real ipykernel kernels,
once parking by freezing (the default) and once by a restart (``--no-freeze``), side by side.
For each state size a notebook holds that state (torch tensors, a model and its optimizer)
and is parked with ``%gpu park``. Measured:

- park: from the end of the ``%gpu park`` cell until the agent shows the lease parked
  (frozen: a durable checkpoint, then the freeze; restarted: the kernel's checkpoint with its
  tensors in host memory, a restart, a restore to host). On a simulated node a freeze only
  takes the memory off the GPU: the driver's copy (about a second per GiB on an H100) is
  bench/freeze_bench.py's, on a GPU;
- re-attach: the first cell of the parked kernel, from sending it until its reply, less the
  same cell in a kernel that was never parked (what the user waits for a GPU; the kernel's
  own "back on GPU in … s" line is printed beside it);
- cold start: from opening a notebook until ``import torch`` has run in its new kernel.

    python bench/park_bench.py --sizes 64,512 --repeat 3
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.migration_bench import CHECK, STATE, cold_start  # noqa: E402
from harness.agent import AgentProcess, wait_for  # noqa: E402
from harness.jupyter import Notebook, Server, start_server, stop_server  # noqa: E402

CONFIG = "c.GpuFrac.park_after = 0\nc.GpuFrac.lease_poll_interval = 0.5\n"
BACK = re.compile(r"back on GPU \S+ in ([0-9.]+) s")


def timed_cell(nb: Notebook, code: str) -> tuple[float, str]:
    t0 = time.perf_counter()
    out = nb.ok(code, timeout=600)
    return time.perf_counter() - t0, out


def lease_state(agent: AgentProcess, kernel_id: str) -> str:
    lease = next(x for x in agent.client().leases() if x.get("kernel_id") == kernel_id)
    return str(lease["state"])


def one_round(server: Server, agent: AgentProcess, nbytes: int, round_no: int,
              frozen: bool) -> dict[str, float]:
    cold, nb = cold_start(server, f"park-{nbytes}-{round_no}.ipynb", "import torch")
    nb.ok(STATE.format(n=nbytes), timeout=600)
    baseline, _ = timed_cell(nb, CHECK)
    nb.ok("%gpu park")
    t0 = time.perf_counter()
    wait_for(lambda: lease_state(agent, nb.kernel_id) == "parked", 600, "the park",
             interval=0.02)
    park = time.perf_counter() - t0
    if not frozen:
        # The restore in the parked process ends before it answers cells; wait for it as a
        # user who comes back later would find it.
        wait_for(lambda: server.kernel_status(nb.kernel_id)["restore"] is not None, 600,
                 "the restore", interval=0.05)
    first, out = timed_cell(nb, CHECK)
    found = BACK.search(out)
    nb.close()
    server.api(f"/api/kernels/{nb.kernel_id}", "DELETE")
    return {"cold": cold, "park": park, "reattach": first - baseline,
            "said": float(found.group(1)) if found else float("nan")}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="64,512", help="state sizes in MiB, comma-separated")
    parser.add_argument("--repeat", type=int, default=3, help="rounds per size (medians)")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    print(f"{'how':>9} {'state':>8} {'cold start':>11} {'park':>8} {'re-attach':>10} "
          f"{'kernel says':>12} {'re-attach/cold':>15}")
    for how, extra in (("frozen", []), ("restarted", ["--no-freeze"])):
        with tempfile.TemporaryDirectory(prefix="gpufrac-park-bench-") as tmp:
            root = Path(tmp)
            with AgentProcess(root / "agent", "2x4GiB", ["--poll-interval", "0.2", *extra]
                              ) as agent:
                server = start_server(root / "server", agent.socket, CONFIG)
                try:
                    for mib in sizes:
                        rounds = []
                        for i in range(args.repeat):
                            rounds.append(one_round(server, agent, mib << 20, i,
                                                    how == "frozen"))
                            print(f"  {how}: round {i + 1}/{args.repeat} of {mib} MiB done",
                                  file=sys.stderr, flush=True)
                        med = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
                        print(f"{how:>9} {mib:>4} MiB {med['cold']:>10.2f}s {med['park']:>7.2f}s "
                              f"{med['reattach']:>9.2f}s {med['said']:>11.2f}s "
                              f"{med['reattach'] / med['cold']:>15.2f}")
                finally:
                    stop_server(server)
    print("medians of", args.repeat, "rounds; re-attach = first cell after the park less the "
          "same cell unparked")
    return 0


if __name__ == "__main__":
    sys.exit(main())
