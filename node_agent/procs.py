"""Processes as the agent sees them: owner and start time; kills that miss reused pids."""

from __future__ import annotations

import contextlib
import functools
import math
import os
import select
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")


@dataclass(frozen=True)
class ProcessIdentity:
    """Who owns a process, and when it started (clock ticks since boot), to tell pid reuse;
    and its parent when it was read (0: none)."""

    pid: int
    uid: int
    start_time: int
    ppid: int = 0


@dataclass(frozen=True)
class Stat:
    """What /proc/<pid>/stat says of a process: its state letter, parent, start time and
    user plus system time (clock ticks), and resident memory (bytes)."""

    state: str
    ppid: int
    start_time: int
    cpu_ticks: int
    rss: int


def _meminfo(field: bytes) -> int | None:
    """A field of /proc/meminfo in bytes (None: not there)."""
    try:
        with open("/proc/meminfo", "rb") as f:
            for line in f:
                if line.startswith(field + b":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


@functools.cache
def memory_total() -> int:
    """The host's RAM in bytes (read once: every node view asks for the freeze budget)."""
    return _meminfo(b"MemTotal") or os.sysconf("SC_PHYS_PAGES") * PAGE_SIZE


def memory_available() -> int | None:
    """What the host can still give processes without swapping (None: not known)."""
    return _meminfo(b"MemAvailable")


def stat(pid: int) -> Stat | None:
    """One read of /proc/<pid>/stat, or None when there is no such process.

    Read by hand: psutil gives the start only as wall-clock time (boot time plus ticks), which
    a clock step moves, while the ledger compares it across agent restarts; and one read
    answers what psutil reads three files for.
    """
    try:
        fd = os.open(f"/proc/{pid}/stat", os.O_RDONLY)
    except OSError:
        return None
    try:
        raw = os.read(fd, 4096)
    except OSError:  # it exited between the open and the read
        return None
    finally:
        os.close(fd)
    # The command name may hold spaces and parentheses: fields start after the last ')'.
    # Split no further than the resident size, the last field wanted.
    fields = raw[raw.rfind(b")") + 2 :].split(None, 22)
    if len(fields) < 22:
        return None
    return Stat(fields[0].decode("ascii", "replace"), int(fields[1]), int(fields[19]),
                int(fields[11]) + int(fields[12]), int(fields[21]) * PAGE_SIZE)


@functools.cache
def own_namespace() -> str | None:
    """The agent's own PID namespace (it never changes)."""
    return pid_namespace("self")


def pid_namespace(pid: int | str) -> str | None:
    """The process's PID namespace (``pid:[inode]``), or None when it cannot be read."""
    try:
        return os.readlink(f"/proc/{pid}/ns/pid")
    except OSError:
        return None


def _status_field(pid: int, name: bytes) -> list[bytes] | None:
    """The values of one line of /proc/<pid>/status (``Uid:``, ``NSpid:``), or None."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(name):
                    return line.split()[1:]
    except OSError:
        pass
    return None


def _innermost_pid(pid: int) -> int | None:
    """The process's id in its own PID namespace (the last of ``NSpid``)."""
    ids = _status_field(pid, b"NSpid:")
    return int(ids[-1]) if ids else None


# Where each process of another PID namespace is here: (namespace, its pid there) -> (pid
# here, start time). Built by one scan of /proc, and scanned again only when a pid asked for is
# neither the caller, nor one of its descendants, nor in it, and at most once per SCAN_EVERY_S
# on the whole node: a registration costs a few reads, not one per process of the node.
_elsewhere: dict[tuple[str, int], tuple[int, int]] = {}
_lock = threading.Lock()
_scanned_at = -math.inf
SCAN_EVERY_S = 10.0
# A kernel is the caller's child (or a spare's): its descendants are read first, this deep.
DESCENDANT_DEPTH = 4
DESCENDANTS = 512


def as_seen_here(caller: int, pid: int) -> int | None:
    """Process ``pid`` of the PID namespace ``caller`` runs in, as the agent numbers it; None
    when no such process is visible here.

    A kernel in a container (a Kubernetes pod) is numbered in the pod's namespace, and only
    the caller's own namespace is searched: a pod cannot name a process of another. Blocking
    file reads: run it off the event loop.
    """
    global _scanned_at
    theirs = pid_namespace(caller)
    if theirs is None:
        return None  # gone, or not ours to read: which process it means cannot be told
    if theirs == own_namespace():
        return pid
    if _innermost_pid(caller) == pid:
        return caller  # a kernel registers itself: no search at all
    with _lock:
        found = _remembered(theirs, pid)
    if found is None:
        found = _descendant(caller, theirs, pid)
    if found is None:
        with _lock:
            # Asked for a pid nothing above finds, a caller gets the last scan's answer: one
            # that asks again and again cannot make the agent read all of /proc each time.
            if time.monotonic() - _scanned_at >= SCAN_EVERY_S:
                _scan_elsewhere()
                _scanned_at = time.monotonic()
            found = _remembered(theirs, pid)
    return found


def children(pid: int) -> list[int]:
    """The children of every thread of the process (one read each), or [] when gone."""
    found: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return found
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/children", "rb") as f:
                found += [int(child) for child in f.read().split()]
        except (OSError, ValueError):
            continue
    return found


def _descendant(caller: int, namespace: str, pid: int) -> int | None:
    """The caller's descendant that is ``pid`` in ``namespace`` (checked by start time against
    a pid that changed hands while it was read), or None."""
    level, seen = [caller], 0
    for _ in range(DESCENDANT_DEPTH):
        level = [child for parent in level for child in children(parent)][:DESCENDANTS - seen]
        seen += len(level)
        for here in level:
            before = stat(here)
            if before is None or _innermost_pid(here) != pid or pid_namespace(here) != namespace:
                continue
            after = stat(here)
            if after is not None and after.start_time == before.start_time:
                return here
        if not level or seen >= DESCENDANTS:
            break
    return None


def _remembered(namespace: str, pid: int) -> int | None:
    """The pid here of process ``pid`` of ``namespace`` as the last scan found it, if that
    process (the same start time: not a reused pid) still runs."""
    known = _elsewhere.get((namespace, pid))
    if known is None:
        return None
    here, start_time = known
    st = stat(here)
    if st is None or st.start_time != start_time:
        del _elsewhere[(namespace, pid)]
        return None
    return here


def _scan_elsewhere() -> None:
    """Read where every process of another PID namespace is (see ``_elsewhere``)."""
    ours = own_namespace()
    found: dict[tuple[str, int], tuple[int, int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        here = int(entry.name)
        namespace = pid_namespace(here)
        if namespace is None or namespace == ours:
            continue
        # Start time before and after: a pid that changed hands in between is left out.
        before = stat(here)
        inner = _innermost_pid(here)
        if before is None or inner is None or pid_namespace(here) != namespace:
            continue
        after = stat(here)
        if after is not None and after.start_time == before.start_time:
            found[(namespace, inner)] = (here, before.start_time)
    _elsewhere.clear()
    _elsewhere.update(found)


def _real_uid(pid: int) -> int | None:
    uids = _status_field(pid, b"Uid:")
    return int(uids[0]) if uids else None


def identify(pid: int) -> ProcessIdentity | None:
    """The process's real uid and start time, or None when there is no such process."""
    if pid <= 0:
        return None
    # The start time first, then the owner: a pid reused in between pairs the new owner
    # with the old start time, which matches no live process, never the reverse.
    st = stat(pid)
    if st is None or st.state == "Z":  # a zombie holds no memory and cannot be signalled usefully
        return None
    uid = _real_uid(pid)
    return None if uid is None else ProcessIdentity(pid, uid, st.start_time, st.ppid)


def is_alive(pid: int, start_time: int) -> bool:
    """The same process (not a reused pid) still runs."""
    if pid <= 0:
        return False
    st = stat(pid)
    return st is not None and st.state != "Z" and st.start_time == start_time


class Pin:
    """A process held by a pidfd: whether it still runs is asked of the descriptor, which never
    follows a pid number to another process."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def alive(self) -> bool:
        poller = select.poll()
        poller.register(self.fd, select.POLLIN)
        return not poller.poll(0)  # readable once it has exited


@contextlib.contextmanager
def pinned(pid: int, start_time: int) -> Iterator[Pin]:
    """Hold process ``pid`` for the block, if it is still the one that started at
    ``start_time``; ProcessLookupError if not (it ended, or the pid names another process).

    The pidfd is opened before the start time is checked, so the process checked is the one
    held: what acts on the pid number within the block (a signal, a driver call) acts on it
    unless it ends meanwhile, which ``Pin.alive`` tells afterwards.
    """
    try:
        fd = os.pidfd_open(pid)
    except OSError as exc:
        raise ProcessLookupError(f"no process {pid}") from exc
    try:
        if not is_alive(pid, start_time):
            raise ProcessLookupError(f"process {pid} is not the one that started at {start_time}")
        yield Pin(fd)
    finally:
        os.close(fd)


def kill(pid: int, start_time: int) -> bool:
    """SIGKILL the process if it is still the one registered; True when a signal was sent.

    A pidfd pins the process before its start time is checked, so a pid reused between the
    check and the signal is never hit.
    """
    try:
        with pinned(pid, start_time) as pin:
            signal.pidfd_send_signal(pin.fd, signal.SIGKILL)
            return True
    except ProcessLookupError:
        return False


class ProcessWatch:
    """The processes the agent's polls look at, remembered from one poll to the next.

    Each one's identity is read from /proc once, when first asked for, and a pidfd is kept on
    it: one poll(2) per :meth:`sweep` then says which of them exited, however many there are,
    with no file read per process. A pidfd never follows a reused pid, so what is remembered
    is always the process that has the pid now.
    """

    def __init__(self) -> None:
        self._known: dict[int, tuple[ProcessIdentity, int]] = {}  # pid -> (identity, pidfd)
        self._by_fd: dict[int, int] = {}
        self._poller = select.poll()
        self._asked: set[int] = set()

    def sweep(self) -> None:
        """Forget the processes that exited, those whose parent exited (they have a new one),
        and those not asked for since the last sweep (nobody needs them any more)."""
        exited = {self._by_fd[fd] for fd, _ in self._poller.poll(0)}
        orphaned = {pid for pid, (ident, _) in self._known.items() if ident.ppid in exited}
        for pid in exited | orphaned | (self._known.keys() - self._asked):
            self._forget(pid)
        self._asked = set()

    def identify(self, pid: int) -> ProcessIdentity | None:
        """As :func:`identify`, read once while the process lives."""
        self._asked.add(pid)
        known = self._known.get(pid)
        if known is not None:
            return known[0]
        if pid <= 0:
            return None
        try:
            fd = os.pidfd_open(pid)
        except OSError:  # gone, or no descriptor to spare: answer, remember nothing
            return identify(pid)
        # Pinned first, read second: if the pid changed hands in between, the pidfd reports
        # an exit and the next sweep reads it again.
        ident = identify(pid)
        if ident is None:
            os.close(fd)
            return None
        self._known[pid] = (ident, fd)
        self._by_fd[fd] = pid
        self._poller.register(fd, select.POLLIN)
        return ident

    def is_alive(self, pid: int, start_time: int) -> bool:
        """As :func:`is_alive`, from what the last sweep knew."""
        ident = self.identify(pid)
        return ident is not None and ident.start_time == start_time

    def ancestors(self, pid: int, depth: int = 64) -> list[int]:
        """The process's parent, grandparent and so on up to init (nearest first)."""
        found: list[int] = []
        ident = self.identify(pid)
        while ident is not None and ident.ppid > 1 and len(found) < depth:
            found.append(ident.ppid)
            ident = self.identify(ident.ppid)
        return found

    def close(self) -> None:
        for pid in list(self._known):
            self._forget(pid)

    def _forget(self, pid: int) -> None:
        _, fd = self._known.pop(pid)
        del self._by_fd[fd]
        self._poller.unregister(fd)
        os.close(fd)
