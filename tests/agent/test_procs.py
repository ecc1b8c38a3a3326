"""The process watch polls look through: identities read once, descriptors let go, parents followed."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable

import pytest

from node_agent import procs

from .conftest import Holder


def _open_descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_the_watch_reads_each_process_once_while_it_lives(
    monkeypatch: pytest.MonkeyPatch, holders: Callable[..., Holder]
) -> None:
    reads: list[int] = []
    identify = procs.identify
    monkeypatch.setattr(procs, "identify", lambda pid: reads.append(pid) or identify(pid))
    watch = procs.ProcessWatch()
    h = holders()
    start = identify(h.pid)
    assert start is not None
    for _ in range(3):
        watch.sweep()
        assert watch.is_alive(h.pid, start.start_time)
        assert not watch.is_alive(h.pid, start.start_time + 1), "another start is another process"
    assert reads == [h.pid]
    h.proc.kill()  # not reaped: a zombie is not alive either
    time.sleep(0.1)
    watch.sweep()
    assert not watch.is_alive(h.pid, start.start_time)
    assert watch.identify(h.pid) is None
    watch.close()


def test_the_watch_lets_go_of_what_a_poll_no_longer_asks_for() -> None:
    sleepers = [subprocess.Popen(["sleep", "60"]) for _ in range(4)]
    try:
        watch = procs.ProcessWatch()
        before = _open_descriptors()
        for s in sleepers:
            assert watch.identify(s.pid) is not None
        assert _open_descriptors() == before + len(sleepers)
        watch.sweep()  # asked for since the last sweep: kept
        assert _open_descriptors() == before + len(sleepers)
        watch.sweep()  # not asked for since: let go
        assert _open_descriptors() == before
    finally:
        for s in sleepers:
            s.kill()
            s.wait()


def test_the_watch_follows_a_process_to_its_new_parent() -> None:
    """A process whose parent exits is handed to another: its ancestors are read again."""
    parent = subprocess.Popen(["sh", "-c", "sleep 60 & echo $!; read line"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert parent.stdout is not None and parent.stdin is not None
    child = int(parent.stdout.readline())
    try:
        watch = procs.ProcessWatch()
        assert watch.ancestors(child)[:2] == [parent.pid, os.getpid()]
        parent.stdin.close()
        parent.wait()
        watch.sweep()
        assert parent.pid not in watch.ancestors(child)
        watch.close()
    finally:
        os.kill(child, 9)


def test_one_stat_read_answers_what_a_sweep_needs(holders: Callable[..., Holder]) -> None:
    h = holders()
    st = procs.stat(h.pid)
    ident = procs.identify(h.pid)
    assert st is not None and ident is not None
    assert st.state in "RS" and (st.ppid, st.start_time) == (os.getpid(), ident.start_time)
    grown = st.rss
    h.hold(32)
    later = procs.stat(h.pid)
    assert later is not None and later.rss - grown >= 30 * 2**20
    assert procs.stat(2**22 + 1) is None
