"""Checkpoints written in the background (issue 27): the cell does not wait for the disk, the
snapshot is the namespace as the cell left it, and the last good checkpoint stays whole when
a write fails, is killed or loses its folder."""

from __future__ import annotations

import json
import os
import shutil
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy
import pytest
import torch

from jupyter_gpufrac import contract
from jupyter_gpufrac.kernel import store, tensor_io
from jupyter_gpufrac.kernel.checkpoint import Checkpointer, CheckpointError
from jupyter_gpufrac.server.kernel_channel import restore_summary

from .kernels import running_kernel, wait_written

SUMMARY = "__import__('jupyter_gpufrac.kernel', fromlist=['x']).summary()['checkpoint']"


def durable_cell(ckdir: Path) -> Any:
    """The cell the checkpoint on disk reflects (what a restore would say)."""
    header = Checkpointer(ckdir).read_header()
    assert header is not None
    return header["execution_count"]


@pytest.fixture
def stalled(monkeypatch: pytest.MonkeyPatch) -> Iterator[threading.Event]:
    """A disk that takes no blob until the event is set (the writer waits; nothing else)."""
    go = threading.Event()
    write = tensor_io.write_staged

    def slow(*args: Any, **kwargs: Any) -> int:
        assert go.wait(30), "the test never let the write go on"
        return write(*args, **kwargs)

    monkeypatch.setattr(tensor_io, "write_staged", slow)
    yield go
    go.set()


@pytest.fixture
def enospc() -> Iterator[None]:
    yield
    store.inject_enospc_after(None)


def test_begin_returns_before_the_write_and_the_snapshot_is_the_cells_end(
        ckdir: Path, stalled: threading.Event) -> None:
    ns: dict[str, Any] = {"t": torch.zeros(600_000), "small": torch.zeros(10),
                          "a": numpy.zeros(500_000), "items": [1, 2]}
    ck = Checkpointer(ckdir)
    job = ck.begin(ns, execution_count=1)
    assert not job.done.is_set(), "the snapshot is written after begin returns"
    assert ck.status()["writing"]["cell"] == 1
    assert ck.status()["durable_cell"] is None
    # The next cell writes in place into everything before the write reaches the disk.
    ns["t"].add_(1)
    ns["small"].add_(1)
    ns["a"] += 1
    ns["items"].append(3)
    stalled.set()
    assert job.wait(30) is job
    loaded: dict[str, Any] = {}
    result = Checkpointer(ckdir).load(loaded)
    assert result.execution_count == 1
    assert torch.equal(loaded["t"], torch.zeros(600_000))
    assert torch.equal(loaded["small"], torch.zeros(10))
    assert numpy.array_equal(loaded["a"], numpy.zeros(500_000))
    assert loaded["items"] == [1, 2]
    assert ck.status()["durable_cell"] == 1 and ck.status()["writing"] is None


def test_a_waiting_snapshot_is_superseded_by_the_next(ckdir: Path,
                                                       stalled: threading.Event) -> None:
    ns: dict[str, Any] = {"t": torch.zeros(300_000), "u": torch.ones(300_000)}
    ck = Checkpointer(ckdir)
    first = ck.begin(ns, execution_count=1)
    deadline = time.monotonic() + 10
    while (ck.writer.writing() or {}).get("queued", True):  # the writer has it (stalled)
        assert time.monotonic() < deadline
        time.sleep(0.01)
    ns["t"].add_(1)
    second = ck.begin(ns, execution_count=2)
    ns["u"].add_(1)
    third = ck.begin(ns, execution_count=3)
    ns["t"].add_(1)  # after the last snapshot: not in it
    assert second.superseded_by is third
    stalled.set()
    assert first.wait(30) is first
    assert second.wait(30) is third
    assert ck.flush(30)
    loaded: dict[str, Any] = {}
    assert Checkpointer(ckdir).load(loaded).execution_count == 3
    assert torch.equal(loaded["t"], torch.ones(300_000))
    assert torch.equal(loaded["u"], torch.full((300_000,), 2.0))
    header = ck.read_header()
    assert header is not None
    on_disk = {p.name for p in (ckdir / store.BLOB_DIR).iterdir()}
    assert on_disk == set(header["blobs"]), "what the third replaced is deleted"


def test_a_full_disk_mid_write_keeps_the_last_good_checkpoint(ckdir: Path, enospc: None) -> None:
    ns: dict[str, Any] = {"t": torch.zeros(1_000_000), "note": "first"}
    ck = Checkpointer(ckdir)
    ck.take(ns, execution_count=1)
    ns["t"] = torch.ones(4_000_000)  # 16 MB: the disk fills after 5 MB of it
    ns["note"] = "second"
    store.inject_enospc_after(5_000_000)
    job = ck.begin(ns, execution_count=2)
    with pytest.raises(Exception, match="No space left"):
        job.wait(30)
    assert "No space left" in (ck.status()["error"] or "")
    loaded: dict[str, Any] = {}
    assert Checkpointer(ckdir).load(loaded).execution_count == 1
    assert loaded["note"] == "first" and torch.equal(loaded["t"], torch.zeros(1_000_000))
    assert not list(ckdir.rglob(f"*{store.TMP_SUFFIX}")), "no temporary is left behind"
    # Room again: the next checkpoint writes what the failed one could not (its copies).
    store.inject_enospc_after(None)
    result = ck.take(ns, execution_count=3)
    assert result.bytes_written >= 16_000_000
    loaded = {}
    assert Checkpointer(ckdir).load(loaded).execution_count == 3
    assert loaded["note"] == "second" and torch.equal(loaded["t"], torch.ones(4_000_000))
    assert ck.status()["error"] is None


def test_a_removed_folder_is_made_again_by_the_next_checkpoint(ckdir: Path) -> None:
    ns: dict[str, Any] = {"t": torch.zeros(100_000), "x": 1}
    ck = Checkpointer(ckdir)
    ck.take(ns, execution_count=1)
    shutil.rmtree(ckdir)
    ns["x"] = 2
    ck.take(ns, execution_count=2)
    loaded: dict[str, Any] = {}
    assert Checkpointer(ckdir).load(loaded).execution_count == 2
    assert loaded["x"] == 2 and torch.equal(loaded["t"], torch.zeros(100_000))


def test_a_folder_removed_while_a_snapshot_waits_is_said_and_then_rewritten(
        ckdir: Path, stalled: threading.Event) -> None:
    ns: dict[str, Any] = {"t": torch.zeros(100_000), "x": 1}
    ck = Checkpointer(ckdir)
    stalled.set()
    ck.take(ns, execution_count=1)
    stalled.clear()
    ns["x"] = 2
    job = ck.begin(ns, execution_count=2)  # builds on t's blob, which is about to go
    while ckdir.exists():  # the writer may be creating its state file meanwhile
        shutil.rmtree(ckdir, ignore_errors=True)
    stalled.set()
    with pytest.raises(Exception) as failed:
        job.wait(30)
    assert "checkpoint" in str(failed.value)
    ns["x"] = 3
    ck.take(ns, execution_count=3)
    loaded: dict[str, Any] = {}
    assert Checkpointer(ckdir).load(loaded).execution_count == 3
    assert loaded["x"] == 3 and torch.equal(loaded["t"], torch.zeros(100_000))


def test_take_is_durable_when_it_returns(ckdir: Path, stalled: threading.Event) -> None:
    ns: dict[str, Any] = {"t": torch.zeros(300_000)}
    ck = Checkpointer(ckdir)
    ck.begin(ns, execution_count=1)
    ns["t"].add_(1)
    threading.Timer(0.3, stalled.set).start()
    result = ck.take(ns, execution_count=2)  # what the server asks before a move
    assert result.durable
    loaded: dict[str, Any] = {}
    assert Checkpointer(ckdir).load(loaded).execution_count == 2
    assert torch.equal(loaded["t"], torch.ones(300_000))


def test_a_failed_write_is_told_once_and_names_the_last_good_cell(ckdir: Path) -> None:
    env = {"GPUFRAC_CHECKPOINT_DIR": str(ckdir), store.ENOSPC_ENV: str(30 * 2**20)}
    with running_kernel(env) as k:
        assert k.run("import torch\nsmall = torch.zeros(1000)").status == "ok"
        wait_written(k)
        good = durable_cell(ckdir)
        assert good == 1
        out = k.run("big = torch.ones(16 * 2**20)")  # 64 MB: the disk fills mid-write
        assert out.status == "ok" and "failed" not in out.stderr
        wait_written(k)
        told = ""
        for i in range(4):
            cell = k.run(f"x{i} = {i}")
            assert cell.status == "ok", cell.text
            told += cell.stderr
            wait_written(k)
        assert told.count("automatic checkpoint failed") == 1, told
        assert "No space left" in told and f"after cell [{good}]" in told, repr(told)
        state = k.value(SUMMARY)
        assert state["durable_cell"] == good and "No space left" in state["error"], state
        assert f"after cell [{good}]" in k.run("%gpu").stdout
    loaded: dict[str, Any] = {}
    assert Checkpointer(ckdir).load(loaded).execution_count == good
    assert "big" not in loaded and torch.equal(loaded["small"], torch.zeros(1000))


def test_a_kernel_killed_mid_write_restores_the_previous_checkpoint(ckdir: Path) -> None:
    """And says that cells [2] and [3] ran after it (finding 8: every variable came back, as
    after cell [1], and the server said "restored 2 of 2 variables", a success)."""
    env = {"GPUFRAC_CHECKPOINT_DIR": str(ckdir), store.SLOW_ENV: "0.5"}
    with running_kernel(env) as k:
        assert k.run("import torch\na = torch.ones(2**18)").status == "ok"
        wait_written(k, timeout=120)
        good = durable_cell(ckdir)
        assert good == 1
        started = time.monotonic()
        out = k.run("a = torch.full((2**24,), 2.0)")  # 64 MB: 8 slow chunks, 4 s
        assert out.status == "ok"
        assert time.monotonic() - started < 3, "the cell did not wait for its checkpoint"
        writing = k.run(f"print({SUMMARY}['writing'])", silent=False)
        assert "bytes_total" in writing.stdout, writing.text
        os.kill(k.pid, signal.SIGKILL)
    reason = {"cause": "oom_killed", "message": "killed mid-write"}
    env.update({contract.RESTORE: "1", "GPUFRAC_RESTART_REASON": json.dumps(reason)})
    env.pop(store.SLOW_ENV)
    with running_kernel(env) as k:
        report = k.ask(contract.ASK_RESTORE_REPORT)["report"]
        assert report["checkpoint_cell"] == good, report
        assert f"after cell [{good}]" in report["message"]
        assert k.value("a.sum().item()") == 2**18
        assert report["last_cell"] == 3 and report["ok"] is False
        assert "Cells [2] to [3] ran after the checkpoint" in report["message"]
        summary = restore_summary(report, 60)
        assert summary["ok"] is False
        assert summary["message"] == (
            "restored 2 of 2 variables; cells [2] to [3] ran after the checkpoint (taken after "
            "cell [1]): re-run them if you need their effects."), summary["message"]


def test_a_removed_folder_never_breaks_a_cell_in_a_kernel(ckdir: Path) -> None:
    with running_kernel({"GPUFRAC_CHECKPOINT_DIR": str(ckdir)}) as k:
        assert k.run("import torch\nt = torch.zeros(1000)").status == "ok"
        wait_written(k)
        shutil.rmtree(ckdir)
        out = k.run("y = 2")
        assert out.status == "ok" and not out.stderr, out.text
        wait_written(k)
        loaded: dict[str, Any] = {}
        Checkpointer(ckdir).load(loaded)
        assert loaded["y"] == 2 and torch.equal(loaded["t"], torch.zeros(1000))


def test_checkpoint_error_is_a_checkpoint_error(ckdir: Path, enospc: None) -> None:
    ck = Checkpointer(ckdir)
    store.inject_enospc_after(0)
    with pytest.raises(CheckpointError, match="No space left"):
        ck.take({"t": torch.zeros(1_000_000)})
