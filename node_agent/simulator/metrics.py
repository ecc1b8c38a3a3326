"""What one simulated run measured: GPU time held and in use, waits, delays, and what was disturbed."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100), interpolated between ranks; NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


@dataclass(frozen=True)
class Sample:
    """What the cluster holds and uses at one instant."""

    held: int  # GPUs with any lease on them
    held_by_notebooks: int  # GPUs with a notebook's lease on them
    running: float  # GPUs that running cells and jobs use, in the trace's units
    cells_running: float  # ... cells alone
    shared_cell_gpus: float  # GPUs of those cells that share a GPU with another running workload
    # Running cells and jobs (not frozen), weighted by the GPUs they keep busy: as many, and the
    # same times their speed (work done per second; below them when they share compute).
    busy: float = 0.0
    progress: float = 0.0
    cells_busy: float = 0.0
    cells_progress: float = 0.0
    frozen_kernels: int = 0
    frozen_bytes: int = 0  # host memory the frozen kernels hold


@dataclass
class Result:
    """One policy's run over the horizon ``[start, end)`` (seconds)."""

    policy: str
    nodes: int
    gpus_per_node: int
    start: float
    end: float
    # GPU-seconds the workload uses as traced (cells at their times, jobs from their arrival):
    # the same for every policy, so that the ratios compare what is held.
    in_use_s: float = 0.0
    notebooks_in_use_s: float = 0.0
    # GPU-seconds as the run went.
    held_s: float = 0.0
    held_by_notebooks_s: float = 0.0
    running_s: float = 0.0
    cells_running_s: float = 0.0
    shared_cell_s: float = 0.0
    busy_s: float = 0.0
    progress_s: float = 0.0
    cells_busy_s: float = 0.0
    cells_progress_s: float = 0.0
    frozen_s: float = 0.0  # kernel-seconds spent frozen
    frozen_byte_s: float = 0.0
    peak_frozen_bytes: int = 0
    job_waits: list[float] = field(default_factory=list)
    jobs_never_started: int = 0
    cell_delays: list[float] = field(default_factory=list)
    cell_lateness: list[float] = field(default_factory=list)  # start against the trace's, any cause
    lost_sessions: set[str] = field(default_factory=set)
    moves: int = 0
    parks: int = 0
    kills: int = 0  # GPU processes stopped without their state kept
    restarts: int = 0  # GPU processes killed and restored from a checkpoint (move, reclaim, park)
    freezes: int = 0
    thaws: int = 0
    thaw_waits: list[float] = field(default_factory=list)  # per cell that waited for a thaw, seconds
    reclaim_restarts: int = 0  # killed by the reclaim ladder and restored
    shrinks: int = 0
    cells_cut_off: int = 0
    short_of_memory: int = 0  # cell or job starts that could not get the memory they needed
    sessions_queued: int = 0  # sessions that had to wait for a GPU at some point
    # (time, GPUs held, GPUs running) at each change, for the figure.
    series: list[tuple[float, int, float]] = field(default_factory=list)
    _last: float = 0.0
    _now: Sample = Sample(0, 0, 0.0, 0.0, 0.0)

    def __post_init__(self) -> None:
        self._last = self.start

    @property
    def hours(self) -> float:
        return (self.end - self.start) / 3600

    def advance(self, now: float) -> None:
        """Integrate the current sample up to ``now``, within the horizon."""
        lo, hi = max(self._last, self.start), min(now, self.end)
        if hi > lo:
            dt = hi - lo
            s = self._now
            self.held_s += s.held * dt
            self.held_by_notebooks_s += s.held_by_notebooks * dt
            self.running_s += s.running * dt
            self.cells_running_s += s.cells_running * dt
            self.shared_cell_s += s.shared_cell_gpus * dt
            self.busy_s += s.busy * dt
            self.progress_s += s.progress * dt
            self.cells_busy_s += s.cells_busy * dt
            self.cells_progress_s += s.cells_progress * dt
            self.frozen_s += s.frozen_kernels * dt
            self.frozen_byte_s += s.frozen_bytes * dt
        self._last = max(self._last, now)

    def observe(self, now: float, sample: Sample) -> None:
        if not self.series or self.series[-1][1:] != (sample.held, sample.running):
            self.series.append((now, sample.held, sample.running))
        self._now = sample
        self.peak_frozen_bytes = max(self.peak_frozen_bytes, sample.frozen_bytes)

    # The figures the report shows.
    @property
    def held_ratio(self) -> float:
        return self.held_s / self.in_use_s if self.in_use_s else math.nan

    @property
    def notebook_ratio(self) -> float:
        return self.held_by_notebooks_s / self.notebooks_in_use_s if self.notebooks_in_use_s else math.nan

    @property
    def shared_cell_share(self) -> float:
        """Share of GPU cell time spent on a GPU where another workload also ran."""
        return self.shared_cell_s / self.cells_running_s if self.cells_running_s else math.nan

    @property
    def slowdown(self) -> float:
        """How much longer cells and jobs ran than traced because others used their GPUs' compute
        (GPU-weighted wall time over work done; 1.0: never slowed)."""
        return self.busy_s / self.progress_s if self.progress_s else math.nan

    @property
    def cell_slowdown(self) -> float:
        return self.cells_busy_s / self.cells_progress_s if self.cells_progress_s else math.nan

    def late_share(self, seconds: float = 60.0) -> float:
        """Share of cells that started more than ``seconds`` after their traced start."""
        late = sum(1 for x in self.cell_lateness if x > seconds)
        return late / len(self.cell_lateness) if self.cell_lateness else math.nan

    def per_hour(self, count: int) -> float:
        return count / self.hours if self.hours else math.nan
