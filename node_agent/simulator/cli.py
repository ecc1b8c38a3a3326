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
from node_agent.simulator.traces import TraceError, load_pods, load_sessions, sample_jobs

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
and pays the re-attach time. Jobs are Alibaba GPU pods that ran, drawn without replacement,
arriving uniformly over the notebook trace (their own times span months of a far larger cluster);
they keep their GPUs, share and duration, and never move. Not modelled: compute contention (a cell
runs its traced duration however many share its GPU; 'shared' says how often that was the case);
re-running a cut-off cell, or the cells before it when state is lost; time to kill a process."""

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
                     migrate_grace=args.migrate_grace, reclaim_grace=args.reclaim_grace)
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
                                progress=progress))
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
