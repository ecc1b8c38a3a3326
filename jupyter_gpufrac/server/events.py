"""Kernel GPU events: the jupyter_events schema, emission, and the last events of each kernel."""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

from jupyter_gpufrac.contract import EVENT_KINDS, EVENT_SCHEMA_ID

KEEP_PER_KERNEL = 50

_INT_FIELDS = ("gpu_index", "from_gpu_index", "to_gpu_index", "request", "limit", "usage",
               "frozen_bytes")
_STR_FIELDS = ("reason", "gpu_uuid", "interrupted_cell", "notebook", "protection", "cause")


def make_event(kernel_id: str, event: str, message: str, **fields: Any) -> dict[str, Any]:
    """One event as the schema wants it: fields that are unknown (None) are left out."""
    if event not in EVENT_KINDS:
        raise ValueError(f"unknown gpufrac event {event!r}")
    data: dict[str, Any] = {"kernel_id": kernel_id, "event": event, "message": message}
    for name in _INT_FIELDS:
        if fields.get(name) is not None:
            data[name] = int(fields[name])
    for name in _STR_FIELDS:
        if fields.get(name) is not None:
            data[name] = str(fields[name])
    if fields.get("ok") is not None:
        data["ok"] = bool(fields["ok"])
    for name in ("deadline", "seconds"):
        if fields.get(name) is not None:
            data[name] = float(fields[name])
    for name in ("restored", "lost"):
        if fields.get(name) is not None:
            data[name] = [str(v) for v in fields[name]]
    if fields.get("deferred") is not None:
        data["deferred"] = {str(k): int(v) for k, v in fields["deferred"].items()}
    data["time"] = float(fields.get("time") or time.time())
    return data


class KernelEventLog:
    """Emits events through the server's event logger and keeps the last 50 per kernel."""

    def __init__(self, event_logger: Any | None, log: logging.Logger) -> None:
        # The event logger is optional so the provisioner also works outside a server.
        self._event_logger = event_logger
        self._log = log
        self._events: dict[str, collections.deque[dict[str, Any]]] = {}
        # kernel id -> notebook path, kept by the server, so every message can name the notebook
        self.notebooks: dict[str, str] = {}
        # Told the kernel id after each event: the server leaves the kernel its new account.
        self.on_event: Callable[[str], None] | None = None

    def emit(self, kernel_id: str, event: str, message: str, **fields: Any) -> dict[str, Any]:
        """Record and emit one event; never raises (an event must not break a kernel restart)."""
        fields.setdefault("notebook", self.notebooks.get(kernel_id))
        data = make_event(kernel_id, event, message, **fields)
        self._events.setdefault(kernel_id, collections.deque(maxlen=KEEP_PER_KERNEL)).append(data)
        self._log.info("gpufrac event %s for kernel %s: %s", event, kernel_id, message)
        if self._event_logger is not None:
            try:
                self._event_logger.emit(schema_id=EVENT_SCHEMA_ID, data=data)
            except Exception:
                self._log.exception("could not emit gpufrac event %s for kernel %s", event, kernel_id)
        if self.on_event is not None:
            try:
                self.on_event(kernel_id)
            except Exception:
                self._log.exception("could not follow gpufrac event %s for kernel %s", event,
                                    kernel_id)
        return data

    def events(self, kernel_id: str) -> list[dict[str, Any]]:
        """The kernel's recorded events, newest last."""
        return list(self._events.get(kernel_id, ()))

    def last(self, kernel_id: str, kinds: Iterable[str] | None = None) -> dict[str, Any] | None:
        """The kernel's newest event (of one of ``kinds`` when given)."""
        wanted = set(kinds) if kinds is not None else None
        for data in reversed(self._events.get(kernel_id, ())):
            if wanted is None or data["event"] in wanted:
                return data
        return None

    def forget(self, kernel_id: str) -> None:
        """Drop a kernel's events once it is shut down."""
        self._events.pop(kernel_id, None)
        self.notebooks.pop(kernel_id, None)
