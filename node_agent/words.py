"""The words people read for what the agent knows: states, protections, users and leases by name."""

from __future__ import annotations

import pwd
import re
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

# What keeps a notebook's state while its GPU is taken (docs/glossary.md, "Protections").
FROZEN_IN_HOST_MEMORY = "frozen in host memory"
CHECKPOINT_ON_DISK = "checkpoint on disk"

# A ledger state as people read it, wherever a lease is shown that is not a kernel of one's
# own server (`gpufrac-agent status`, the panel's node table): the glossary's words, the ones
# a kernel's own state uses too (an active lease is "guaranteed", or "bursting" above its
# request; see lease_state_words).
LEASE_STATE_WORDS: Mapping[str, str] = MappingProxyType({
    "pending": "waiting for a GPU",
    "active": "guaranteed",
    "migrating": "moving",
    "shrinking": "shrinking",
    "killed": "stopped",
    "parked": "parked",
    "freezing": "freezing",
    "thawing": "thawing",
})

# A lease id as the agent writes it after a lease's name ("job "train" (l-0123456789ab)"); a
# lease without a name is named by its id alone, which stays.
_LEASE_ID = re.compile(r"\s*\(l-[0-9a-f]{12}\)")
# A notebook as the agent names it: by its path, cut at its start when long.
_NOTEBOOK_PATH = re.compile(r'\bnotebook "(?:[^"/]*/)+([^"/]+)"')


def lease_state_words(lease: Mapping[str, Any]) -> str:
    """``guaranteed``, ``bursting``, ``parked, frozen in host memory``: a lease's state."""
    state = str(lease.get("state") or "")
    if state == "active" and lease.get("bursting"):
        return "bursting"
    words = LEASE_STATE_WORDS.get(state, state)
    if lease.get("frozen") and state not in ("freezing", "thawing"):
        words += f", {FROZEN_IN_HOST_MEMORY}"
    return words


def named_for_people(text: str) -> str:
    """An agent's sentence with leases as people know them: a notebook by its file name, a
    job by its command, and no lease id beside a name (ids are for scripts, ``--json``, and
    tooltips; a lease that has no name keeps its id)."""
    return _NOTEBOOK_PATH.sub(r'notebook "\1"', _LEASE_ID.sub("", text))


def user_name(uid: int) -> str:
    """The login name of ``uid``; ``uid 1234`` where the system has none."""
    try:
        return pwd.getpwuid(uid).pw_name
    except (KeyError, OverflowError, ValueError):
        return f"uid {uid}"


def lease_name(lease: Mapping[str, Any], width: int = 40) -> str:
    """``notebook train.ipynb``, ``job python train.py``: a lease as people know it (a
    notebook's name is its path: its file name says which; a job's command says what)."""
    kind = str(lease.get("kind") or "lease")
    name = str(lease.get("name") or "")
    if kind == "notebook" and name:
        name = name.rsplit("/", 1)[-1]
    if len(name) > width:
        name = name[: width - 1] + "…"
    return f"{kind} {name}" if name else kind
