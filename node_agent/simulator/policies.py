"""The site policies and node-scheduler settings the simulator compares, as data."""

from __future__ import annotations

from dataclasses import dataclass, replace

from node_agent.policy import Rules

BINPACK = Rules(spread=False)

# How room is made for a lease whose GPU a spread notebook sits on.
NO_COMPACTION = "none"
COMPACT_BY_KILL = "kill"  # Run:ai: the notebook's GPU process is killed; its state is gone
COMPACT_BY_MOVE = "move"  # gpufrac: migrate, variables kept
# What happens when an owner needs memory a borrower holds.
NO_RECLAIM = "none"  # nobody gives anything back: the owner runs short
RECLAIM_BY_KILL = "kill"  # Run:ai dynamic fractions: the borrower is killed at once, state lost
RECLAIM_LADDER = "ladder"  # gpufrac: shrink, wait out the grace, then kill and restore


@dataclass(frozen=True)
class Policy:
    """How a site runs notebooks: whole GPUs reserved, or leases placed by ``rules`` with
    compaction, reclaim and parking as named."""

    name: str
    reserve: bool = False
    rules: Rules = BINPACK
    compaction: str = NO_COMPACTION
    reclaim: str = NO_RECLAIM
    park_after: float | None = None
    # Every notebook burstable (limit above request), so that the node scheduler spreads all.
    all_burstable: bool = False
    # Freeze instead of stopping the process: where a move would cut a cell off, the ladder would
    # kill and restore, or a park would restart, the driver checkpoints the GPU memory into host
    # memory and the kernel thaws later (issue 9).
    freeze: bool = False

    @property
    def keeps_state(self) -> bool:
        """Whether a kernel whose GPU process is stopped comes back with its variables."""
        return self.freeze or self.compaction == COMPACT_BY_MOVE or self.reclaim == RECLAIM_LADDER


def site_policies(park_after: float) -> list[Policy]:
    """Issue 12: what a site could run today, and gpufrac; issue 9: gpufrac freezing instead."""
    gpufrac = Policy("gpufrac", rules=Rules(spread=True), compaction=COMPACT_BY_MOVE,
                     reclaim=RECLAIM_LADDER)
    return [
        Policy("reserve", reserve=True),
        Policy("binpack", rules=Rules(spread=False)),
        Policy("spread+kill", rules=Rules(spread=True), compaction=COMPACT_BY_KILL, reclaim=RECLAIM_BY_KILL),
        gpufrac,
        replace(gpufrac, name="gpufrac+park", park_after=park_after),
        replace(gpufrac, name="gpufrac+freeze", park_after=park_after, freeze=True),
    ]


def scheduler_settings(base: Policy) -> list[Policy]:
    """Issue 15: the node scheduler's settings, one changed at a time from ``base``."""
    on = base.rules
    out = [
        replace(base, name="spread off", rules=Rules(spread=False, max_per_gpu=on.max_per_gpu)),
        replace(base, name="spread on, unbounded (default)", rules=Rules(spread=True, max_per_gpu=None)),
    ]
    out += [replace(base, name=f"max {n} per GPU", rules=Rules(spread=True, max_per_gpu=n))
            for n in (2, 3, 4)]
    out.append(replace(base, name="spread all (not only burstable)", all_burstable=True))
    return out
