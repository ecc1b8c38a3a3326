"""A daemon thread that reads this lease's directives when woken, and reports usage."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from jupyter_gpufrac.kernel import ladder
from jupyter_gpufrac.wake import WakeReceiver, wake

log = logging.getLogger(__name__)

# What a kernel hears of its lease: what it acts on, and that it was frozen or thawed.
HEARD = ("migrate", "shrink", "killed", "frozen", "unparked", "moved")


class AgentLike(Protocol):
    """The part of ``node_agent.client.AgentClient`` the watcher uses."""

    def directives(
        self, *, client: str | None = None, lease: str | None = None, after: int = 0,
        timeout: float = 25.0, kinds: Sequence[str] | None = None,
    ) -> tuple[list[dict[str, Any]], int]: ...

    def report_usage(self, lease_id: str, nbytes: int) -> None: ...


class DirectiveWatcher:
    """Reads ``directives(lease=…)``; survives an absent or restarting agent with backoff.

    With ``wake`` (the kernel's wake socket) the thread asks the agent when the server wakes
    it, and every ``poll_timeout`` seconds to report usage; the agent answers at once, so the
    server's long-poll is the only one waiting on this lease. Without it (the socket could not
    be bound) the thread long-polls the lease itself.

    ``handle`` runs on this thread, so it must be safe while a cell runs (shrink is: it only
    touches the allocator). Nothing raised here can reach the kernel.
    """

    def __init__(
        self,
        client: AgentLike,
        lease_id: str,
        handle: Callable[[Mapping[str, Any]], None],
        *,
        usage: Callable[[], int | None] = lambda: None,
        poll_timeout: float = 25.0,
        started: float | None = None,
        wake: WakeReceiver | None = None,
    ) -> None:
        self.client = client
        self.wake = wake
        self.lease_id = lease_id
        self.handle = handle
        self.usage = usage
        self.poll_timeout = poll_timeout
        self.started = time.time() if started is None else started
        self.after = 0
        self.failures = 0
        self.polls = 0
        self.last_error: str | None = None
        self.available: bool | None = None  # unknown until the first poll answers or fails
        self._reported: int | None = None
        self._primed = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gpufrac-directives", daemon=True)
        self.polled = threading.Event()  # set after every poll attempt (tests wait on it)

    def start(self) -> None:
        """Start polling in the background."""
        self._thread.start()

    def stop(self, join_timeout: float = 0.0) -> None:
        """Ask the thread to end; it is a daemon, so a long poll in flight cannot block exit."""
        self._stop.set()
        if self.wake is not None:
            if self._thread.is_alive():
                wake(self.wake.path)  # ends a wait in progress; the thread closes the socket
            else:
                self.wake.close()
        if join_timeout and self._thread.is_alive():
            self._thread.join(join_timeout)

    @property
    def alive(self) -> bool:
        """Whether the polling thread runs."""
        return self._thread.is_alive()

    def _run(self) -> None:
        try:
            self._loop()
        finally:
            if self.wake is not None:
                self.wake.close()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.poll_once()
                self.failures = 0
                self.available = True
                self.last_error = None
            except Exception as exc:  # the agent may be absent, restarting, or refuse us
                self.failures += 1
                self.available = False
                self.last_error = f"{type(exc).__name__}: {exc}"
                if self.failures == 1:
                    log.warning("gpufrac: polling the agent failed: %s", self.last_error)
            finally:
                self.polled.set()
            if self.failures:
                self._stop.wait(ladder.backoff_delay(self.failures))
            elif self.wake is not None:
                self.wake.wait(self.poll_timeout)

    def poll_once(self) -> None:
        """One round: report usage if it changed, then read directives and handle them."""
        self.polls += 1
        used = self.usage()
        if used is not None and used != self._reported:
            self.client.report_usage(self.lease_id, used)
            self._reported = used
        if not self._primed:
            # Start from now: a restarted kernel must not act on the directive that moved it.
            _, self.after = self.client.directives(lease=self.lease_id, after=-1, timeout=0)
            self._primed = True
        directives, last = self.client.directives(
            lease=self.lease_id, after=self.after,
            timeout=0.0 if self.wake is not None else self.poll_timeout, kinds=HEARD,
        )
        for directive in ladder.fresh_directives(directives, self.lease_id, self.started):
            try:
                self.handle(directive)
            except Exception:
                log.exception("gpufrac: handling directive %s failed", directive.get("kind"))
        self.after = ladder.next_cursor(self.after, int(last))
