"""What a pending lease waits for, in words: the progress line of `gpufrac-agent run`."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any


def waiting_key(waiting: Sequence[Mapping[str, Any]]) -> str:
    """What changes the line other than time: who, where and what is done to each."""
    return repr([(w["who"], w["gpu"], w["action"], w["to"]) for w in waiting])


def _one(w: Mapping[str, Any], now: float) -> str:
    if w["action"] == "moving":
        deadline = w["deadline"]
        if deadline is None:
            return f"{w['who']} is moving from {w['gpu']} to {w['to']}"
        left = math.ceil(deadline - now)
        when = f"within {left} s" if left > 0 else "now (its time is up)"
        return f"{w['who']} moves from {w['gpu']} to {w['to']} {when}"
    if w["action"] == "freezing":
        return f"{w['who']} on {w['gpu']} is being frozen"
    return f"{w['who']} on {w['gpu']} is asked to park once its kernel is idle (no deadline)"


def waiting_words(waiting: Sequence[Mapping[str, Any]], now: float) -> str:
    """The line for a lease that waits for ``waiting`` (the agent's ``waiting_for``) at wall
    clock ``now``: each lease as the agent names it to this user, with the seconds left until a
    move is done at the latest (the agent cuts it off then)."""
    kinds = {w["kind"] for w in waiting}
    kind = kinds.pop() if len(kinds) == 1 else "lease"
    count = f"{len(waiting)} {kind}{'' if len(waiting) == 1 else 's'}"
    return f"waiting for {count} to make room: " + "; ".join(_one(w, now) for w in waiting)
