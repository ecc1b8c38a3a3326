"""The base of every room: the shared things at hand, the other rooms through the context."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from node_agent.flows.context import Context


class Room:
    """One flow's room over the ledger; another room is reached through ``ctx`` and its functions."""

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self.backend = ctx.backend
        self.ledger = ctx.ledger
        self.config = ctx.config
        self.counters = ctx.counters
        self.stats = ctx.stats
