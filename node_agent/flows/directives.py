"""Directives: what the agent asks of (or tells) a lease's client, and the long-polls waiting for them."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from node_agent.flows.common import Caller
from node_agent.flows.room import Room
from node_agent.ledger import Directive, Lease

if TYPE_CHECKING:
    from node_agent.flows.context import Context

MAX_WAIT = 60.0
# What a client is asked to do, and what it is only told (heard of when asked for by kind).
ACTIONS = ("migrate", "shrink", "killed")
NOTICES = ("resized", "bursting", "unparked", "frozen", "moved")
# Asked of a client only when it names them: a server that cannot park never hears of it.
ASKED_BY_NAME = ("park",)
KINDS = (*ACTIONS, *ASKED_BY_NAME, *NOTICES)


class Directives(Room):
    """The directives of every lease (the ledger keeps them) and who waits for which."""

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        # Replaced by each directive, so that a tick sees one was made (see ``last``).
        self._added = object()
        # Long-polls waiting, by what they wait for: ("lease", id, kind) or ("client", owner
        # uid, name, kind). A directive wakes only those it concerns.
        self._listeners: dict[tuple[object, ...], set[asyncio.Event]] = {}

    def last(self) -> object:
        """A token that each new directive replaces."""
        return self._added

    def add(self, lease: Lease, kind: str, reason: str, **body: Any) -> Directive:
        """A directive of ``kind`` for ``lease``'s client; the waits it concerns wake."""
        d = self.ledger.add_directive(
            lease, kind, {"reason": reason, "kernel_id": lease.kernel_id, **body}
        )
        self._added = object()
        for key in (("lease", d.lease_id, kind), ("client", d.owner_uid, d.client, kind)):
            for event in self._listeners.get(key, ()):
                event.set()
        return d

    async def wait(
        self, caller: Caller, *, client: str | None, lease_id: str | None, after: int,
        timeout: float, kinds: Sequence[str] = ACTIONS,
    ) -> tuple[list[Directive], int]:
        """The directives of ``kinds`` after ``after`` that the caller may see, waited for up to
        ``timeout`` seconds (MAX_WAIT at most), and where the next wait starts."""
        if lease_id is not None:
            self.ctx.lease(caller, lease_id)
        owner_uid = None if lease_id is not None and caller.admin else caller.uid
        if after < 0:
            # "From now on": a new listener need not replay history. Its cursor is past the
            # newest directive it may see, never the node's count, which would tell it of
            # other users' activity.
            seen = self.ledger.directives_after(
                0, client=client if lease_id is None else None, lease_id=lease_id,
                owner_uid=owner_uid)
            return [], seen[-1].seq if seen else 0
        deadline = time.monotonic() + min(max(timeout, 0.0), MAX_WAIT)
        # A client name is anyone's to write on a lease, so by name a caller hears only of its
        # own leases (an admin too); an admin follows another user's lease by its id.
        scope: tuple[object, ...] = (("lease", lease_id) if lease_id is not None
                                     else ("client", caller.uid, client))
        keys = [(*scope, kind) for kind in dict.fromkeys(kinds)]
        event = asyncio.Event()
        for key in keys:
            self._listeners.setdefault(key, set()).add(event)
        try:
            while True:
                event.clear()
                own = self.ledger.directives_after(
                    after, client=client if lease_id is None else None, lease_id=lease_id,
                    owner_uid=owner_uid)
                # Past what the caller may see but did not ask for, so it is not read again,
                # by this wait nor by the next.
                after = max(own[-1].seq if own else after, 0)
                found = [d for d in own if d.kind in kinds]
                remaining = deadline - time.monotonic()
                if found or remaining <= 0:
                    return found, after
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(event.wait(), remaining)
        finally:
            for key in keys:
                waiting = self._listeners[key]
                waiting.discard(event)
                if not waiting:
                    del self._listeners[key]
