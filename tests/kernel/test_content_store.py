"""Identical blobs are stored once per user, across kernels: kernels of one checkpoint root link
the content-addressed blobs another of them stored, and the retention sweep removes those no
checkpoint links any more."""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path
from typing import Any

import numpy

from jupyter_gpufrac import checkpoint_disk
from jupyter_gpufrac.kernel import store, tensor_io
from jupyter_gpufrac.kernel.checkpoint import Checkpointer
from jupyter_gpufrac.server import retention

from .kernels import running_kernel, wait_written

ARRAY = "numpy.random.default_rng(7).random(2**21)"  # 16 MiB that do not compress


def expected() -> Any:
    return numpy.random.default_rng(7).random(2**21)


def disk_bytes(root: Path) -> int:
    """What everything under ``root`` takes on disk, each file once (as du counts)."""
    seen: dict[tuple[int, int], int] = {}
    for path in root.rglob("*"):
        st = path.lstat()
        seen[(st.st_dev, st.st_ino)] = st.st_blocks * 512
    return sum(seen.values())


def array_blob(ckdir: Path) -> Path:
    header = Checkpointer(ckdir).read_header()
    assert header is not None
    [name] = [blob for group in header["groups"] for blob, _size in group.get("buffers", [])]
    return ckdir / store.BLOB_DIR / name


def stored(root: Path, blob: Path) -> Path:
    """The content store's file of a blob's bytes, named by their digest."""
    return root / store.CONTENT_DIR / tensor_io.content_name(tensor_io.digest(blob.read_bytes()))


def test_two_kernels_of_one_user_store_the_same_array_once(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    first, second = root / "kernel-1", root / "kernel-2"
    # One kernel writes the array and the writer shares it; the other finds it shared and links
    # it instead of writing it.
    for ckdir in (first, second):
        env = {"GPUFRAC_CHECKPOINT_DIR": str(ckdir)}
        with running_kernel(env) as k:
            out = k.run(f"import numpy\na = {ARRAY}\nn = 1")
            assert out.status == "ok", out.text
            wait_written(k)
    one, two = array_blob(first), array_blob(second)
    shared = stored(root, one)
    assert one.stat().st_ino == two.stat().st_ino == shared.stat().st_ino
    assert one.stat().st_nlink == 3
    assert disk_bytes(root) < 1.5 * 2**24, "the 16 MiB are on disk once"
    assert checkpoint_disk.measure(root).total < 1.5 * 2**24, "and counted once"
    for ckdir in (first, second):
        loaded: dict[str, Any] = {}
        Checkpointer(ckdir).load(loaded)
        assert numpy.array_equal(loaded["a"], expected()) and loaded["n"] == 1
    shutil.rmtree(first)
    loaded = {}
    Checkpointer(second).load(loaded)
    assert numpy.array_equal(loaded["a"], expected()), "the other kernel's checkpoint is whole"
    log = logging.getLogger("test")
    retention.sweep(str(root), 3600.0, {"kernel-2"}, 3600.0, log)
    assert shared.exists(), "still linked by the second kernel's checkpoint"
    shutil.rmtree(second)
    retention.sweep(str(root), 3600.0, set(), 3600.0, log)
    assert not shared.exists(), "no checkpoint links it any more"
    assert checkpoint_disk.measure(root).total < 2**20


def test_a_file_that_is_not_the_users_alone_is_never_linked(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    first, second = root / "kernel-1", root / "kernel-2"
    with running_kernel({"GPUFRAC_CHECKPOINT_DIR": str(first)}) as k:
        assert k.run(f"import numpy\na = {ARRAY}").status == "ok"
        wait_written(k)
    shared = stored(root, array_blob(first))
    # Someone made the shared file writable by others: it is not taken, and a copy is kept.
    os.chmod(shared, 0o666)
    with running_kernel({"GPUFRAC_CHECKPOINT_DIR": str(second)}) as k:
        assert k.run(f"import numpy\na = {ARRAY}").status == "ok"
        wait_written(k)
    assert array_blob(second).stat().st_ino != shared.stat().st_ino
    loaded: dict[str, Any] = {}
    Checkpointer(second).load(loaded)
    assert numpy.array_equal(loaded["a"], expected())
