"""Atomic checkpoints under SIGKILL, and refusal of checkpoints another user could have written."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from jupyter_gpufrac.kernel import store
from jupyter_gpufrac.kernel.checkpoint import Checkpointer, CheckpointError

from .kernels import REPO
from .test_checkpoint import tensor_blobs

WRITER = """
import sys, threading, torch
from jupyter_gpufrac.kernel.checkpoint import Checkpointer

class Stall:
    # Pickled once to find what it shares, then saved after the other variables: by then
    # their new blobs are on disk, the state file that would name them is not.
    calls = 0
    def __reduce__(self):
        Stall.calls += 1
        if Stall.calls == 1:
            return (Stall, ())
        print("stalled", flush=True)
        threading.Event().wait()

ck = Checkpointer(sys.argv[1])
ns = {"a": torch.full((1000,), 1.0), "b": torch.full((10,), 2.0), "note": "first"}
ck.take(ns)
print("first", flush=True)
ns["a"].add_(1)
ns["note"] = "second"
ns["z_stall"] = Stall()
ck.take(ns)
"""


def test_kill_mid_write_leaves_the_previous_checkpoint_loadable(ckdir: Path) -> None:
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(ckdir)], cwd=REPO,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "first"
        assert proc.stdout.readline().strip() == "stalled"
        # While the snapshot is taken nothing is written: a's new bytes are a copy in memory.
        assert len(tensor_blobs(ckdir)) == 2, "mid-snapshot: the 2 old tensor blobs only"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    ns: dict[str, Any] = {}
    loaded = Checkpointer(ckdir).load(ns)
    assert ns["note"] == "first" and torch.equal(ns["a"], torch.full((1000,), 1.0))
    assert "z_stall" not in loaded.restored
    # The next writer cleans up what the killed one left behind.
    writer = Checkpointer(ckdir)
    writer.take(ns)
    writer.wait_for_cleanup()
    assert not [p for p in ckdir.rglob(f"*{store.TMP_SUFFIX}")]
    assert len(tensor_blobs(ckdir)) == 2


def test_directory_is_created_owner_only(ckdir: Path) -> None:
    old = os.umask(0o022)
    try:
        Checkpointer(ckdir).take({"x": 1})
    finally:
        os.umask(old)
    assert ckdir.stat().st_mode & 0o777 == 0o700
    assert (ckdir / store.BLOB_DIR).stat().st_mode & 0o777 == 0o700
    assert (ckdir / store.STATE_FILE).stat().st_mode & 0o777 == 0o600


def test_refuses_a_group_writable_directory(ckdir: Path) -> None:
    Checkpointer(ckdir).take({"x": 1})
    os.chmod(ckdir, 0o770)
    with pytest.raises(CheckpointError, match="writable by group or others"):
        Checkpointer(ckdir).load({})
    with pytest.raises(CheckpointError, match="writable by group or others"):
        Checkpointer(ckdir).take({"x": 2})


def test_refuses_a_file_owned_by_another_user(ckdir: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to give a file away")
    Checkpointer(ckdir).take({"x": 1})
    os.chown(ckdir / store.STATE_FILE, 65534, 65534)
    with pytest.raises(CheckpointError, match="belongs to uid 65534"):
        Checkpointer(ckdir).load({})


def test_refuses_a_blob_owned_by_another_user(ckdir: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to give a file away")
    Checkpointer(ckdir).take({"t": torch.ones(4)})
    (blob,) = tensor_blobs(ckdir)
    os.chown(blob, 65534, 65534)
    with pytest.raises(CheckpointError, match="belongs to uid 65534"):
        Checkpointer(ckdir).load({})


def test_refuses_a_symlinked_directory(tmp_path: Path, ckdir: Path) -> None:
    Checkpointer(ckdir).take({"x": 1})
    link = tmp_path / "link"
    link.symlink_to(ckdir)
    with pytest.raises(CheckpointError, match="symbolic link"):
        Checkpointer(link).load({})


def test_missing_and_damaged_checkpoints_are_clear_errors(ckdir: Path) -> None:
    with pytest.raises(CheckpointError, match="no checkpoint"):
        Checkpointer(ckdir).load({})
    Checkpointer(ckdir).take({"x": 1})
    state = ckdir / store.STATE_FILE
    state.write_bytes(state.read_bytes()[:-5])
    with pytest.raises(CheckpointError, match=r"incomplete or damaged|not a gpufrac"):
        Checkpointer(ckdir).load({})


def test_header_is_readable_without_unpickling(ckdir: Path) -> None:
    before = time.time()
    Checkpointer(ckdir).take({"x": 1, "t": torch.ones(3)}, execution_count=7)
    header = Checkpointer(ckdir).read_header()
    assert header is not None
    assert header["names"] == ["t", "x"] and header["execution_count"] == 7
    assert header["time"] >= before and header["tensors_bytes"] == 12
