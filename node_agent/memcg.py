"""Memory cgroups: how much more host memory a process may take before its cgroup's limit (v1, v2)."""

from __future__ import annotations

import os
from dataclasses import dataclass

# cgroup v1 writes "no limit" as the largest page-aligned signed 64-bit number.
V1_UNLIMITED = 2**62


@dataclass(frozen=True)
class Headroom:
    """The tightest memory limit between a process's cgroup and the root: the limit, what that
    cgroup uses now (its processes and descendants, page cache included, as the kernel counts
    before its OOM killer acts), and which cgroup it is."""

    limit: int
    used: int
    cgroup: str

    @property
    def room(self) -> int:
        return max(0, self.limit - self.used)


@dataclass(frozen=True)
class _Hierarchy:
    """A mounted cgroup hierarchy that accounts memory: where it is mounted, and which of its
    cgroups that mount shows as its root (a container sees only its own part)."""

    mount: str
    root: str
    v2: bool


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _number(text: str | None) -> int | None:
    """A limit or a usage; None for "max", a v1 "no limit", or what cannot be read."""
    if text is None or not text.isdigit():
        return None
    value = int(text)
    return None if value >= V1_UNLIMITED else value


def _hierarchies(mountinfo: str) -> list[_Hierarchy]:
    """The memory-accounting cgroup mounts of this mount namespace: cgroup2, and the v1
    hierarchy with the memory controller."""
    found = []
    for line in mountinfo.splitlines():
        left, _, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if len(fields) < 5 or len(tail) < 3:
            continue
        if tail[0] == "cgroup2":
            found.append(_Hierarchy(fields[4], fields[3], True))
        elif tail[0] == "cgroup" and "memory" in tail[2].split(","):
            found.append(_Hierarchy(fields[4], fields[3], False))
    return found


def _levels(hierarchy: _Hierarchy, path: str) -> list[str]:
    """The folders of ``path`` (a cgroup as /proc/<pid>/cgroup names it) and of each of its
    ancestors up to the mounted root, deepest first."""
    root = hierarchy.root.rstrip("/")
    if root and (path == root or path.startswith(root + "/")):
        path = path[len(root):]
    elif root and root != "/":
        return []  # outside what this mount shows
    parts = [p for p in path.split("/") if p and p != ".."]
    return [os.path.join(hierarchy.mount, *parts[:depth]) for depth in range(len(parts), -1, -1)]


def _level_headroom(folder: str, v2: bool) -> Headroom | None:
    if v2:
        limits = [n for n in (_number(_read(os.path.join(folder, name)))
                              for name in ("memory.max", "memory.high")) if n is not None]
        used = _number(_read(os.path.join(folder, "memory.current")))
    else:
        limit = _number(_read(os.path.join(folder, "memory.limit_in_bytes")))
        limits = [limit] if limit is not None else []
        used = _number(_read(os.path.join(folder, "memory.usage_in_bytes")))
    if not limits or used is None:
        return None
    return Headroom(min(limits), used, folder)


def headroom(pid: int) -> Headroom | None:
    """The tightest memory limit over process ``pid``'s cgroup and its ancestors, in the v2
    hierarchy (memory.max and memory.high) and the v1 memory hierarchy (memory.limit_in_bytes):
    None where none is set or none can be read."""
    cgroups = _read(f"/proc/{pid}/cgroup")
    mountinfo = _read("/proc/self/mountinfo")
    if cgroups is None or mountinfo is None:
        return None
    paths_v2 = [line.split(":", 2)[2] for line in cgroups.splitlines() if line.startswith("0::")]
    paths_v1 = [line.split(":", 2)[2] for line in cgroups.splitlines()
                if line.count(":") >= 2 and "memory" in line.split(":", 2)[1].split(",")]
    tightest: Headroom | None = None
    for hierarchy in _hierarchies(mountinfo):
        for path in paths_v2 if hierarchy.v2 else paths_v1:
            for folder in _levels(hierarchy, path):
                level = _level_headroom(folder, hierarchy.v2)
                if level is not None and (tightest is None or level.room < tightest.room):
                    tightest = level
    return tightest
