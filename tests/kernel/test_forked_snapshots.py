"""Snapshots whose host bytes a forked child writes (issue 27): the cell does not copy them, the
child writes them as they were at the cell's end, and a kill or a full disk costs nothing but
that write."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import numpy
import psutil
import pytest
import torch

from jupyter_gpufrac import contract
from jupyter_gpufrac.kernel import forkwrite, store
from jupyter_gpufrac.kernel.checkpoint import Checkpointer

from .kernels import running_kernel, wait_written

SUMMARY = "__import__('jupyter_gpufrac.kernel', fromlist=['x']).summary()['checkpoint']"


def writers(pid: int) -> list[psutil.Process]:
    """The kernel's children that are alive (a forked snapshot writer is one)."""
    try:
        found = psutil.Process(pid).children()
    except psutil.NoSuchProcess:
        return []
    return [p for p in found if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


def gone(pid: int, timeout: float = 10.0) -> bool:
    """Whether process ``pid`` has ended (reaped or a zombie) within ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)
    return False


def durable_cell(ckdir: Path) -> Any:
    header = Checkpointer(ckdir).read_header()
    assert header is not None
    return header["execution_count"]


@pytest.fixture
def slow(monkeypatch: pytest.MonkeyPatch) -> None:
    """A disk taking 0.5 s per chunk of 8 MiB (children see the parent's setting at the fork)."""
    monkeypatch.setattr(store, "SLOW_WRITE_S", 0.5)


def test_a_change_after_the_snapshot_never_reaches_it(ckdir: Path, slow: None) -> None:
    ns: dict[str, Any] = {"t": torch.zeros(2**22), "a": numpy.random.default_rng(1).random(2**21)}
    kept = ns["a"].copy()
    ck = Checkpointer(ckdir)
    job = ck.begin(ns, execution_count=1)
    assert forkwrite.live() == 1, "the tensor and the array went to a forked writer"
    # The next cell writes in place into both while the child still writes them.
    ns["t"].add_(1)
    ns["a"] += 1
    assert not job.done.is_set()
    assert job.wait(30) is job
    loaded: dict[str, Any] = {}
    assert Checkpointer(ckdir).load(loaded).execution_count == 1
    assert torch.equal(loaded["t"], torch.zeros(2**22))
    assert numpy.array_equal(loaded["a"], kept)
    assert forkwrite.live() == 0
    assert not list(ckdir.rglob(f"*{store.TMP_SUFFIX}"))


def test_shared_memory_is_copied_not_left_to_a_child(ckdir: Path, slow: None) -> None:
    # A child's view of a shared mapping keeps changing with the notebook's writes.
    ns: dict[str, Any] = {"t": torch.zeros(2**22).share_memory_(), "u": torch.zeros(2**22)}
    ck = Checkpointer(ckdir)
    job = ck.begin(ns, execution_count=1)
    forked = sorted(item.child is not None for item in job.staged.values()
                    if item.nbytes == 2**24)
    assert forked == [False, True], "the shared tensor copied, the other forked"
    ns["t"].add_(1)
    ns["u"].add_(1)
    assert job.wait(30) is job
    loaded: dict[str, Any] = {}
    Checkpointer(ckdir).load(loaded)
    assert torch.equal(loaded["t"], torch.zeros(2**22))
    assert torch.equal(loaded["u"], torch.zeros(2**22))


def test_at_most_two_children_and_a_third_snapshot_copies(ckdir: Path, slow: None) -> None:
    ns: dict[str, Any] = {"t": torch.zeros(2**22)}
    ck = Checkpointer(ckdir)
    first = ck.begin(ns, execution_count=1)
    ns["t"].add_(1)
    second = ck.begin(ns, execution_count=2)
    assert forkwrite.live() == 2 and not first.done.is_set()
    [child] = {item.child for item in second.staged.values() if item.child is not None}
    ns["t"].add_(1)
    third = ck.begin(ns, execution_count=3)
    assert [item.child for item in third.staged.values() if item.nbytes == 2**24] == [None]
    # The second waited and nothing it wrote is named by the third: its child is let go.
    assert second.superseded_by is third and gone(child.pid)
    assert forkwrite.live() == 1
    ns["t"].add_(1)
    assert ck.flush(60)
    loaded: dict[str, Any] = {}
    assert Checkpointer(ckdir).load(loaded).execution_count == 3
    assert torch.equal(loaded["t"], torch.full((2**22,), 2.0))
    header = ck.read_header()
    assert header is not None
    on_disk = {p.name for p in (ckdir / store.BLOB_DIR).iterdir()}
    assert on_disk == set(header["blobs"]), "what superseded snapshots wrote is deleted"
    assert forkwrite.live() == 0


def test_a_kernel_restores_what_its_forked_snapshot_wrote(ckdir: Path) -> None:
    env = {"GPUFRAC_CHECKPOINT_DIR": str(ckdir), store.SLOW_ENV: "0.3"}
    with running_kernel(env) as k:
        out = k.run("import torch, numpy\ntorch.manual_seed(0)\n"
                    "t = torch.randn(2**22)\nv = t[10:20]\n"
                    "a = numpy.random.default_rng(2).random(2**21)")
        assert out.status == "ok", out.text
        assert writers(k.pid), "a child writes the snapshot while the kernel goes on"
        wait_written(k)
        assert not writers(k.pid)
        t_sum = k.value("float(t.sum())")
    loaded: dict[str, Any] = {}
    assert Checkpointer(ckdir).load(loaded).execution_count == 2  # k.value ran a cell
    torch.manual_seed(0)
    assert torch.equal(loaded["t"], torch.randn(2**22))
    assert float(loaded["t"].sum()) == t_sum
    assert loaded["v"].untyped_storage().data_ptr() == loaded["t"].untyped_storage().data_ptr()
    assert numpy.array_equal(loaded["a"], numpy.random.default_rng(2).random(2**21))


def test_a_kernel_killed_while_its_child_writes_leaves_the_last_good_and_no_child(
        ckdir: Path) -> None:
    env = {"GPUFRAC_CHECKPOINT_DIR": str(ckdir), store.SLOW_ENV: "0.5"}
    with running_kernel(env) as k:
        assert k.run("import torch\na = torch.ones(2**20)").status == "ok"
        wait_written(k, timeout=120)
        assert durable_cell(ckdir) == 1
        assert k.run("a = torch.full((2**24,), 2.0)").status == "ok"  # 64 MB: 8 slow chunks
        children = writers(k.pid)
        assert len(children) == 1, children
        os.kill(k.pid, signal.SIGKILL)
        assert gone(children[0].pid), "the writer died with the kernel"
    assert durable_cell(ckdir) == 1
    reason = {"cause": "oom_killed", "message": "killed mid-write"}
    env.update({contract.RESTORE: "1", "GPUFRAC_RESTART_REASON": json.dumps(reason)})
    env.pop(store.SLOW_ENV)
    with running_kernel(env) as k:
        report = k.ask(contract.ASK_RESTORE_REPORT)["report"]
        assert report["checkpoint_cell"] == 1, report
        assert k.value("a.sum().item()") == 2**20
        assert k.run("b = 1").status == "ok"
        wait_written(k)
    assert not list(ckdir.rglob(f"*{store.TMP_SUFFIX}")), "the killed child's temporary went"
    header = Checkpointer(ckdir).read_header()
    assert header is not None
    assert {p.name for p in (ckdir / store.BLOB_DIR).iterdir()} == set(header["blobs"])


def test_a_full_disk_in_the_child_is_told_once_and_the_next_checkpoint_writes_it_all(
        ckdir: Path) -> None:
    env = {"GPUFRAC_CHECKPOINT_DIR": str(ckdir), store.ENOSPC_ENV: str(30 * 2**20),
           store.SLOW_ENV: "0.3"}
    with running_kernel(env) as k:
        assert k.run("import torch\nsmall = torch.zeros(2**18)").status == "ok"
        wait_written(k)
        assert durable_cell(ckdir) == 1
        out = k.run("big = torch.ones(2**24)")  # 64 MB: the disk fills after 30 MB
        assert out.status == "ok", out.text
        assert writers(k.pid), "the child writes it"
        wait_written(k)
        assert durable_cell(ckdir) == 1
        told = ""
        for code in ("x = 1", "from jupyter_gpufrac.kernel import store\n"
                     "store.inject_enospc_after(None)"):
            cell = k.run(code)
            assert cell.status == "ok", cell.text
            told += cell.stderr
            wait_written(k)
        assert told.count("automatic checkpoint failed") == 1, told
        assert "No space left" in told, told
        state = k.value(SUMMARY)
        assert state["error"] is None and state["durable_cell"] == 4, state
        assert k.run("y = 2").status == "ok"
        wait_written(k)
    loaded: dict[str, Any] = {}
    Checkpointer(ckdir).load(loaded)
    assert loaded["y"] == 2
    assert torch.equal(loaded["big"], torch.ones(2**24))
    assert torch.equal(loaded["small"], torch.zeros(2**18))
    assert not list(ckdir.rglob(f"*{store.TMP_SUFFIX}"))


def test_the_copy_path_is_kept_as_the_fallback(ckdir: Path) -> None:
    env = {"GPUFRAC_CHECKPOINT_DIR": str(ckdir), store.SLOW_ENV: "0.3",
           forkwrite.MODE_ENV: "copy"}
    with running_kernel(env) as k:
        out = k.run("import torch\nt = torch.arange(2**22, dtype=torch.float32)")
        assert out.status == "ok", out.text
        assert k.value(f"{SUMMARY}['writing'] is not None"), "still being written"
        assert not writers(k.pid), "copied, not forked"
        assert k.run("t.add_(1)").status == "ok"
        wait_written(k)
    loaded: dict[str, Any] = {}
    assert Checkpointer(ckdir).load(loaded).execution_count == 3
    assert torch.equal(loaded["t"], torch.arange(2**22, dtype=torch.float32) + 1)
