"""Processes as the agent sees them: owner and start time from /proc; kills that miss reused pids."""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass


@dataclass(frozen=True)
class ProcessIdentity:
    """Who owns a process, and when it started (clock ticks since boot), to tell pid reuse."""

    pid: int
    uid: int
    start_time: int


def identify(pid: int) -> ProcessIdentity | None:
    """The process's real uid and start time, or None when there is no such process."""
    if pid <= 0:
        return None
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            stat = f.read()
        with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as f:
            status = f.read()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # The command name may hold spaces and parentheses: fields start after the last ')'.
    fields = stat[stat.rindex(")") + 2 :].split()
    if fields[0] == "Z":  # a zombie holds no memory and cannot be signalled usefully
        return None
    start_time = int(fields[19])
    uid = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("Uid:"))
    return ProcessIdentity(pid, uid, start_time)


def ancestors(pid: int, depth: int = 64) -> list[int]:
    """The process's parent, grandparent and so on up to init (nearest first)."""
    found: list[int] = []
    while len(found) < depth:
        try:
            with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
                stat = f.read()
        except OSError:
            break
        pid = int(stat[stat.rindex(")") + 2 :].split()[1])
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
