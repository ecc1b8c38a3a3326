"""Registering pids from another PID namespace: found without a scan of /proc per call."""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from typing import Any

import pytest

from harness.agent import wait_for
from node_agent import procs

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None, reason="a new PID namespace needs root")


@pytest.fixture
def pod() -> Iterator[tuple[int, int]]:
    """A shell in a new PID namespace (its pid 1) with a child there (its pid 2): their pids
    here (the shell's, the child's)."""
    outer = subprocess.Popen(["unshare", "--pid", "--fork", "sh", "-c", "sleep 60 & wait"],
                             stderr=subprocess.DEVNULL)

    def children(pid: int) -> list[int]:
        try:
            with open(f"/proc/{pid}/task/{pid}/children") as f:
                return [int(p) for p in f.read().split()]
        except OSError:
            return []

    shell = wait_for(lambda: children(outer.pid), 10, "the namespace's shell")[0]
    sleep = wait_for(lambda: children(shell), 10, "the shell's child")[0]
    yield shell, sleep
    with contextlib.suppress(ProcessLookupError):  # gone once its child is
        os.kill(shell, 9)  # init of its namespace: the child goes with it
    outer.wait()


@pytest.fixture
def scans(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Each scan of /proc made from now on (a scan is due at the first asking)."""
    made: list[str] = []
    scandir = os.scandir

    def counted(path: Any) -> Any:
        if path == "/proc":
            made.append(path)
        return scandir(path)

    monkeypatch.setattr(procs.os, "scandir", counted)
    monkeypatch.setattr(procs, "_scanned_at", -math.inf)
    return made


def test_a_pid_of_another_namespace_is_found_without_a_scan_per_call(
    pod: tuple[int, int], scans: list[str]
) -> None:
    shell, sleep = pod
    assert procs.as_seen_here(shell, 1) == shell
    started = time.perf_counter()
    for _ in range(50):
        assert procs.as_seen_here(shell, 2) == sleep
    took = time.perf_counter() - started
    assert len(scans) <= 1, f"{len(scans)} scans of /proc for 50 registrations"
    assert took < 0.5
    # Not a pid of that namespace: None, and the searching never finds one of another.
    assert procs.as_seen_here(shell, 7777) is None
    assert procs.as_seen_here(shell, os.getpid()) in (None, shell, sleep)
    # The process exits: what was remembered of it is not answered any more.
    os.kill(sleep, 9)
    wait_for(lambda: procs.stat(sleep) is None, 10, "the child to exit and be reaped")
    assert procs.as_seen_here(shell, 2) is None


def test_a_remembered_pid_reused_by_another_process_is_not_answered(
    pod: tuple[int, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    shell, sleep = pod
    # The child asks for its parent: not a descendant, found by a scan of /proc.
    monkeypatch.setattr(procs, "_scanned_at", -math.inf)
    assert procs.as_seen_here(sleep, 1) == shell
    key = next(k for k, v in procs._elsewhere.items() if v[0] == shell)
    # As if pid `shell` now were another process: its start time differs from the one seen.
    procs._elsewhere[key] = (shell, procs._elsewhere[key][1] + 1)
    assert procs._remembered(*key) is None
    assert procs.as_seen_here(sleep, 1) is None  # no new scan so soon after the last
    monkeypatch.setattr(procs, "_scanned_at", -math.inf)
    assert procs.as_seen_here(sleep, 1) == shell  # found again, by a new scan


def test_asking_again_and_again_for_a_pid_nobody_has_scans_proc_at_most_once(
    pod: tuple[int, int], scans: list[str]
) -> None:
    """Finding 4: a caller in a PID namespace of its own asks for pids that are nowhere; the
    agent read all of /proc for each (150 ms per call with 1,000 sleepers there)."""
    shell, _ = pod
    for missing in range(1000, 1050):
        assert procs.as_seen_here(shell, missing) is None
    assert len(scans) == 1
