"""The simulator's tables: one row per policy, figures and ratios, and what each column means."""

from __future__ import annotations

import math
from collections.abc import Sequence

from node_agent.simulator.metrics import Result, percentile
from node_agent.simulator.traces import GB

COLUMNS = (
    "policy", "GPU-h held", "GPU-h in use", "held/use", "slowdown", "cell slowdown", "nb held/use",
    "job wait s p50/p95", "jobs not run", "state lost", "moves/h", "parks/h", "cell delay s p50/p95", "late",
    "cut off", "killed", "restored", "frozen", "thawed", "frozen h", "frozen GiB max", "thaw wait s (cells)",
    "short", "shared", "queued",
)

LEGEND = """\
GPU-h held     GPU-hours of GPUs with any lease on them (a GPU shared by ten notebooks counts once)
GPU-h in use   GPU-hours the workload uses as traced: cells (their GPUs) at their times, jobs (GPUs x
               share) from arrival; the same for every policy
held/use       the two above; nb held/use: the same for notebooks alone (GPUs a notebook is on). Time
               spent sharing a GPU counts here as free: the slowdown says what it cost
slowdown       how much longer cells and jobs ran than traced because another cell or job used the same
               GPU's compute at the same time (GPU-weighted running time over work done; 1.00: never
               slowed; two busy workloads on one GPU run at 1/2 speed each, or by their compute shares);
               cell slowdown: the same for notebook cells alone
job wait       from a job's arrival to its start (s); jobs not run: never started within the run
state lost     sessions whose kernel lost its variables at least once (killed without a checkpoint)
moves/h        notebooks moved with their state, per hour; parks/h: kernels that gave their GPU back
cell delay     from when a cell is due (its trace start, or the end of the cell before it) to its start (s)
late           share of cells that started over a minute after their traced start (any cause, knock-on too)
cut off        running cells interrupted (by a move after the grace, or a kill); not run again
killed         kernel processes killed: without their state (Run:ai), or checkpointed and restored
restored       of those, restored from their checkpoint: moves and parks by restart, reclaim ladder kills
frozen         kernels frozen by the driver (GPU memory to host memory; nothing restarts, a running cell
               waits); thawed: frozen kernels given their memory back (a kernel shut down frozen is not)
frozen h       kernel-hours spent frozen; frozen GiB max: most host memory frozen kernels held at once
thaw wait      seconds cells waited for their kernel to thaw, in all (paused while running, or due at a
               frozen kernel: the rest of the freeze, room to come back, and the thaw time), and how many
short          cell or job starts that got less memory than they needed (an out-of-memory error)
shared         share of GPU-cell time spent on a GPU where another cell or job ran too
queued         sessions that waited for a GPU at least once (at start, or to re-attach)"""


def _num(value: float, digits: int = 1) -> str:
    if math.isnan(value):
        return "-"
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.{digits}f}"


def _times(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.2f}x"


def _pair(values: Sequence[float]) -> str:
    return f"{_num(percentile(values, 50))} / {_num(percentile(values, 95))}"


def row(r: Result) -> list[str]:
    return [
        r.policy,
        _num(r.held_s / 3600),
        _num(r.in_use_s / 3600),
        _num(r.held_ratio, 2),
        _times(r.slowdown),
        _times(r.cell_slowdown),
        _num(r.notebook_ratio, 2),
        _pair(r.job_waits),
        str(r.jobs_never_started),
        str(len(r.lost_sessions)),
        _num(r.per_hour(r.moves), 2),
        _num(r.per_hour(r.parks), 2),
        _pair(r.cell_delays),
        "-" if math.isnan(r.late_share()) else f"{r.late_share():.0%}",
        str(r.cells_cut_off),
        str(r.kills + r.restarts),
        str(r.restarts),
        str(r.freezes),
        str(r.thaws),
        _num(r.frozen_s / 3600, 1),
        _num(r.peak_frozen_bytes / GB, 1),
        f"{_num(sum(r.thaw_waits), 1)} ({len(r.thaw_waits)})",
        str(r.short_of_memory),
        "-" if math.isnan(r.shared_cell_share) else f"{r.shared_cell_share:.0%}",
        str(r.sessions_queued),
    ]


def table(results: Sequence[Result]) -> str:
    """Aligned text: names left, figures right."""
    rows = [list(COLUMNS)] + [row(r) for r in results]
    widths = [max(len(r[i]) for r in rows) for i in range(len(COLUMNS))]
    lines = []
    for n, cells in enumerate(rows):
        pairs = enumerate(zip(cells, widths, strict=True))
        text = "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in pairs)
        lines.append(text.rstrip())
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)
