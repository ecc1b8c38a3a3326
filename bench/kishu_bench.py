"""Kishu beside our checkpoints on the same cells: bytes on disk, save, and a cold load.

Kishu (https://github.com/illinoisdata/kishu) checkpoints a notebook after every cell from inside
its kernel and restores a commit with ``checkout``. This runs ``checkpoint_bench``'s three cells
(issue #11's namespace) in a real kernel of ``--python`` (an interpreter with ``kishu``
installed: ``make bench`` makes one in ``.venv-kishu``, as Kishu's pins are not ours), then
checks the last cell's commit out in a new kernel, and checks that the namespace came back
equal. Printed, as medians of ``--runs`` runs, beside our first checkpoint and our restore of the
same namespace, measured in this run:

- bytes on disk: Kishu's database against our checkpoint directory;
- save: what Kishu adds to the three cells' run time (with Kishu on, against a kernel without
  it), beside the time it reports for its checkpoints (``checkpoint_runtime_s``);
- cold load: Kishu's ``checkout`` in a new kernel with torch, numpy and pandas imported, against
  our restore, both from a cold page cache.

Run: python bench/kishu_bench.py --python .venv-kishu/bin/python [--scale 0.25] [--runs 3]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import nbformat
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import KernelManager

sys.path.insert(0, str(Path(__file__).resolve().parent))

from checkpoint_bench import build_namespace, cells, drop_cache, files_under, median, timed

from jupyter_gpufrac.kernel.checkpoint import Checkpointer

# Printed by both kernels: equal output, equal namespace (for what these figures sum up).
CHECK = """print(repr((
    float(sum(p.detach().double().sum() for p in model.parameters())),
    float(sum(t.double().sum() for s in opt.state.values() for t in s.values())),
    float(big.double().sum()), int(df["id"].sum()), float(df["x"].sum()),
    __import__("hashlib").sha256(
        repr([globals()[f"v{i}"] for i in range(SMALL_VARIABLES)]).encode()).hexdigest(),
    square(3), Config().width, type(model).__name__,
)))"""
# The commit Kishu made for the cell run last, and the time it reports for it.
LAST_COMMIT = """from kishu.commands import KishuCommand
import pathlib
_head = KishuCommand.log(pathlib.Path(NOTEBOOK_PATH)).head.commit_id
_entry = KishuCommand.status(pathlib.Path(NOTEBOOK_PATH), _head).commit_entry
print(json.dumps([_head, _entry.checkpoint_runtime_s]))"""
CHECKOUT = """print((lambda clock, start: (_kishu.checkout({commit!r}), clock() - start)[1])(
    __import__("time").perf_counter, __import__("time").perf_counter()))"""


class CellError(RuntimeError):
    """A cell raised in the contender's kernel."""


def run_cell(client: Any, code: str, timeout: float = 1800, ignored: str = "") -> str:
    """Run ``code`` in the kernel; what it printed (an error other than ``ignored`` raises
    CellError)."""
    msg_id = client.execute(code)
    out: list[str] = []
    while True:
        msg = client.get_iopub_msg(timeout=timeout)
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        kind, content = msg["msg_type"], msg["content"]
        if kind == "stream" and content["name"] == "stdout":
            out.append(content["text"])
        elif kind == "error" and content["ename"] != ignored:
            raise CellError(f"{content['ename']}: {content['evalue']}")
        elif kind == "status" and content["execution_state"] == "idle":
            return "".join(out)


@contextmanager
def kernel(python: str, work: Path) -> Iterator[Any]:
    """A kernel of ``python``, with Kishu's files under ``work``."""
    specs = work / "kernels" / "contender"
    specs.mkdir(parents=True, exist_ok=True)
    (specs / "kernel.json").write_text(json.dumps({
        "argv": [python, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "contender", "language": "python"}))
    manager = KernelManager(kernel_name="contender",
                            kernel_spec_manager=KernelSpecManager(kernel_dirs=[str(specs.parent)]),
                            connection_file=str(work / "kernels" / f"kernel-{time.monotonic_ns()}.json"))
    # Kishu's test mode: no notebook page to save or reload (there is no Jupyter server here);
    # its configuration under ``work``, not the home directory.
    manager.start_kernel(env=dict(os.environ, ENV_KISHU_TEST_MODE="1",
                                  KISHU_PATH_ROOT=str(work / "home")))
    client = manager.client()
    client.start_channels()
    try:
        client.wait_for_ready(timeout=120)
        yield client
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)


def kishu_run(python: str, work: Path, scale: float) -> dict[str, Any]:
    """One run: the cells with Kishu on, then a checkout of the last one in a new kernel."""
    work.mkdir()
    notebook = work / "bench.ipynb"
    nbformat.write(nbformat.v4.new_notebook(), notebook)
    setup = (f"import json\nNOTEBOOK_PATH = {str(notebook)!r}\n"
             f"from kishu import init_kishu\ninit_kishu(NOTEBOOK_PATH)")
    # Kishu's hooks, installed during the cell, see its end and not its start: Kishu says so.
    quirk = "PostWithoutPreError"
    with kernel(python, work) as client:
        run_cell(client, setup, ignored=quirk)
        version = run_cell(client, "import importlib.metadata\n"
                                   "print(importlib.metadata.version('kishu'))").strip()
        save_s = cells_s = 0.0
        for cell in cells(scale):
            cells_s += timed(lambda cell=cell: run_cell(client, cell))
            commit, seconds = json.loads(run_cell(client, LAST_COMMIT))
            save_s += seconds or 0.0
        before = run_cell(client, CHECK)
    database = list(work.glob(f"{notebook.stem}.kishudb*"))  # beside the notebook
    drop_cache(iter(database))
    with kernel(python, work) as client:
        run_cell(client, setup + "\nimport numpy, pandas, torch", ignored=quirk)
        # Timed in one expression: the checkout replaces the namespace, names set before too.
        load_s = float(run_cell(client, CHECKOUT.format(commit=commit)))
        after = run_cell(client, CHECK)
    with kernel(python, work) as client:  # the same cells without Kishu: what its hooks cost
        plain_s = sum(timed(lambda cell=cell: run_cell(client, cell)) for cell in cells(scale))
    return {"version": version, "bytes": sum(p.stat().st_size for p in database),
            "save": save_s, "load": load_s, "cells": cells_s, "plain": plain_s,
            "equal": before == after}


def ours(root: Path, scale: float, runs: int) -> dict[str, float]:
    """Our first checkpoint and cold restore of the same namespace, as checkpoint_bench takes
    them (fewer runs: they are there to stand beside Kishu's)."""
    ns = build_namespace(scale)
    folder = root / "ours"
    Checkpointer(folder).take(ns)  # warm-up: imports, first pickling of the classes
    saves, loads = [], []
    for _ in range(runs):
        shutil.rmtree(folder)
        os.sync()
        saves.append(timed(lambda: Checkpointer(folder).take(ns)))
        drop_cache(files_under(folder))
        loads.append(timed(lambda: Checkpointer(folder).load({"__name__": "__main__"})))
    size = sum(p.stat().st_size for p in files_under(folder))
    ns.clear()  # its memory back before Kishu's kernels run (its functions refer to it: a cycle)
    return {"bytes": size, "save": median(saves), "load": median(loads)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--python", default=sys.executable,
                        help="an interpreter with kishu, ipykernel and torch installed")
    parser.add_argument("--scale", type=float, default=0.25,
                        help="size of the namespace; 1 is issue #11's 844 MB (default 0.25)")
    parser.add_argument("--runs", type=int, default=3, help="runs per figure (median)")
    parser.add_argument("--dir", help="where to write (default: a temporary directory)")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="gpufrac-bench-", dir=args.dir))
    try:
        mine = ours(root, args.scale, args.runs)
        theirs = []
        for number in range(args.runs):
            try:
                theirs.append(kishu_run(args.python, root / f"kishu-{number}", args.scale))
            except (OSError, RuntimeError) as exc:  # CellError, a kernel that did not start
                print(f"Kishu with {args.python} failed: {exc} (is kishu installed there? "
                      "`make bench` makes .venv-kishu)")
                return
        print(f"scale {args.scale}, medians of {args.runs} runs; Kishu {theirs[0]['version']} "
              f"from {args.python}")
        print(f"  on disk     ours {mine['bytes']:,} B   Kishu {median([t['bytes'] for t in theirs]):,.0f} B")
        k_load = median([t["load"] for t in theirs])
        k_on, k_off = median([t["cells"] for t in theirs]), median([t["plain"] for t in theirs])
        print(f"  save        ours {mine['save']:.3f} s (first checkpoint)   Kishu {k_on - k_off:.3f} s "
              f"added to the three cells ({k_on:.3f} s on, {k_off:.3f} s off; it reports "
              f"{median([t['save'] for t in theirs]):.3f} s of checkpoints)   Kishu / ours "
              f"{(k_on - k_off) / mine['save']:.2f}")
        print(f"  cold load   ours {mine['load']:.3f} s (restore)   Kishu {k_load:.3f} s (checkout "
              f"in a new kernel)   Kishu / ours {k_load / mine['load']:.2f}")
        equal = sum(t["equal"] for t in theirs)
        print(f"  Kishu's checkout gave back an equal namespace in {equal} of {len(theirs)} runs")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
