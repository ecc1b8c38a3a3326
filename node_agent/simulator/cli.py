"""Command line: replay the traces under each policy and setting, print the tables, write the figure."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

from node_agent.simulator.engine import Timing, nodes_needed, simulate
from node_agent.simulator.metrics import Result
from node_agent.simulator.node_spec import ACCEPTED, NodeSpecError, parse_node
from node_agent.simulator.plot import PlotUnavailable, write_plot
from node_agent.simulator.policies import Policy, scheduler_settings, site_policies
from node_agent.simulator.report import LEGEND, table
from node_agent.simulator.traces import GB, TraceError, load_pods, load_sessions, sample_jobs

PROG = "python -m node_agent.simulator"
FIGURE = "gpus-held.png"
FIGURES = "figures.md"

MODEL = """\
Model. Every placement, compaction, activation, room and reclaim decision is node_agent.policy's;
the simulator decides time, and the node (the fullest that takes a lease, by requests: a cluster
scheduler's binpack). A GPU session leases its largest cell's GPU count on one node: request = the
median vram of its GPU cells, limit = the largest (the trace's vram read as per GPU; at least a CUDA
context). A cell holds its vram while it runs and keeps it after (tensors stay). A shrunk kernel
keeps at most its request; a moved, restored or re-attached one reloads what fits without setting
off a reclaim. reserve: whole GPUs, the session's largest cell's count, for its whole life.
binpack: nothing moves or is taken back (an owner short of memory is counted under short).
spread+kill: compaction and reclaim kill the kernel at once, without its state. gpufrac: moves keep
state (a running cell gets the migrate grace, then is cut off); reclaim shrinks an idle borrower at
once, waits out a running one's grace, then kills it and restores its checkpoint. +park: a kernel
idle for park_after gives its lease back; its next cell re-attaches first (anywhere there is room)
and pays the re-attach time (a restart without CUDA: counted killed and restored). gpufrac+freeze:
gpufrac+park, but wherever it would cut a cell off, kill and restore, or park by restart, the driver
freezes the kernel instead: its GPU memory goes to host memory (freeze time by bytes held), the GPU is
given back, a running GPU cell waits (a CPU cell runs on), and nothing restarts. A move is a freeze and
a thaw remapped onto the other GPU, at once (no grace); the ladder's last rung freezes the borrower,
which thaws when all it held fits again (its request is owed to it); a parked kernel is frozen, leaves
its lease, and at its next cell leases again on its own node (its host memory is there) and thaws
(thaw time by bytes). A cell due at a frozen kernel waits for the thaw; 'thaw wait' counts it.
Compute contention: cells and jobs on a GPU whose compute others use at the same time run slower, all
at the same fraction of what they ask (a busy cell asks for all of a GPU, a job its share of one),
a multi-GPU workload at its most contended GPU's pace. Jobs are Alibaba GPU pods that ran, drawn without
replacement, arriving uniformly over the notebook trace (their own times span months of a far larger cluster);
they keep their GPUs, share and duration (at full speed), and never move. Not modelled: re-running a
cut-off cell, or the cells before it when state is lost; time to kill a process; host memory as a
limit on freezing (frozen GiB max says what it would need); moving a frozen kernel to another node."""

SETTINGS_NOTE = """\
Settings are changed one at a time from gpufrac (without park). 'spread all': today's policy spreads
only burstable leases (limit > request); every notebook whose limit equals its request is given a
limit one byte above it, which makes it burstable to plan_physical and changes nothing else."""


def _positive(kind: type[int] | type[float], minimum: float, what: str) -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return value
    return parse


def build_parser(prog: str = PROG) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        description="Replay notebook sessions (and jobs) under the policies a site could run, with the "
                    "agent's own policy functions; print GPU time held against GPU time in use, jobs' "
                    "waits, state lost, moves, parks and delays at cell start; write a figure.",
    )
    p.add_argument("--trace", required=True, type=Path,
                   help="notebook sessions: a NotebookOS workload JSON (the Adobe trace)")
    p.add_argument("--jobs", type=Path, help="jobs: the Alibaba GPU trace v2023 pods CSV (optional)")
    p.add_argument("--jobs-sample", type=_positive(int, 0, "a count >= 0"), default=1000, metavar="N",
                   help="pods drawn from --jobs (default 1000: about as much GPU time in use as the "
                   "notebooks)")
    p.add_argument("--seed", type=int, default=0, help="seed of the job draw and arrivals (default 0)")
    p.add_argument("--node", default="8xA100-80GB", metavar="SPEC",
                   help=f"one node's GPUs (default 8xA100-80GB). Accepted: {ACCEPTED}")
    p.add_argument("--nodes", type=_positive(int, 1, "a count >= 1"), metavar="K",
                   help="nodes in the cluster (default: as many as reserving whole GPUs needs at its peak)")
    p.add_argument("--park-after", type=_positive(float, 1, "seconds >= 1"), default=900.0, metavar="S",
                   help="idle seconds before a kernel parks, in gpufrac+park (default 900)")
    timing = Timing()
    p.add_argument("--move-seconds", type=_positive(float, 0, "seconds >= 0"), default=timing.move,
                   metavar="S", help=f"a planned move of an idle kernel (default {timing.move:g}: "
                   "measured by bench/migration_bench.py on the 2-core development box)")
    p.add_argument("--reattach-seconds", type=_positive(float, 0, "seconds >= 0"), default=timing.reattach,
                   metavar="S", help=f"a parked kernel getting a GPU back (default {timing.reattach:g}: "
                   "charged as a move until timed on a GPU)")
    p.add_argument("--migrate-grace", type=_positive(float, 0, "seconds >= 0"), default=timing.migrate_grace,
                   metavar="S", help=f"a running cell's time to finish before a move cuts it off "
                   f"(default {timing.migrate_grace:g}, c.GpuFrac.migrate_grace_period)")
    p.add_argument("--reclaim-grace", type=_positive(float, 0, "seconds >= 0"), default=timing.reclaim_grace,
                   metavar="S", help="a borrower's time to give memory back "
                   f"(default {timing.reclaim_grace:g}, the agent's --reclaim-grace)")
    p.add_argument("--freeze-seconds-per-gib", type=_positive(float, 0, "seconds >= 0"),
                   default=timing.freeze_per_gib, metavar="S",
                   help=f"driver checkpoint of a process's GPU memory into host memory, per GiB held "
                   f"(default {timing.freeze_per_gib:g}: 7.2 s for 8 GiB, measured on an H100)")
    p.add_argument("--thaw-seconds-per-gib", type=_positive(float, 0, "seconds >= 0"),
                   default=timing.thaw_per_gib, metavar="S",
                   help=f"restoring it onto a GPU, per GiB frozen (default {timing.thaw_per_gib:g}: 2.1 s "
                   "for 8 GiB, measured on an H100)")
    p.add_argument("--no-contention", action="store_true",
                   help="cells and jobs run their traced durations however many share a GPU's compute "
                   "(the model before issue 9; the slowdown is then 1.00x)")
    p.add_argument("--cell-compute", choices=("busy", "traced"), default="busy",
                   help="a running cell's demand on its GPUs' compute: all of it (busy, the default), "
                   "or its traced mean utilisation (traced)")
    p.add_argument("--out", type=Path, default=Path("docs/simulation"), metavar="DIR",
                   help=f"where {FIGURE} and {FIGURES} go (default docs/simulation)")
    p.add_argument("--no-settings", action="store_true", help="skip the node-scheduler settings (issue 15)")
    p.add_argument("--no-plot", action="store_true", help=f"do not write {FIGURE}")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")
    return p


def main(argv: Sequence[str] | None = None, prog: str = PROG) -> int:
    args = build_parser(prog).parse_args(argv)
    say = (lambda text: None) if args.quiet else (lambda text: print(text, file=sys.stderr, flush=True))
    began = time.perf_counter()
    try:
        spec = parse_node(args.node)
        sessions = load_sessions(args.trace)
        if not any(s.peak_gpus for s in sessions):
            raise TraceError(args.trace, "$.sessions", "trainings",
                             "no session uses a GPU: nothing to simulate")
        wide = max(sessions, key=lambda s: s.peak_gpus)
        if wide.peak_gpus > spec.gpus:
            raise NodeSpecError(f"session {wide.id} runs a cell on {wide.peak_gpus} GPUs but a node of "
                                f"{spec.text} has {spec.gpus}: give --node a larger node")
        start, end = min(s.start for s in sessions), max(s.stop for s in sessions)
        jobs = []
        pods_ran = 0
        if args.jobs is not None and args.jobs_sample:
            pods = load_pods(args.jobs)
            pods_ran = len(pods)
            jobs = sample_jobs(pods, int(args.jobs_sample), start, end, args.seed)
    except (TraceError, NodeSpecError, ValueError) as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    nodes = int(args.nodes) if args.nodes else nodes_needed(sessions, jobs, spec)
    timing = replace(Timing(), move=args.move_seconds, reattach=args.reattach_seconds,
                     migrate_grace=args.migrate_grace, reclaim_grace=args.reclaim_grace,
                     freeze_per_gib=args.freeze_seconds_per_gib, thaw_per_gib=args.thaw_seconds_per_gib)
    contention, traced_compute = not args.no_contention, args.cell_compute == "traced"
    policies = site_policies(args.park_after)
    gpufrac = next(p for p in policies if p.name == "gpufrac")
    settings = [] if args.no_settings else scheduler_settings(gpufrac)
    runs: list[Policy] = policies + settings
    results: list[Result] = []
    for n, policy_ in enumerate(runs, 1):
        t = time.perf_counter()
        shown = [t]

        def progress(done: float, name: str = policy_.name, shown: list[float] = shown) -> None:
            if time.perf_counter() - shown[0] >= 2.0:
                shown[0] = time.perf_counter()
                say(f"  {name}: {done:.0%} of the trace")

        results.append(simulate(policy_, spec, nodes, sessions, jobs, timing, start=start, end=end,
                                progress=progress, contention=contention, traced_compute=traced_compute))
        say(f"[{n}/{len(runs)}] {policy_.name}: {time.perf_counter() - t:.1f} s")
    elapsed = time.perf_counter() - began

    gpu_sessions = sum(1 for s in sessions if s.peak_gpus)
    cells = sum(len(s.cells) for s in sessions if s.peak_gpus)
    header = [
        f"Notebooks: {args.trace.name}, {len(sessions)} sessions ({gpu_sessions} use a GPU, {cells} cells), "
        f"{(end - start) / 3600:.1f} h.",
        (f"Jobs: {len(jobs)} of the {pods_ran} GPU pods that ran in {args.jobs.name} (seed {args.seed}), "
         "arriving uniformly over the same hours." if jobs else "Jobs: none."),
        f"Cluster: {nodes} nodes of {spec.text}"
        + ("" if args.nodes else " (as many as reserving whole GPUs needs at its peak)")
        + f". Move {timing.move:g} s, re-attach {timing.reattach:g} s, park after {args.park_after:g} s, "
        f"migrate grace {timing.migrate_grace:g} s, reclaim grace {timing.reclaim_grace:g} s.",
        f"Freeze {timing.freeze_per_gib:g} s/GiB ({timing.freeze(8 * GB):g} s for 8 GiB), thaw "
        f"{timing.thaw_per_gib:g} s/GiB ({timing.thaw(8 * GB):g} s for 8 GiB). Compute contention: "
        + ("off (traced durations)." if not contention else
           "cells ask for their traced utilisation of a GPU, jobs their share."
           if traced_compute else "a busy cell asks for all of a GPU, a job its share."),
    ]
    parts = ["\n".join(header), "Site policies (issue 12)\n" + table(results[:len(policies)])]
    if settings:
        parts.append(f"Node-scheduler settings (issue 15)\n{table(results[len(policies):])}\n{SETTINGS_NOTE}")
    parts.append(LEGEND)
    text = "\n\n".join(parts)
    print(text)
    say(f"simulated {len(runs)} runs in {elapsed:.1f} s")

    status = 0
    args.out.mkdir(parents=True, exist_ok=True)
    figures = args.out / FIGURES
    command = " ".join([prog, *(argv if argv is not None else sys.argv[1:])])
    figures.write_text(f"# Simulation figures\n\n`{command}` ({len(runs)} runs, {elapsed:.1f} s)\n\n"
                       f"```\n{text}\n```\n\n{MODEL}\n")
    say(f"wrote {figures}")
    if not args.no_plot:
        panels = [("GPUs held: site policies", results[:len(policies)])]
        if settings:
            panels.append(("GPUs held: node-scheduler settings (gpufrac)", results[len(policies):]))
        try:
            say(f"wrote {write_plot(panels, args.out / FIGURE)}")
        except PlotUnavailable as e:
            print(f"{prog}: {e}", file=sys.stderr)
            status = 1
    return status
