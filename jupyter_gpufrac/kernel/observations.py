"""What the kernel tells the agent it did (checkpoints, offloads), sent off the cell's path."""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Mapping
from typing import Any, Protocol

log = logging.getLogger(__name__)

# Observations waiting while the agent is slow or away; past this they are dropped (counted):
# they feed node-wide histograms, and a cell must never wait for them.
MAX_WAITING = 64


class Observer(Protocol):
    """The part of ``node_agent.client.AgentClient`` the sender uses."""

    def observe(self, lease_id: str, observation: Mapping[str, Any]) -> None: ...


class ObservationSender:
    """Posts observations of one lease from a daemon thread, started at the first one."""

    def __init__(self, client: Callable[[], Observer], lease_id: str) -> None:
        self._client = client
        self.lease_id = lease_id
        self._queue: queue.Queue[dict[str, Any]] = queue.Queue(MAX_WAITING)
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self.sent = 0
        self.dropped = 0

    def checkpoint(self, trigger: str, nbytes: int, written: int, seconds: float) -> None:
        """A checkpoint taken (``trigger``: cell, server, park or manual)."""
        self._put({"kind": "checkpoint", "trigger": trigger, "bytes": nbytes,
                   "written_bytes": written, "seconds": round(seconds, 6)})

    def offload(self, reason: str, nbytes: int) -> None:
        """GPU tensors moved to host memory (``reason``: shrink, park or manual)."""
        self._put({"kind": "offload", "reason": reason, "bytes": nbytes})

    def _put(self, body: dict[str, Any]) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="gpufrac-observations",
                                                daemon=True)
                self._thread.start()
        try:
            self._queue.put_nowait(body)
        except queue.Full:
            self._drop()

    def _drop(self) -> None:
        with self._lock:  # counted from the kernel's thread and from the sender's
            self.dropped += 1

    def _run(self) -> None:
        client: Observer | None = None
        while True:
            body = self._queue.get()
            try:
                client = client or self._client()
                client.observe(self.lease_id, body)
                self.sent += 1
            except Exception as exc:  # the agent may be away: the figure is lost, not the kernel
                self._drop()
                if self.dropped == 1:
                    log.info("gpufrac: an observation for the agent was dropped: %s", exc)
            finally:
                self._queue.task_done()
