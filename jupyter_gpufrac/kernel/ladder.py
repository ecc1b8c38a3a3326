"""Pure decisions of the reclaim ladder, the agent poll backoff and the checkpoint after each cell."""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from jupyter_gpufrac.kernel import messages
from node_agent.words import named_for_people

# Directives created this long before the kernel started may still be meant for it
# (clock jitter between agent and kernel); older ones are history from a previous process.
DIRECTIVE_SLACK_S = 2.0


class Action(enum.Enum):
    """What the hook should do now."""

    EMPTY_CACHE = "empty_cache"
    CAP_REQUEST = "cap_request"
    OFFLOAD = "offload"
    CHECKPOINT = "checkpoint"
    # The agent froze this kernel's process, or thawed it.
    FROZEN = "frozen"
    THAWED = "thawed"
    # The agent moved this process to another GPU by freezing and thawing it there.
    MOVED = "moved"


@dataclass
class LadderState:
    """Where this kernel stands on the reclaim ladder."""

    shrinking: bool = False
    reason: str = ""
    deadline: float | None = None
    moving: bool = False  # a migrate directive is out: a cell interrupted now was cut off by it
    # The agent froze this process: its GPU state is in host memory until it is thawed.
    frozen: bool = False
    frozen_at: float | None = None  # when (the frozen directive's time)
    notices: list[str] = field(default_factory=list)  # shown with the next cell's output


def backoff_delay(failures: int, base: float = 0.5, cap: float = 30.0) -> float:
    """Seconds to wait after ``failures`` consecutive failed polls: doubling, capped."""
    if failures <= 0:
        return 0.0
    return min(cap, base * 2 ** min(failures - 1, 16))


def fresh_directives(
    directives: Iterable[Mapping[str, Any]], lease_id: str, started: float
) -> list[Mapping[str, Any]]:
    """Directives for this lease that were issued to this process (not replayed history)."""
    out = []
    for directive in directives:
        if directive.get("lease_id") not in (None, lease_id):
            continue
        created = directive.get("created")
        if isinstance(created, int | float) and created < started - DIRECTIVE_SLACK_S:
            continue
        out.append(directive)
    return out


def next_cursor(after: int, last: int) -> int:
    """The ``after`` for the next poll; an agent whose sequence went backwards was restarted."""
    return last if last >= after else 0


def on_directive(state: LadderState, directive: Mapping[str, Any]) -> list[Action]:
    """Actions for one directive; shrink is safe to apply while a cell runs."""
    kind = directive.get("kind")
    # The agent's words, with leases as people know them (by name, without ids).
    reason = named_for_people(str(directive.get("reason") or ""))
    if kind == "shrink":
        state.shrinking = True
        state.reason = reason
        deadline = directive.get("deadline")
        state.deadline = float(deadline) if isinstance(deadline, int | float) else None
        state.notices.append(
            "gpufrac: another notebook needs the GPU memory lent to this kernel back"
            + (f" ({reason})" if reason else "")
            + "; PyTorch's cache was emptied and its cap lowered to this kernel's request."
        )
        return [Action.EMPTY_CACHE, Action.CAP_REQUEST]
    if kind == "migrate":
        # Every completed cell is checkpointed already; the server restarts the kernel.
        state.moving = True
        state.notices.append(
            "gpufrac: this kernel is being moved to another GPU"
            + (f" ({reason})" if reason else "")
            + "; its variables as of the last completed cell come back after the restart."
        )
        return []
    if kind == "killed":
        state.notices.append("gpufrac: the agent stopped this kernel's GPU work"
                             + (f" ({reason})" if reason else "") + ".")
        return []
    if kind == "frozen":
        # The next cell asks for the GPU back before it runs (see GpuFracHook.unpark); it
        # first says when and why the kernel was frozen, however late it comes.
        created = directive.get("created")
        state.frozen = True
        state.frozen_at = float(created) if isinstance(created, int | float) else None
        state.notices.append(messages.frozen_news(reason, str(directive.get("cause") or ""),
                                                  state.frozen_at))
        return [Action.FROZEN]
    if kind == "moved":
        state.notices.append("gpufrac: " + (reason or "moved to another GPU") + ".")
        return [Action.MOVED]
    if kind == "unparked" and directive.get("thawed") and state.frozen:
        # The hook says so (GpuFracHook._on_thawed) unless a cell asked for the thaw.
        state.frozen = False
        return [Action.THAWED]
    return []


def after_cell(
    state: LadderState, *, usage: int | None, request: int | None, cut_off: bool
) -> list[Action]:
    """Actions between cells: offload while shrinking and still over the request; then the
    last good checkpoint, unless a move cut the cell off (its half-done state is not good)."""
    actions: list[Action] = []
    if state.shrinking and usage is not None and request is not None and usage > request:
        actions += [Action.OFFLOAD, Action.EMPTY_CACHE]
    if not cut_off:
        actions.append(Action.CHECKPOINT)
    return actions
