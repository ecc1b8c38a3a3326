"""What the automatic checkpoint costs a cell (issue 27), side by side in one run.

Real kernels: one without the extension, and one with it (checkpoints after every cell, their
changed bytes copied at the cell's end and written in the background); the same cells in each,
timed from the execute request to its reply (the reply and ``idle`` go out once the cell and the
post-cell hook are done), each checkpoint durable before the next cell (cells that follow each
other sooner: ``steady_cells_bench.py``). Cells:

- the 850 MB namespace of issue #11 (bench/checkpoint_bench.py's cells, at ``--scale``);
- one that changes all of a 4 GiB host tensor (``--big-gib``);
- one that changes 1 % of a 1 GiB tensor.

For each: the overhead (with - without, medians) against max(50 ms, 1.5 x changed bytes /
memcpy bandwidth, measured here), and the time until the checkpoint is durable against 1.2 x a
raw write + fsync of the bytes it wrote. Then, in this process, the kernel-thread part of a
checkpoint of the 850 MB namespace (first, nothing changed).

    python bench/cell_overhead_bench.py                 # the figures (needs ~14 GiB free)
    python bench/cell_overhead_bench.py --scale 0.05 --big-gib 0.25 --runs 3   # a quick check
    python bench/cell_overhead_bench.py --gpu-gib 16         # and 16 GiB of GPU tensors (a GPU)
"""

from __future__ import annotations

import argparse
import ast
import gc
import mmap
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import checkpoint_bench

GiB = 2**30
MiB = 2**20
HOOK = "__import__('jupyter_gpufrac.kernel', fromlist=['x'])._hook"


class Kernel:
    """A real IPython kernel, with or without the extension."""

    def __init__(self, ckdir: Path | None) -> None:
        from jupyter_client.manager import KernelManager

        self.hooked = ckdir is not None
        env = {k: v for k, v in os.environ.items() if not k.startswith("GPUFRAC_")}
        repo = str(Path(__file__).resolve().parent.parent)
        env["PYTHONPATH"] = os.pathsep.join([repo, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        env["CUDA_VISIBLE_DEVICES"] = env.get("CUDA_VISIBLE_DEVICES", "")
        args = ["--IPKernelApp.log_level=ERROR"]  # not the warning about TCP, once per kernel
        if ckdir is not None:
            env["GPUFRAC_CHECKPOINT_DIR"] = str(ckdir)
            args.append("--ext=jupyter_gpufrac.kernel")
        self.km = KernelManager(kernel_name="python3")
        self.km.start_kernel(extra_arguments=args, env=env)
        self.client = self.km.client()
        self.client.start_channels()
        self.client.wait_for_ready(timeout=120)

    def run(self, code: str, *, silent: bool = False, timeout: float = 1800) -> float:
        """Seconds from the request to its reply; raises on an error."""
        started = time.perf_counter()
        reply = self.client.execute_interactive(code, silent=silent, timeout=timeout,
                                                output_hook=lambda msg: None)
        took = time.perf_counter() - started
        if reply["content"]["status"] != "ok":
            raise RuntimeError(f"cell failed: {reply['content'].get('evalue')}\n{code[:200]}")
        return took

    def value(self, expression: str) -> Any:
        """``expression`` evaluated in the kernel (a literal: what its repr reads back as)."""
        printed: list[str] = []

        def output(msg: dict[str, Any]) -> None:
            if msg["msg_type"] == "stream" and msg["content"]["name"] == "stdout":
                printed.append(msg["content"]["text"])

        reply = self.client.execute_interactive(f"print(repr({expression}))", silent=False,
                                                store_history=False, output_hook=output)
        if reply["content"]["status"] != "ok":
            raise RuntimeError(f"{expression} failed: {reply['content'].get('evalue')}")
        return ast.literal_eval("".join(printed).strip().splitlines()[-1])

    def durable(self) -> float:
        """Seconds until the checkpoints taken so far are on disk (0 without the extension)."""
        if not self.hooked:
            return 0.0
        return self.run(f"{HOOK}.checkpointer.flush()", silent=True)

    def stop(self) -> None:
        self.client.stop_channels()
        self.km.shutdown_kernel(now=False)


@contextmanager
def kernel(ckdir: Path | None) -> Iterator[Kernel]:
    k = Kernel(ckdir)
    try:
        yield k
    finally:
        k.stop()


def gpu_scenario(gpu_gib: float, runs: int) -> dict[str, Any]:
    """A cell that changes all of ``gpu_gib`` GiB of GPU tensors (2 GiB each) and waits for its
    GPU work, as a training step that reads its loss does: the goal is 0.1 s over a kernel
    without the extension (issue 35), its copies ordered on the stream, never waited for."""
    count = max(1, round(gpu_gib / 2))
    each = int(gpu_gib * GiB) // count // 4
    return {"name": f"changes all of {count * each * 4 / GiB:.0f} GiB of GPU tensors",
            "setup": ["import torch",
                      f"gpu = [torch.zeros({each}, device='cuda') for _ in range({count})]"],
            "cell": "for _t in gpu:\n    _t.add_(1)\ntorch.cuda.synchronize()",
            "changed": count * each * 4, "runs": max(3, runs), "goal": 0.1,
            "cleanup": "del gpu\ntorch.cuda.empty_cache()"}


def scenarios(scale: float, big_gib: float, runs: int) -> list[dict[str, Any]]:
    """(name, setup cells, the timed cell, changed bytes, runs)."""
    big = int(big_gib * GiB) // 4
    one = int(GiB * min(1.0, max(big_gib, scale))) // 4
    return [
        {"name": f"850 MB namespace's cells at scale {scale}", "setup": ["import torch"],
         "cell": "\n".join(checkpoint_bench.cells(scale)), "changed": None, "runs": 1,
         "reset": "for _n in [n for n in list(globals()) if not n.startswith('_') and n not in "
                  "('In', 'Out', 'get_ipython', 'exit', 'quit', 'torch')]: del globals()[_n]"},
        {"name": f"changes all of a {big * 4 / GiB:.2f} GiB host tensor",
         "setup": ["import torch", f"big = torch.zeros({big}, dtype=torch.float32)"],
         "cell": "big.add_(1)", "changed": big * 4, "runs": max(1, runs if big_gib < 2 else 1),
         "cleanup": "del big"},
        {"name": f"changes 1 % of a {one * 4 / GiB:.2f} GiB tensor",
         "setup": ["import torch", f"g = torch.zeros({one}, dtype=torch.float32)"],
         "cell": f"g[:{one // 100}] += 1", "changed": one * 4 // 100, "storage": one * 4,
         "runs": runs, "cleanup": "del g"},
    ]


def time_cells(k: Kernel, case: dict[str, Any]) -> tuple[list[float], list[float]]:
    """(cell seconds, seconds from the request until the checkpoint was durable) per run."""
    for cell in case["setup"]:
        k.run(cell)
    k.durable()
    cells, durable = [], []
    for _ in range(case["runs"]):
        started = time.perf_counter()
        cells.append(k.run(case["cell"]))
        k.durable()
        durable.append(time.perf_counter() - started)
        if case.get("reset"):
            k.run(case["reset"])
            k.durable()
    if case.get("cleanup"):
        k.run(case["cleanup"])
        k.durable()
    return cells, durable


def memcpy_bandwidth(nbytes: int) -> tuple[float, float]:
    """Bytes/s of one copy into memory touched before, and into fresh memory."""
    source = mmap.mmap(-1, nbytes)
    source.write(b"\1" * min(nbytes, 64 * MiB))
    view = memoryview(source)
    target = mmap.mmap(-1, nbytes)
    tv = memoryview(target)
    tv[:] = view  # touched once
    warm = []
    for _ in range(3):
        started = time.perf_counter()
        tv[:] = view
        warm.append(time.perf_counter() - started)
    tv.release()
    target.close()
    fresh = []
    for _ in range(2):
        target = mmap.mmap(-1, nbytes)
        started = time.perf_counter()
        with memoryview(target) as tv:
            tv[:] = view
        fresh.append(time.perf_counter() - started)
        target.close()
    view.release()
    source.close()
    return nbytes / min(warm), nbytes / min(fresh)


def raw_write_fsync(root: Path, nbytes: int) -> float:
    """Seconds to write ``nbytes`` from memory into one file and fsync it."""
    source = mmap.mmap(-1, nbytes)
    path = root / "raw.bin"
    try:
        started = time.perf_counter()
        checkpoint_bench.raw_write(path, memoryview(source))
        return time.perf_counter() - started
    finally:
        path.unlink(missing_ok=True)
        source.close()


def kernel_thread_part(scale: float, runs: int, root: Path) -> tuple[float, list[float], float]:
    """Seconds of :meth:`Checkpointer.begin` for the namespace: the first, with nothing
    changed (each), and the first's write until durable."""
    from jupyter_gpufrac.kernel.checkpoint import Checkpointer

    ns = checkpoint_bench.build_namespace(scale)
    ck = Checkpointer(root / "inproc")
    started = time.perf_counter()
    job = ck.begin(ns, execution_count=1)
    first = time.perf_counter() - started
    job.wait()
    durable = time.perf_counter() - started
    same = []
    for count in range(runs):
        started = time.perf_counter()
        ck.begin(ns, execution_count=2 + count)
        same.append(time.perf_counter() - started)
    ck.flush()
    del ns
    gc.collect()
    return first, same, durable


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--scale", type=float, default=1.0, help="of the 850 MB namespace")
    parser.add_argument("--big-gib", type=float, default=4.0, help="the host tensor changed whole")
    parser.add_argument("--runs", type=int, default=5, help="of each small cell (medians)")
    parser.add_argument("--dir", type=Path, default=None, help="where checkpoints go")
    parser.add_argument("--gpu-gib", type=float, default=0.0,
                        help="also a cell changing this many GiB of GPU tensors (needs a GPU)")
    args = parser.parse_args()
    base = args.dir or Path(tempfile.mkdtemp(prefix="gpufrac-cell-bench-"))
    base.mkdir(parents=True, exist_ok=True)
    cases = scenarios(args.scale, args.big_gib, args.runs)
    if args.gpu_gib:
        cases.append(gpu_scenario(args.gpu_gib, args.runs))
        os.environ.setdefault("CUDA_VISIBLE_DEVICES", "0")  # the kernels' (else they see none)
    measure = int(min(GiB, max(64 * MiB, args.big_gib * GiB / 4)))
    warm_bw, fresh_bw = memcpy_bandwidth(measure)
    print(f"memcpy: {warm_bw / 1e9:.2f} GB/s into memory touched before, {fresh_bw / 1e9:.2f} "
          f"GB/s into fresh memory ({measure / MiB:.0f} MiB, best of 3 and 2)")
    times: dict[str, dict[str, tuple[list[float], list[float]]]] = {}
    for label, ckdir in (("without", None), ("with", base / "ck")):
        times[label] = {}
        with kernel(ckdir) as k:
            for case in cases:
                times[label][case["name"]] = time_cells(k, case)
    print(f"\n{'cell':44} {'without':>8} {'with':>8} {'overhead':>9} {'goal':>7}  met")
    for case in cases:
        plain = statistics.median(times["without"][case["name"]][0])
        hooked = statistics.median(times["with"][case["name"]][0])
        changed = case["changed"]
        goal = case.get("goal") or (0.05 if changed is None else max(0.05, 1.5 * changed / warm_bw))
        met = "yes" if hooked - plain <= goal else "NO"
        print(f"{case['name'][:44]:44} {plain * 1e3:7.0f}m {hooked * 1e3:7.0f}m "
              f"{(hooked - plain) * 1e3:8.0f}m {goal * 1e3:6.0f}m  {met}")
    print(f"\n{'durable after the cell':44} {'with':>8} {'raw+fsync':>10} {'with/raw':>9} "
          f"{'goal':>7}  met")
    for case in cases:
        nbytes = case.get("storage") or case["changed"]
        if nbytes is None:
            continue
        hooked = statistics.median(times["with"][case["name"]][1])
        raw = raw_write_fsync(base, nbytes)
        met = "yes" if hooked <= 1.2 * raw else "NO"
        print(f"{case['name'][:44]:44} {hooked:7.2f}s {raw:9.2f}s {hooked / raw:9.2f} "
              f"{'<= 1.2':>7}  {met}")
    first, same, durable = kernel_thread_part(args.scale, max(5, args.runs * 5), base)
    print(f"\nin-process, the kernel-thread part of a checkpoint of the namespace at scale "
          f"{args.scale}: first {first * 1e3:.0f} ms (durable {durable:.2f} s after), nothing "
          f"changed {statistics.median(same) * 1e3:.1f} ms (median of {len(same)}; "
          f"{min(same) * 1e3:.1f}-{max(same) * 1e3:.1f})")


if __name__ == "__main__":
    main()
