"""Processes as the agent sees them: owner and start time; kills that miss reused pids."""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass

import psutil


@dataclass(frozen=True)
class ProcessIdentity:
    """Who owns a process, and when it started (clock ticks since boot), to tell pid reuse."""

    pid: int
    uid: int
    start_time: int


def _stat(pid: int) -> tuple[str, int] | None:
    """The state letter and start time (clock ticks since boot) from /proc/<pid>/stat.

    Read by hand: psutil gives the start only as wall-clock time (boot time plus ticks), which
    a clock step moves, while the ledger compares it across agent restarts.
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # The command name may hold spaces and parentheses: fields start after the last ')'.
    fields = stat[stat.rindex(b")") + 2 :].split()
    return fields[0].decode("ascii", "replace"), int(fields[19])


def identify(pid: int) -> ProcessIdentity | None:
    """The process's real uid and start time, or None when there is no such process."""
    if pid <= 0:
        return None
    # The start time first, then the owner: a pid reused in between pairs the new owner
    # with the old start time, which matches no live process, never the reverse.
    stat = _stat(pid)
    if stat is None or stat[0] == "Z":  # a zombie holds no memory and cannot be signalled usefully
        return None
    try:
        uid = psutil.Process(pid).uids().real
    except psutil.Error:
        return None
    return ProcessIdentity(pid, uid, stat[1])


def ancestors(pid: int, depth: int = 64) -> list[int]:
    """The process's parent, grandparent and so on up to init (nearest first)."""
    found: list[int] = []
    while len(found) < depth:
        try:
            pid = psutil.Process(pid).ppid()
        except psutil.Error:
            break
        if pid <= 1:
            break
        found.append(pid)
    return found


def is_alive(pid: int, start_time: int) -> bool:
    """The same process (not a reused pid) still runs."""
    ident = identify(pid)
    return ident is not None and ident.start_time == start_time


def kill(pid: int, start_time: int) -> bool:
    """SIGKILL the process if it is still the one registered; True when a signal was sent.

    A pidfd pins the process before its start time is checked, so a pid reused between the
    check and the signal is never hit.
    """
    try:
        fd = os.pidfd_open(pid)
    except (ProcessLookupError, OSError):
        return False
    try:
        if not is_alive(pid, start_time):
            return False
        signal.pidfd_send_signal(fd, signal.SIGKILL)
        return True
    except ProcessLookupError:
        return False
    finally:
        os.close(fd)
