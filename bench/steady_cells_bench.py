"""Cells that follow each other while the last checkpoint is written (issue 38), side by side in one run.

A stock kernel and one with the extension, started afresh for each case and each round (stock,
ours, ours, stock: a machine whose speed drifts weighs on both alike), run the same cells one
after the other, ``--gap`` seconds apart (from a reply to the next request, as a user or a
"Run all" would): in-place updates and new objects of ``--sizes`` GiB, as PyTorch host tensors,
NumPy arrays and a pandas frame. For each case, medians over the cells after two warm-up ones:

- the cell's own time, measured inside the cell, in each kernel, and their ratio (goal <= 1.2);
- the wall overhead: the extension's request-to-reply time less the stock kernel's, against
  max(50 ms, 1.5 x the bytes the cell changed / the memcpy bandwidth measured in this run);
- once the cells stop, how long until the last cell's state is durable, and the most memory
  the kernel held beyond the stock kernel's (its copies for the writer).

Last, in this process: why not a forked child (the design before issue 38), the same in-place
update of 1 GiB while a child holds a copy-on-write snapshot, against the update alone.

    python bench/steady_cells_bench.py                      # the figures (needs ~14 GiB free)
    python bench/steady_cells_bench.py --sizes 0.25 --cells 4 --kinds "torch in place"
    python bench/steady_cells_bench.py --sizes 4 --gaps 0.5 --kinds "numpy new" --values random
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cell_overhead_bench import GiB, kernel, memcpy_bandwidth

WARM_UP = 2
SETUP = "import time as __t__\n__bench__ = []\n"
TIMED = "__s__ = __t__.perf_counter()\n{cell}\n__bench__.append(__t__.perf_counter() - __s__)"
# name: (setup, cell, fraction of the size the cell changes)
KINDS: dict[str, tuple[str, str, float]] = {
    "torch in place": ("import torch\nw = {torch_fill}({n4})", "w.mul_(0.999).add_(0.001)", 1.0),
    "torch new": ("import torch\nbase = {torch_fill}({n4})", "w2 = base.clone()\nw2.add_(1.0)", 1.0),
    "numpy in place": ("import numpy\na = {numpy_fill}({n8})", "a *= 0.999\na += 0.001", 1.0),
    "numpy new": ("import numpy\nbase = {numpy_fill}({n8})", "a2 = base + 1.0", 1.0),
    "pandas column": ("import numpy, pandas\ndf = pandas.DataFrame({{'x': {numpy_fill}({n8})}})",
                      "df['x'] = df['x'] * 0.999 + 0.001", 1.0),
    "pandas new": ("import numpy, pandas\ndf = pandas.DataFrame({{'x': {numpy_fill}({n8})}})",
                   "df2 = df + 1.0", 1.0),
}
# What the tensors hold: ones (the figures before 2026-12-07 evening) are compressed by the
# writer where a sample shows it pays (NumPy's and pandas' buffers; torch storages are not), so
# those rows write a fraction of what real floats would; random values do not compress.
FILLS = {"ones": {"torch_fill": "torch.ones", "numpy_fill": "numpy.ones"},
         "random": {"torch_fill": "torch.rand", "numpy_fill": "numpy.random.default_rng(0).random"}}
GPU_KINDS: dict[str, tuple[str, str, float]] = {
    "torch cuda in place": ("import torch\nw = {torch_fill}({n4}, device='cuda')",
                            "w.mul_(0.999).add_(0.001)\ntorch.cuda.synchronize()", 1.0),
    "torch cuda new": ("import torch\nbase = {torch_fill}({n4}, device='cuda')",
                       "w2 = base.clone()\nw2.add_(1.0)\ntorch.cuda.synchronize()", 1.0),
}


class Peak:
    """The most memory (RSS) process ``pid`` held while it is followed, sampled every 20 ms."""

    def __init__(self, pid: int) -> None:
        self._process = psutil.Process(pid)
        self.most = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._follow, daemon=True)
        self._thread.start()

    def _follow(self) -> None:
        while not self._stop.wait(0.02):
            try:
                self.most = max(self.most, self._process.memory_info().rss)
            except psutil.Error:
                return

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.most


def run_case(ckdir: Path | None, setup: str, cell: str, cells: int, gap: float
             ) -> dict[str, Any]:
    """One kernel through one case: own times, wall times, peak memory, time until durable."""
    with kernel(ckdir) as k:
        k.run(SETUP + setup)
        k.durable()
        pid = int(k.km.provisioner.pid)  # type: ignore[union-attr]
        peak = Peak(pid)
        walls = []
        for _ in range(WARM_UP + cells):
            walls.append(k.run(TIMED.format(cell=cell)))
            time.sleep(gap)
        until_durable = k.durable()
        most = peak.stop()
        own = k.value("__bench__")
        return {"own": own[WARM_UP:], "wall": walls[WARM_UP:], "peak": most,
                "durable": until_durable}


def pooled(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The rounds of one kernel together: every cell's times, the largest peak, the median
    time until durable."""
    return {"own": [t for run in runs for t in run["own"]],
            "wall": [t for run in runs for t in run["wall"]],
            "peak": max(run["peak"] for run in runs),
            "durable": statistics.median(run["durable"] for run in runs)}


def fork_while_writing(nbytes: int) -> tuple[float, float]:
    """(seconds, seconds): an in-place update of ``nbytes`` alone, and while a forked child holds
    a copy-on-write snapshot of it (medians of 3)."""
    import torch

    w = torch.ones(nbytes // 4)
    alone, forked = [], []
    for _ in range(3):
        started = time.perf_counter()
        w.mul_(0.999).add_(0.001)
        alone.append(time.perf_counter() - started)
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child holds the snapshot until the parent is done
            os.close(write)
            os.read(read, 1)
            os.kill(os.getpid(), signal.SIGKILL)
        started = time.perf_counter()
        w.mul_(0.999).add_(0.001)
        forked.append(time.perf_counter() - started)
        os.write(write, b"x")
        os.waitpid(pid, 0)
        os.close(read)
        os.close(write)
    return statistics.median(alone), statistics.median(forked)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="1,4", help="GiB each cell works on, comma-separated")
    parser.add_argument("--gaps", default="0.5,2", help="seconds between cells, comma-separated")
    parser.add_argument("--kinds", default=",".join(KINDS), help="which cells, comma-separated")
    parser.add_argument("--cells", type=int, default=6, help="timed cells per case, after 2 more")
    parser.add_argument("--rounds", type=int, default=2, help="of each kernel per case")
    parser.add_argument("--gpu", action="store_true", help="the CUDA cases too (needs a GPU)")
    parser.add_argument("--values", choices=sorted(FILLS), default="ones",
                        help="what the tensors hold (random: bytes that do not compress)")
    parser.add_argument("--dir", type=Path, default=None,
                        help="where checkpoints go (in a folder removed at the end)")
    args = parser.parse_args()
    base = Path(tempfile.mkdtemp(prefix="gpufrac-steady-bench-", dir=args.dir))
    kinds = {name: KINDS[name] for name in args.kinds.split(",") if name}
    if args.gpu:
        kinds.update(GPU_KINDS)
    sizes = [float(s) for s in args.sizes.split(",")]
    gaps = [float(g) for g in args.gaps.split(",")]
    warm_bw, _fresh = memcpy_bandwidth(int(min(GiB, max(sizes) * GiB)))
    print(f"memcpy: {warm_bw / 1e9:.2f} GB/s; {args.cells} timed cells a case after {WARM_UP}; "
          f"medians; values: {args.values}; checkpoints in {base}\n")
    print(f"{'case':34} {'own stock':>9} {'own ours':>9} {'ratio':>6} {'overhead':>9} "
          f"{'goal':>7} {'met':>4} {'durable':>8} {'memory +':>9}")
    try:
        count = 0
        for size in sizes:
            n = int(size * GiB)
            for gap in gaps:
                for name, (setup, cell, changed) in kinds.items():
                    count += 1
                    code = setup.format(n4=n // 4, n8=n // 8, **FILLS[args.values])
                    runs: dict[str, list[dict[str, Any]]] = {"stock": [], "ours": []}
                    pair = [("stock", None), ("ours", base / f"case-{count}")]
                    for turn in range(args.rounds):
                        for label, ckdir in pair if turn % 2 == 0 else pair[::-1]:
                            runs[label].append(run_case(ckdir, code, cell, args.cells, gap))
                    shutil.rmtree(base / f"case-{count}", ignore_errors=True)  # GiBs a case
                    stock, ours = (pooled(runs["stock"]), pooled(runs["ours"]))
                    own_s, own_o = statistics.median(stock["own"]), statistics.median(ours["own"])
                    overhead = statistics.median(ours["wall"]) - statistics.median(stock["wall"])
                    goal = max(0.05, 1.5 * changed * n / warm_bw)
                    met = "yes" if own_o <= 1.2 * own_s and overhead <= goal else "NO"
                    print(f"{f'{name}, {size:g} GiB, {gap:g} s apart':34} {own_s * 1e3:8.0f}m "
                          f"{own_o * 1e3:8.0f}m {own_o / own_s:6.2f} {overhead * 1e3:8.0f}m "
                          f"{goal * 1e3:6.0f}m {met:>4} {ours['durable']:7.2f}s "
                          f"{(ours['peak'] - stock['peak']) / GiB:8.2f}G", flush=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    alone, forked = fork_while_writing(int(min(sizes) * GiB))
    print(f"\nwhy not fork: an in-place update of {min(sizes):g} GiB took {alone * 1e3:.0f} ms "
          f"alone and {forked * 1e3:.0f} ms while a forked child held a copy-on-write snapshot "
          f"({forked / alone:.1f}x): every page it writes is copied, one fault at a time")
    print("(durable: from the last cell's reply until its state is on disk; memory +: the "
          "kernel's peak RSS less the stock kernel's)")


if __name__ == "__main__":
    main()
