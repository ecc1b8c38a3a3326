"""Snapshots that copy what changed at the cell's end and hold one copy at a time (issue 38): a
change after the snapshot never reaches it, a snapshot asked for while the writer is busy is
owed and taken when it is done, the writer keeps out of a running cell's way, and a kill or a
full disk costs nothing but that write."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy
import psutil
import pytest
import torch

from jupyter_gpufrac import contract
from jupyter_gpufrac.kernel import store, stream, tensor_io, writer
from jupyter_gpufrac.kernel.checkpoint import Checkpointer

from .kernels import running_kernel, wait_written

SUMMARY = "__import__('jupyter_gpufrac.kernel', fromlist=['x']).summary()['checkpoint']"
HOOK = "__import__('jupyter_gpufrac.kernel', fromlist=['x'])._hook"


def children(pid: int) -> list[psutil.Process]:
    """The kernel's children that are alive (a snapshot never forks one)."""
    try:
        found = psutil.Process(pid).children()
    except psutil.NoSuchProcess:
        return []
    return [p for p in found if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


def durable_cell(ckdir: Path) -> Any:
    header = Checkpointer(ckdir).read_header()
    assert header is not None
    return header["execution_count"]


@pytest.fixture
def slow(monkeypatch: pytest.MonkeyPatch) -> None:
    """A disk taking 0.5 s per chunk of 8 MiB."""
    monkeypatch.setattr(store, "SLOW_WRITE_S", 0.5)


def test_a_change_after_the_snapshot_never_reaches_it(ckdir: Path, slow: None) -> None:
    ns: dict[str, Any] = {"t": torch.zeros(2**22), "a": numpy.random.default_rng(1).random(2**21),
                          "s": torch.zeros(2**22).share_memory_()}
    kept = ns["a"].copy()
    # Earlier tests in this process may have left children of their own: only new ones count.
    before = {p.pid for p in children(os.getpid())}
    ck = Checkpointer(ckdir)
    job = ck.begin(ns, execution_count=1)
    # The next cell writes in place into all three while the writer still writes them.
    ns["t"].add_(1)
    ns["a"] += 1
    ns["s"].add_(1)
    assert not job.done.is_set()
    assert not [p for p in children(os.getpid()) if p.pid not in before], "nothing is forked"
    assert job.wait(30) is job
    loaded: dict[str, Any] = {}
    assert Checkpointer(ckdir).load(loaded).execution_count == 1
    assert torch.equal(loaded["t"], torch.zeros(2**22))
    assert torch.equal(loaded["s"], torch.zeros(2**22))
    assert numpy.array_equal(loaded["a"], kept)
    assert not list(ckdir.rglob(f"*{store.TMP_SUFFIX}"))


def test_a_snapshot_asked_for_while_the_writer_is_busy_is_owed_and_holds_no_copy(
        ckdir: Path, slow: None) -> None:
    ns: dict[str, Any] = {"t": torch.zeros(2**22)}
    ck = Checkpointer(ckdir)
    taken: list[Any] = []

    def take() -> None:
        taken.append(ck.begin(ns, execution_count=ck.owed))

    first = ck.begin(ns, execution_count=1)
    held = first.bytes_total
    for cell in (2, 3, 4):
        ns["t"].add_(1)
        assert ck.owe_if_busy(cell, take), "the writer is still busy with the first"
        assert ck.owed == cell and not taken
        # Owing copies nothing: what is staged is the first snapshot's bytes alone.
        assert first.bytes_total == held and not first.done.is_set()
    assert ck.status()["owed_cell"] == 4
    idle = threading.Event()
    assert ck.writer.when_idle(idle.set)
    assert idle.wait(30) and first.done.is_set()
    assert durable_cell(ckdir) == 1
    ck.take_owed()
    [owed] = taken
    assert ck.owed is None and ck.status()["owed_cell"] is None
    assert owed.wait(60) is owed
    loaded: dict[str, Any] = {}
    assert Checkpointer(ckdir).load(loaded).execution_count == 4
    assert torch.equal(loaded["t"], torch.full((2**22,), 3.0))
    header = ck.read_header()
    assert header is not None
    # A waiter goes on once its snapshot is durable; the blobs no longer named go after that.
    assert ck.flush(30)
    on_disk = {p.name for p in (ckdir / store.BLOB_DIR).iterdir()}
    assert on_disk == set(header["blobs"]), "what the first snapshot wrote and no longer names goes"


def test_flush_in_the_notebooks_thread_takes_the_owed_snapshot(ckdir: Path, slow: None) -> None:
    ns: dict[str, Any] = {"t": torch.zeros(2**22)}
    ck = Checkpointer(ckdir)
    ck.begin(ns, execution_count=1)
    ns["t"].add_(1)
    assert ck.owe_if_busy(2, lambda: ck.begin(ns, execution_count=2))
    assert ck.flush(60)
    assert durable_cell(ckdir) == 2 and ck.owed is None
    loaded: dict[str, Any] = {}
    Checkpointer(ckdir).load(loaded)
    assert torch.equal(loaded["t"], torch.ones(2**22))


def test_the_writer_waits_while_a_cell_runs_unless_someone_waits_for_it(
        ckdir: Path, slow: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(writer.CELL_YIELD_ENV, "30")
    ns: dict[str, Any] = {"t": torch.zeros(2**24)}  # 64 MiB: 8 chunks of 0.5 s
    ck = Checkpointer(ckdir)
    ck.writer.cell(running=True)
    job = ck.begin(ns, execution_count=1)
    time.sleep(1.5)
    stalled = job.bytes_done
    assert stalled <= 2 * store.WRITE_CHUNK, "at most the chunks under way when it paused"
    time.sleep(1.0)
    assert job.bytes_done == stalled, "no further chunk while the cell runs"
    ck.writer.cell(running=False)
    deadline = time.monotonic() + 10
    while job.bytes_done == stalled and time.monotonic() < deadline:
        time.sleep(0.05)
    assert job.bytes_done > stalled, "the cell ended: it writes on"
    ck.writer.cell(running=True)
    assert ck.flush(60), "someone waits: the writer does not pause for the cell"
    assert job.done.is_set() and durable_cell(ckdir) == 1


def test_a_long_cell_lets_the_writer_go_on(ckdir: Path, slow: None,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(writer.CELL_YIELD_ENV, "0.5")
    ns: dict[str, Any] = {"t": torch.zeros(2**23)}
    ck = Checkpointer(ckdir)
    ck.writer.cell(running=True)
    job = ck.begin(ns, execution_count=1)
    assert job.done.wait(30), "written while the cell still runs, once it ran past the yield"
    ck.writer.cell(running=False)


def test_staging_memory_is_kept_warm_between_snapshots_and_let_go_when_idle(
        ckdir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(writer.POOL_KEEP_ENV, "1")
    ns: dict[str, Any] = {"t": torch.zeros(2**22)}
    ck = Checkpointer(ckdir)
    tensor_io.STAGING.clear()
    ck.take(ns, execution_count=1)
    assert tensor_io.STAGING.kept >= 2**24, "the copy's buffer waits for the next snapshot"
    deadline = time.monotonic() + 10
    while tensor_io.STAGING.kept and time.monotonic() < deadline:
        time.sleep(0.05)
    assert tensor_io.STAGING.kept == 0, "let go once nothing was written for a while"


# In a process of its own: another test's writer would let the shared pools go on its keep.
RUNNING_CELL_KEEPS = """
import json, sys, time, torch
from jupyter_gpufrac.kernel import tensor_io
from jupyter_gpufrac.kernel.checkpoint import Checkpointer
ck = Checkpointer(sys.argv[1])
ck.writer.cell(running=True)
started = time.monotonic()
ck.take({"t": torch.zeros(2**22)}, execution_count=1)
time.sleep(max(0.0, started + 1.0 - time.monotonic()))  # what is checked: nothing for 5 keeps
kept = tensor_io.STAGING.kept
while tensor_io.STAGING.kept and time.monotonic() < started + 10:
    time.sleep(0.05)
print(json.dumps({"kept": kept, "later": tensor_io.STAGING.kept,
                  "after": time.monotonic() - started}))
"""


def test_staging_memory_waits_for_a_running_cells_end_but_not_for_a_long_job(
        ckdir: Path) -> None:
    # Cells that follow each other (a training loop) each take a snapshot at their end: a cell
    # that runs longer than the keep must not make the next copy go into fresh memory.
    env = {**os.environ, writer.CELL_YIELD_ENV: "0", writer.POOL_KEEP_ENV: "0.2",
           writer.POOL_KEEP_CELL_ENV: "2"}
    done = subprocess.run([sys.executable, "-c", RUNNING_CELL_KEEPS, str(ckdir)], env=env,
                          capture_output=True, text=True, timeout=60, check=True)
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["kept"] >= 2**24, "kept for the running cell's end, five keeps into it"
    assert got["later"] == 0, "let go once the cell ran longer than a cell keeps them"
    assert got["after"] >= 2, "not before"


def test_the_staging_pools_keep_as_much_as_the_kernels_snapshot_budget(
        ckdir: Path) -> None:
    # A pool keeping less than a snapshot may copy lets the largest copy go after each write:
    # the next cell's copy of 4 GiB then went into fresh memory (4-16 s here, not 0.3-0.5 s).
    assert tensor_io.STAGING.limit >= psutil.virtual_memory().total // 4 - 2**20, \
        "by default, what c.GpuFrac.checkpoint_staging_budget lets a snapshot copy (25%)"
    ck = Checkpointer(ckdir)
    ck.staging_budget = 40 * 2**20
    assert (tensor_io.STAGING.limit, stream.PINNED.limit) == (40 * 2**20, 40 * 2**20)
    tensor_io.STAGING.clear()
    ck.take({"a": torch.zeros(2**22), "b": torch.ones(2**22)}, execution_count=1)
    assert tensor_io.STAGING.kept == 2 * 2**24, "both copies wait for the next snapshot"
    ck.take({"a": torch.ones(2**22), "b": torch.zeros(2**22), "c": torch.full((2**22,), 2.0)},
            execution_count=2)
    assert 2 * 2**24 <= tensor_io.STAGING.kept <= 40 * 2**20, "no more than the budget is kept"
    ck.staging_budget = None
    assert tensor_io.STAGING.limit == 40 * 2**20, "an unbounded snapshot keeps the last limit"


def test_cells_that_outrun_the_disk_owe_their_snapshots_and_the_last_is_taken_when_idle(
        ckdir: Path) -> None:
    env = {"GPUFRAC_CHECKPOINT_DIR": str(ckdir), store.SLOW_ENV: "0.3"}
    with running_kernel(env) as k:
        out = k.run("import torch, numpy\ntorch.manual_seed(0)\n"
                    "t = torch.randn(2**22)\nv = t[10:20]\n"
                    "a = numpy.random.default_rng(2).random(2**21)")
        assert out.status == "ok", out.text
        for _ in range(4):  # a training loop, cell by cell, faster than the disk
            assert k.run("t.mul_(0.5).add_(1.0)\na *= 0.5").status == "ok"
            assert not children(k.pid), "nothing is forked"
        assert durable_cell(ckdir) < 5, "the disk is slower than the cells"
        # No more cells: the owed snapshot is taken once the writer is done, between cells.
        deadline = time.monotonic() + 60
        while durable_cell(ckdir) != 5 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert durable_cell(ckdir) == 5
        t_sum = k.value("float(t.sum())")
        a_sum = k.value("float(a.sum())")
    loaded: dict[str, Any] = {}
    Checkpointer(ckdir).load(loaded)
    torch.manual_seed(0)
    expected = torch.randn(2**22)
    a = numpy.random.default_rng(2).random(2**21)
    for _ in range(4):
        expected.mul_(0.5).add_(1.0)
        a *= 0.5
    assert torch.equal(loaded["t"], expected)
    assert float(loaded["t"].sum()) == t_sum and float(loaded["a"].sum()) == a_sum
    assert loaded["v"].untyped_storage().data_ptr() == loaded["t"].untyped_storage().data_ptr()
    assert numpy.array_equal(loaded["a"], a)


def test_a_kernel_killed_while_its_writer_writes_leaves_the_last_good(ckdir: Path) -> None:
    env = {"GPUFRAC_CHECKPOINT_DIR": str(ckdir), store.SLOW_ENV: "0.5"}
    with running_kernel(env) as k:
        assert k.run("import torch\na = torch.ones(2**20)").status == "ok"
        wait_written(k, timeout=120)
        assert durable_cell(ckdir) == 1
        assert k.run("a = torch.full((2**24,), 2.0)").status == "ok"  # 64 MB: 8 slow chunks
        assert k.value(f"{SUMMARY}['writing']['cell']") == 2
        os.kill(k.pid, signal.SIGKILL)
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
    assert not list(ckdir.rglob(f"*{store.TMP_SUFFIX}")), "the killed writer's temporary went"
    header = Checkpointer(ckdir).read_header()
    assert header is not None
    assert {p.name for p in (ckdir / store.BLOB_DIR).iterdir()} == set(header["blobs"])


def test_a_full_disk_is_told_once_and_the_next_checkpoint_writes_it_all(
        ckdir: Path) -> None:
    env = {"GPUFRAC_CHECKPOINT_DIR": str(ckdir), store.ENOSPC_ENV: str(30 * 2**20),
           store.SLOW_ENV: "0.3"}
    with running_kernel(env) as k:
        assert k.run("import torch\nsmall = torch.zeros(2**18)").status == "ok"
        wait_written(k)
        assert durable_cell(ckdir) == 1
        out = k.run("big = torch.ones(2**24)")  # 64 MB: the disk fills after 30 MB
        assert out.status == "ok", out.text
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


def test_beyond_the_staging_budget_a_host_tensor_is_held_not_copied_nor_left_out(
        ckdir: Path) -> None:
    ns: dict[str, Any] = {"big": torch.arange(2**22, dtype=torch.float32),
                          "grid": numpy.random.default_rng(5).random(2**19), "n": 1}
    ck = Checkpointer(ckdir)
    ck.staging_budget = 2**20  # big takes 16 MiB, grid 4 MiB: neither is copied
    first = ck.take(ns, execution_count=1)
    assert first.unprotected == {}, "held where they are and written from there"
    assert sorted(first.names) == ["big", "grid", "n"]
    loaded: dict[str, Any] = {}
    Checkpointer(ckdir).load(loaded)
    assert torch.equal(loaded["big"], ns["big"])
    assert numpy.array_equal(loaded["grid"], ns["grid"])


def test_a_held_tensor_changed_while_it_is_written_is_written_again_later(
        ckdir: Path, slow: None) -> None:
    ns: dict[str, Any] = {"big": torch.zeros(2**22)}  # 16 MiB: two slow chunks
    ck = Checkpointer(ckdir)
    ck.take(ns, execution_count=1)
    ck.staging_budget = 2**20
    ns["big"].add_(1)
    job = ck.begin(ns, execution_count=2)
    ns["big"].add_(1)  # the next cell, while the writer writes it from its memory
    with pytest.raises(writer.WriteError, match="changed while it was written"):
        job.wait(60)
    assert ck.writer.error is None, "not a failure to tell the notebook"
    assert durable_cell(ckdir) == 1, "the last good checkpoint stays"
    assert ck.take(ns, execution_count=3).unprotected == {}
    loaded: dict[str, Any] = {}
    assert Checkpointer(ckdir).load(loaded).execution_count == 3
    assert torch.equal(loaded["big"], torch.full((2**22,), 2.0))


def test_a_held_array_changed_while_it_is_written_is_written_again_later(
        ckdir: Path, slow: None) -> None:
    grid = numpy.zeros(2**21)  # 16 MiB
    ns: dict[str, Any] = {"grid": grid}
    ck = Checkpointer(ckdir)
    ck.take(ns, execution_count=1)
    ck.staging_budget = 2**20
    grid[7] = 1.0  # a few values set: the array stays watched, so it can be held
    job = ck.begin(ns, execution_count=2)
    if not job.staged or all(item.valid is None for item in job.staged.values()):
        pytest.skip("this kernel does not track writes here: nothing is held")
    grid[2**20] = 2.0
    with pytest.raises(writer.WriteError, match="changed while it was written"):
        job.wait(60)
    assert durable_cell(ckdir) == 1
    ck.take(ns, execution_count=3)
    loaded: dict[str, Any] = {}
    Checkpointer(ckdir).load(loaded)
    assert numpy.array_equal(loaded["grid"], grid)


# -- a device's storages (issue 35), checked with host tensors standing in for a GPU's: the same
# code, with plain host buffers where a GPU has pinned ones and no events (work is done when
# queued on the host) ---------------------------------------------------------------------------


@pytest.fixture
def as_device(monkeypatch: pytest.MonkeyPatch) -> stream.PinnedPool:
    """Host storages snapshotted as a GPU's are; a pinned pool of this test's own."""
    pool = stream.PinnedPool(2**30)
    monkeypatch.setattr(stream, "DEVICE_TYPES", ("cuda", "cpu"))
    monkeypatch.setattr(stream, "PINNED", pool)
    return pool


def test_a_device_storage_is_held_at_first_then_copied_into_staging_the_writer_pinned(
        ckdir: Path, as_device: stream.PinnedPool) -> None:
    t = torch.zeros(2**20)
    ns: dict[str, Any] = {"t": t, "rows": t.view(1024, 1024)[:8]}
    ck = Checkpointer(ckdir)
    job = ck.begin(ns, execution_count=1)
    # No warm buffer: the cell did not wait to pin one; the storage is held where it is.
    [held] = [s for s in job.staged.values() if s.on_device]
    assert held.data.data_ptr() == t.untyped_storage().data_ptr() and held.valid is not None
    assert job.wait(30) is job
    # The writer pinned one for the next snapshot, after the write.
    assert ck.writer.flush(30)
    assert as_device.kept == 4 * 2**20
    t.add_(1)
    job = ck.begin(ns, execution_count=2)
    [copied] = [s for name, s in job.staged.items() if s.nbytes == 4 * 2**20]
    assert not copied.on_device and copied.release is not None  # the pool's buffer
    t.add_(1)  # the next cell: after the copy, which never sees it
    assert job.wait(30) is job
    loaded: dict[str, Any] = {}
    assert Checkpointer(ckdir).load(loaded).execution_count == 2
    assert torch.equal(loaded["t"], torch.ones(2**20))
    assert loaded["rows"].untyped_storage().data_ptr() == loaded["t"].untyped_storage().data_ptr()
    assert as_device.kept == 4 * 2**20, "given back, kept for the next snapshot"


def test_a_held_device_storage_changed_before_it_is_written_is_written_again_later(
        ckdir: Path, as_device: stream.PinnedPool, slow: None) -> None:
    t = torch.zeros(2**22)  # 16 MiB, written slowly
    ns: dict[str, Any] = {"t": t}
    ck = Checkpointer(ckdir)
    ck.take(ns, execution_count=1)
    # The writer pins warm buffers for the next snapshot after the write: let it finish first.
    assert ck.writer.flush(30)
    as_device.clear()  # a pause: the warm buffers went
    t.add_(1)
    job = ck.begin(ns, execution_count=2)
    assert any(s.on_device for s in job.staged.values())
    t[5:9].add_(1)  # the next cell, through a view (which shares the version counter)
    with pytest.raises(writer.WriteError, match="changed while it was written"):
        job.wait(60)
    assert durable_cell(ckdir) == 1, "the last good checkpoint stays"
    ck.take(ns, execution_count=3)
    loaded: dict[str, Any] = {}
    assert Checkpointer(ckdir).load(loaded).execution_count == 3
    assert torch.equal(loaded["t"], t)


def test_an_inference_tensor_on_a_device_is_copied_at_the_cells_end(
        ckdir: Path, as_device: stream.PinnedPool) -> None:
    with torch.inference_mode():
        t = torch.zeros(2**20)
    ns: dict[str, Any] = {"t": t}
    job = Checkpointer(ckdir).begin(ns, execution_count=1)
    # No version counter to tell a later change by: it cannot be held.
    assert not any(s.on_device for s in job.staged.values())
    with torch.inference_mode():
        t.add_(1)
    job.wait(30)
    loaded: dict[str, Any] = {}
    Checkpointer(ckdir).load(loaded)
    assert torch.equal(loaded["t"], torch.zeros(2**20))
