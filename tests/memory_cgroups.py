"""Real memory cgroups for tests: made by the test run when it is root and the kernel accounts
memory (cgroup v2's memory controller, else v1's memory hierarchy), else skipped."""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import pytest

V2_ROOTS = ("/sys/fs/cgroup", "/sys/fs/cgroup/unified")
V1_ROOT = "/sys/fs/cgroup/memory"


@dataclass(frozen=True)
class MemoryCgroup:
    """A cgroup with a memory limit; ``join`` makes the calling process a member."""

    path: str
    v2: bool

    def join(self) -> None:
        with open(os.path.join(self.path, "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))

    @property
    def preexec(self) -> Callable[[], None]:
        """For subprocess: the child joins before it runs its program."""
        return self.join

    def usage(self) -> int:
        name = "memory.current" if self.v2 else "memory.usage_in_bytes"
        with open(os.path.join(self.path, name)) as f:
            return int(f.read())


def _root() -> tuple[str, bool] | None:
    for root in V2_ROOTS:
        try:
            with open(os.path.join(root, "cgroup.controllers")) as f:
                if "memory" in f.read().split():
                    return root, True
        except OSError:
            continue
    if os.path.exists(os.path.join(V1_ROOT, "memory.limit_in_bytes")):
        return V1_ROOT, False
    return None


@contextmanager
def memory_cgroup(limit: int) -> Iterator[MemoryCgroup]:
    """A fresh cgroup whose processes may use ``limit`` bytes; removed afterwards (its
    processes must have ended)."""
    found = _root()
    if os.geteuid() != 0 or found is None:
        pytest.skip("memory cgroups: needs root and a kernel that accounts memory")
    root, v2 = found
    path = os.path.join(root, f"gpufrac-test-{uuid.uuid4().hex[:12]}")
    os.mkdir(path)
    try:
        with open(os.path.join(path, "memory.max" if v2 else "memory.limit_in_bytes"), "w") as f:
            f.write(str(limit))
        yield MemoryCgroup(path, v2)
    finally:
        # Its last member may still be exiting: the kernel refuses the removal until then.
        deadline = time.monotonic() + 10
        while True:
            try:
                os.rmdir(path)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
