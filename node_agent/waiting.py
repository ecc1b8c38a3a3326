"""What a pending lease waits for, in words: the progress line of `gpufrac-agent run`."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from node_agent.words import named_for_people


def waiting_key(waiting: Sequence[Mapping[str, Any]]) -> str:
    """What changes the line other than time: who, where and what is done to each."""
    return repr([(w["who"], w["gpu"], w["action"], w["to"]) for w in waiting])


def _who(w: Mapping[str, Any]) -> str:
    """A lease as people know it: by its name, without the id the agent adds for scripts."""
    return named_for_people(str(w["who"]))


def _one(w: Mapping[str, Any], now: float) -> str:
    who = _who(w)
    if w["action"] == "moving":
        deadline = w["deadline"]
        if deadline is None:
            return f"{who} is moving from {w['gpu']} to {w['to']}"
        left = math.ceil(deadline - now)
        when = f"within {left} s" if left > 0 else "now (its time is up)"
        return f"{who} moves from {w['gpu']} to {w['to']} {when}"
    if w["action"] == "freezing":
        return f"{who} on {w['gpu']} is being frozen"
    return f"{who} on {w['gpu']} is asked to park once its kernel is idle (no deadline)"


def waiting_words(waiting: Sequence[Mapping[str, Any]], now: float) -> str:
    """The line for a lease that waits for ``waiting`` (the agent's ``waiting_for``) at wall
    clock ``now``: each lease as the agent names it to this user, with the seconds left until a
    move is done at the latest (the agent cuts it off then)."""
    kinds = {w["kind"] for w in waiting}
    kind = kinds.pop() if len(kinds) == 1 else "lease"
    count = f"{len(waiting)} {kind}{'' if len(waiting) == 1 else 's'}"
    return f"waiting for {count} to make room: " + "; ".join(_one(w, now) for w in waiting)


_DONE = {"moving": "moved to {to}", "freezing": "frozen in host memory",
         "parking": "parked"}


def made_room_words(waiting: Sequence[Mapping[str, Any]]) -> str:
    """What was done to make room, once the lease runs: the line `run` says before its
    command starts, so that a freeze of a moment is still seen (a frozen notebook thaws when
    the job ends; a parked one at its next cell)."""
    done = "; ".join(f"{_who(w)} on {w['gpu']} " + _DONE.get(w["action"], "parked").format(
        to=w.get("to") or "another GPU") for w in waiting)
    after = []
    if any(w["action"] == "freezing" for w in waiting):
        after.append("what was frozen thaws when the command ends")
    if any(w["action"] == "parking" for w in waiting):
        after.append("what was parked gets a GPU at its next cell")
    return f"made room: {done}" + (f" ({'; '.join(after)})" if after else "")
