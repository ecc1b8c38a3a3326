"""What the agent did, counted in memory for /metrics: moves and how long they took, shrinks
and kills by cause, parks and unparks; and what kernels reported doing: checkpoints (size and
time) and offloads.

Kept apart from the ledger on purpose: these are node-wide tallies with no user data, and a
write per event would cost a transaction for a number Prometheus only rates. They start from
zero when the agent restarts; Prometheus's ``rate()`` and ``increase()`` treat a counter that
goes down as a reset, so dashboards stay right.
"""

from __future__ import annotations

import bisect
import time
from collections import Counter
from dataclasses import dataclass, field, fields

from node_agent.quantities import MAX_COUNT

# Seconds from a `migrate` directive to `migrated`: an idle kernel moves in about a second, a
# busy one waits out its cell or the grace (--migrate-grace, 120 s by default).
MOVE_BUCKETS = (0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)
# A cell of a parked kernel waits for its GPU from milliseconds (room) to minutes (a job ends).
UNPARK_BUCKETS = (0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 30.0, 60.0, 300.0, 1800.0)

# A checkpoint takes milliseconds when little changed and minutes for tens of GB.
CHECKPOINT_SECONDS_BUCKETS = (0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 30.0, 120.0, 600.0)
# What a checkpoint holds, from a few variables to a large model (bytes).
CHECKPOINT_BYTES_BUCKETS = tuple(float(2**n) for n in range(10, 41, 3))  # 1 KiB .. 1 TiB

# Why a kernel took a checkpoint: after a cell, asked by its server (before a move or a
# restart), to park, or by its user (`%gpu checkpoint`).
CHECKPOINT_TRIGGERS = ("cell", "server", "park", "manual")
# Why a kernel moved GPU tensors to host memory: a reclaim (shrink), a park, or its user.
OFFLOAD_REASONS = ("shrink", "park", "manual")

# How a move ends: the client reported it done, the agent killed the kernel at the deadline,
# or the lease was released (the kernel shut down) before either.
MIGRATED = "migrated"
MIGRATE_TIMEOUT = "migrate_timeout"
RELEASED = "released"
OUTCOMES = (MIGRATED, MIGRATE_TIMEOUT, RELEASED)

# How a parked lease got a GPU again: one had room when its kernel asked, or the agent placed
# it later, when room appeared.
AT_ONCE = "at_once"
AFTER_WAIT = "after_wait"
UNPARKED = (AT_ONCE, AFTER_WAIT)


@dataclass(frozen=True)
class Observation:
    """What a kernel reports having done: a checkpoint (``why`` is its trigger) or an offload
    (``why`` is its reason), of ``nbytes``."""

    kind: str  # "checkpoint" or "offload"
    why: str
    nbytes: int
    written: int = 0  # a checkpoint's bytes written (unchanged ones are not)
    seconds: float = 0.0


def clamp(value: float) -> float:
    """``value`` within 0..2^63-1 (nan: 0): what the API let through must still never make a
    tally that /metrics cannot export (float() of 10**400 raises)."""
    if value != value or value <= 0:  # nan != nan
        return 0
    return min(value, MAX_COUNT)


def add(counts: Counter[str], key: str, value: float) -> None:
    """``counts[key] += value``, clamped at 2^63-1."""
    counts[key] = int(min(counts[key] + int(clamp(value)), MAX_COUNT))


@dataclass
class Histogram:
    """Counts per bucket (not cumulative) and the sum, as a Prometheus histogram needs."""

    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.bounds) + 1)  # the last is +Inf

    def observe(self, value: float) -> None:
        value = clamp(value)
        # bisect_left: a value equal to a bound belongs to that bucket (le is "<=").
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total = min(self.total + value, float(MAX_COUNT))

    def cumulative(self) -> list[tuple[str, float]]:
        """(le, count) pairs, ``+Inf`` last, as HistogramMetricFamily takes them."""
        out: list[tuple[str, float]] = []
        running = 0
        for bound, count in zip((*map(str, self.bounds), "+Inf"), self.counts, strict=True):
            running += count
            out.append((bound, running))
        return out


@dataclass
class AgentStats:
    """Tallies since the agent started. One asyncio loop writes them; the collector reads."""

    # Wall-clock start (gpufrac_agent_start_time_seconds): another way to see a reset.
    started: float = field(default_factory=time.time)
    moves_started: Counter[str] = field(default_factory=Counter)  # by cause
    shrinks: Counter[str] = field(default_factory=Counter)  # by cause
    kills: Counter[str] = field(default_factory=Counter)  # by cause
    parks: int = 0
    unparks: Counter[str] = field(default_factory=Counter)  # by AT_ONCE or AFTER_WAIT
    # Unparks that found no room and left the lease waiting for a GPU.
    unpark_waits: int = 0
    move_seconds: dict[str, Histogram] = field(
        default_factory=lambda: {o: Histogram(MOVE_BUCKETS) for o in OUTCOMES})
    # From a parked kernel's ask for a GPU to the GPU: the wait its cell sees.
    unpark_seconds: Histogram = field(default_factory=lambda: Histogram(UNPARK_BUCKETS))
    _unparking: dict[str, float] = field(default_factory=dict)
    # Reported by kernels, by trigger: how long their checkpoints took and what they hold.
    checkpoint_seconds: dict[str, Histogram] = field(default_factory=lambda: {
        t: Histogram(CHECKPOINT_SECONDS_BUCKETS) for t in CHECKPOINT_TRIGGERS})
    checkpoint_bytes: dict[str, Histogram] = field(default_factory=lambda: {
        t: Histogram(CHECKPOINT_BYTES_BUCKETS) for t in CHECKPOINT_TRIGGERS})
    checkpoint_written: Counter[str] = field(default_factory=Counter)  # bytes, by trigger
    # Freezes done and fallen back from, by cause (park, reclaim, limit, job), and how long
    # the driver took to freeze and to thaw.
    freezes: Counter[str] = field(default_factory=Counter)
    freeze_fallbacks: Counter[str] = field(default_factory=Counter)
    # What the driver said and what the agent found did not match, by step (freeze, thaw).
    freeze_mismatches: Counter[str] = field(default_factory=Counter)
    freeze_seconds: Histogram = field(default_factory=lambda: Histogram(MOVE_BUCKETS))
    thaw_seconds: Histogram = field(default_factory=lambda: Histogram(MOVE_BUCKETS))
    offloads: Counter[str] = field(default_factory=Counter)  # by reason
    offloaded_bytes: Counter[str] = field(default_factory=Counter)  # by reason
    # Moves not ended yet: lease id -> monotonic start. A move under way when the agent
    # restarted is not timed (its start is lost with the process), rather than timed wrong.
    _moving: dict[str, float] = field(default_factory=dict)

    def tally(self) -> float:
        """Every count and sum so far, added up: each only grows, so any new event changes
        this figure (a view of the stats is current while it has not moved)."""
        total = 0.0
        for f in fields(self):
            value = getattr(self, f.name)
            for item in value.values() if isinstance(value, dict) else (value,):
                if isinstance(item, Histogram):
                    total += sum(item.counts) + item.total
                elif isinstance(item, int | float):
                    total += item
        return total

    def move_started(self, lease_id: str, cause: str) -> None:
        self.moves_started[cause] += 1
        # A lease sent elsewhere while on its way still makes one move from its user's view:
        # timed from the first directive.
        self._moving.setdefault(lease_id, time.monotonic())

    def move_ended(self, lease_id: str, outcome: str) -> None:
        started = self._moving.pop(lease_id, None)
        if started is not None:
            hist = self.move_seconds.setdefault(outcome, Histogram(MOVE_BUCKETS))
            hist.observe(time.monotonic() - started)

    def shrink_asked(self, cause: str) -> None:
        self.shrinks[cause] += 1

    def killed(self, cause: str) -> None:
        self.kills[cause] += 1

    def parked(self, lease_id: str) -> None:
        self.parks += 1
        self._unparking.pop(lease_id, None)  # a wait given up on is not timed

    def frozen(self, cause: str, seconds: float) -> None:
        self.freezes[cause] += 1
        self.freeze_seconds.observe(seconds)

    def freeze_fell_back(self, cause: str) -> None:
        self.freeze_fallbacks[cause] += 1

    def freeze_mismatch(self, step: str) -> None:
        self.freeze_mismatches[step] += 1

    def thawed(self, seconds: float) -> None:
        self.thaw_seconds.observe(seconds)

    def unpark_asked(self, lease_id: str) -> None:
        self._unparking.setdefault(lease_id, time.monotonic())

    def unparked(self, how: str, lease_id: str) -> None:
        self.unparks[how] += 1
        started = self._unparking.pop(lease_id, None)
        if started is not None:
            self.unpark_seconds.observe(time.monotonic() - started)

    def unpark_waited(self) -> None:
        self.unpark_waits += 1

    def observed(self, seen: Observation) -> None:
        """Count what a kernel reported (validated by the API: known kind and why)."""
        if seen.kind == "checkpoint":
            self.checkpoint_seconds[seen.why].observe(seen.seconds)
            self.checkpoint_bytes[seen.why].observe(seen.nbytes)
            add(self.checkpoint_written, seen.why, seen.written)
        else:
            add(self.offloads, seen.why, 1)
            add(self.offloaded_bytes, seen.why, seen.nbytes)
