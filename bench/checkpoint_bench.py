"""Checkpoint benchmark: throughput against raw fsynced I/O, and the cost of a no-change checkpoint.

Run: python bench/checkpoint_bench.py [--mib 512] [--runs 5] [--dir DIR]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # torch warns when numpy is absent
    import torch

from jupyter_gpufrac.kernel.checkpoint import Checkpointer
from jupyter_gpufrac.kernel.tensor_io import host_view

MiB = 1024**2


def median_time(fn: Callable[[], Any], runs: int, before: Callable[[], Any] = lambda: None) -> float:
    times = []
    for _ in range(runs):
        before()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def raw_write(path: Path, tensors: list[torch.Tensor]) -> None:
    """The floor: the same bytes into one file, one fsync."""
    with open(path, "wb", buffering=0) as fh:
        for t in tensors:
            fh.write(host_view(t.untyped_storage()))
        os.fsync(fh.fileno())


def raw_read(path: Path, total: int) -> None:
    buffer = torch.empty(total, dtype=torch.uint8)
    view = host_view(buffer.untyped_storage())
    with open(path, "rb", buffering=0) as fh:
        done = 0
        while done < total:
            got = fh.readinto(view[done:])
            if not got:
                break
            done += got


def throughput(root: Path, mib: int, runs: int) -> None:
    count = 16
    per = mib * MiB // count // 4
    ns: dict[str, Any] = {f"t{i}": torch.randn(per) for i in range(count)}
    ns["model"] = torch.nn.Linear(256, 256)
    tensors = [v for v in ns.values() if isinstance(v, torch.Tensor)]
    tensors += list(ns["model"].parameters())
    total = sum(t.untyped_storage().nbytes() for t in tensors)
    raw = root / "raw.bin"
    ck_dir = root / "throughput"

    def fresh() -> None:
        # Each run writes new files, as a first checkpoint does; deleting the previous run's
        # files and flushing everything happens outside the timed part, for both contenders.
        shutil.rmtree(ck_dir, ignore_errors=True)
        raw.unlink(missing_ok=True)
        os.sync()

    t_raw_w = median_time(lambda: raw_write(raw, tensors), runs, fresh)
    t_ck = median_time(lambda: Checkpointer(ck_dir).take(ns), runs, fresh)
    raw_write(raw, tensors)
    t_raw_r = median_time(lambda: raw_read(raw, total), runs)
    t_load = median_time(lambda: Checkpointer(ck_dir).load({}), runs)
    gbs = total / 1e9
    print(f"data: {total / MiB:.0f} MiB in {len(tensors)} tensors; medians of {runs} runs; "
          f"reads come from the page cache (dropping it needs privileges we lack)")
    print(f"  raw write+fsync   {t_raw_w:7.3f} s  {gbs / t_raw_w:6.2f} GB/s")
    print(f"  checkpoint        {t_ck:7.3f} s  {gbs / t_ck:6.2f} GB/s  "
          f"ratio to raw {t_raw_w / t_ck:.2f}")
    print(f"  raw read          {t_raw_r:7.3f} s  {gbs / t_raw_r:6.2f} GB/s")
    print(f"  restore           {t_load:7.3f} s  {gbs / t_load:6.2f} GB/s  "
          f"ratio to raw {t_raw_r / t_load:.2f}")


def incremental(root: Path, runs: int) -> None:
    ns: dict[str, Any] = {"__name__": "__main__"}
    for i in range(800):
        ns[f"v{i}"] = {"i": i, "name": f"value {i}", "items": list(range(10))}
    for i in range(200):
        ns[f"t{i}"] = torch.randn(64 * 1024)  # 256 KiB each, 50 MiB in all
    ck = Checkpointer(root / "incremental")
    first = ck.take(ns)
    results = []

    def again() -> None:
        results.append(ck.take(ns))

    t = median_time(again, runs)
    written = max(r.bytes_written for r in results)
    print(f"incremental, nothing changed: 1,000 variables (200 tensors, "
          f"{first.tensors_bytes / MiB:.0f} MiB): median {t * 1000:.1f} ms, "
          f"{written} tensor bytes written (first checkpoint {first.seconds:.3f} s)")
    ns["t7"].add_(1)
    one = ck.take(ns)
    print(f"incremental, one tensor changed: {one.seconds * 1000:.1f} ms, "
          f"{one.bytes_written / 1024:.0f} KiB written")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--mib", type=int, default=512, help="tensor data for throughput")
    parser.add_argument("--runs", type=int, default=5, help="runs per figure (median)")
    parser.add_argument("--dir", help="where to write (default: a temporary directory)")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="gpufrac-bench-", dir=args.dir))
    try:
        print(f"filesystem of {root}; torch {torch.__version__}, {os.cpu_count()} CPUs")
        throughput(root, args.mib, args.runs)
        incremental(root, args.runs)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
