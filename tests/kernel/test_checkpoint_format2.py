"""Upgrades lose nothing: a checkpoint of the previous format (2) restores, checkpoints again and
restores again; one of a newer format is refused with what to do, and never written over."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any

import numpy
import pytest
import torch

from jupyter_gpufrac.kernel import store
from jupyter_gpufrac.kernel.checkpoint import Checkpointer, CheckpointError
from jupyter_gpufrac.kernel.state_file import MAGIC

from .test_checkpoint import tensor_blobs

FIXTURE = Path(__file__).parent / "data" / "format2"  # how it was made: its README
NAMES = {"Net", "model", "opt", "scale", "weights", "row", "leaf", "frozen", "on_gpu", "storage",
         "table", "small", "items", "alias", "config", "square", "uses_scale"}


@pytest.fixture
def old(ckdir: Path) -> Path:
    """A copy of the format-2 checkpoint, owner-only as a kernel leaves it (git keeps neither
    owners nor these modes)."""
    shutil.copytree(FIXTURE / "checkpoint", ckdir)
    for folder in (ckdir, ckdir / store.BLOB_DIR):
        folder.chmod(0o700)
    for path in [ckdir / store.STATE_FILE, *(ckdir / store.BLOB_DIR).iterdir()]:
        path.chmod(0o600)
    return ckdir


def expected() -> dict[str, Any]:
    found: dict[str, Any] = json.loads((FIXTURE / "expected.json").read_text())
    return found


def restore(ckdir: Path, **kwargs: Any) -> tuple[dict[str, Any], Any]:
    ns: dict[str, Any] = {"__name__": "__main__"}
    return ns, Checkpointer(ckdir).load(ns, device="cpu", **kwargs)


def assert_as_saved(ns: dict[str, Any]) -> None:
    """The namespace the old code saved, every kind of variable as it was."""
    want = expected()
    model, opt = ns["model"], ns["opt"]
    # The writer's machine may run another float32 kernel than this one (a last-bit difference);
    # the optimizer state and the tensors below are compared exactly.
    assert torch.allclose(model(torch.ones(1, 4)), torch.tensor(want["model_output"]),
                          rtol=1e-6, atol=0.0)
    assert opt.param_groups[0]["params"][0] is model.fc.weight
    assert opt.state[model.fc.weight]["exp_avg"].tolist() == want["exp_avg"]
    weights, row = ns["weights"], ns["row"]
    assert weights.tolist() == torch.arange(12.0).reshape(3, 4).tolist()
    assert row.tolist() == [4.0, 5.0, 6.0, 7.0] and row.storage_offset() == 4
    assert row.untyped_storage().data_ptr() == weights.untyped_storage().data_ptr()
    assert ns["leaf"].requires_grad and ns["leaf"].grad.tolist() == [2.0, 2.0, 2.0]
    assert ns["frozen"].is_inference() and ns["frozen"].tolist() == [7.0, 7.0]
    assert ns["on_gpu"].dtype == torch.float64 and ns["on_gpu"].device.type == "cpu"
    assert ns["on_gpu"].tolist() == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]
    storage = ns["storage"]
    assert isinstance(storage, torch.UntypedStorage)
    assert bytes(storage) == numpy.arange(4, dtype=numpy.int32).tobytes()
    assert numpy.array_equal(ns["table"], numpy.arange(40_000).reshape(200, 200))
    assert numpy.array_equal(ns["small"], numpy.linspace(0.0, 1.0, 5))
    assert ns["items"] == [1, 2, [3]] and ns["alias"] is ns["items"]
    assert ns["config"] == {"lr": 0.1, "name": "run"}
    assert ns["square"](3) == 9 and ns["uses_scale"]() == 2.0
    assert isinstance(model, ns["Net"])


def test_a_format_2_checkpoint_restores_every_variable(old: Path) -> None:
    ns, loaded = restore(old)
    assert loaded.header["format"] == 2 and loaded.execution_count == 7
    assert loaded.lost == {} and set(loaded.restored) == NAMES
    assert loaded.moved_to_cpu_bytes == 48, "the tensor saved from a GPU, kept on the host"
    want = expected()
    # The generators continue where the old kernel left them.
    assert random.random() == want["random"] and float(numpy.random.rand()) == want["numpy"]
    assert float(torch.rand(1)) == want["torch"]
    assert_as_saved(ns)
    ns["scale"] = 3.0  # cell functions read the live namespace, as before the upgrade
    assert ns["uses_scale"]() == 3.0


def test_after_an_upgrade_the_next_checkpoint_keeps_everything_and_reuses_the_tensors(
    old: Path,
) -> None:
    ck = Checkpointer(old)
    ns: dict[str, Any] = {"__name__": "__main__"}
    header = ck.load(ns, device="cpu").header
    bare = {blob for group in header["groups"] if group["names"] == ["storage"]
            for blob in group["tensors"]}
    before = {p.name for p in tensor_blobs(old)}
    ck.take(ns)
    ck.wait_for_cleanup()
    header = ck.read_header()
    assert header is not None and header["format"] == 3
    # Restored tensors are not written again; the bare storage is (storages are not tracked).
    assert before - {p.name for p in tensor_blobs(old)} == bare
    again, loaded = restore(old)
    assert loaded.lost == {} and set(loaded.restored) == NAMES
    assert_as_saved(again)


def test_what_a_budgeted_restore_of_format_2_left_on_disk_survives_the_next_checkpoint(
    old: Path,
) -> None:
    ck = Checkpointer(old)
    ns: dict[str, Any] = {"__name__": "__main__"}
    loaded = ck.load(ns, device="cpu", budget=0)
    assert loaded.deferred == {"on_gpu": 48} and "on_gpu" not in ns
    ck.take(ns)  # format 3, naming the deferred format-2 group
    ck.wait_for_cleanup()
    elsewhere, loaded = restore(old)
    assert loaded.lost == {} and set(loaded.restored) == NAMES
    assert_as_saved(elsewhere)
    assert ck.load_deferred(ns, device="cpu") == (["on_gpu"], {})
    assert ns["on_gpu"].tolist() == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]


def with_format(ckdir: Path, found: object) -> bytes:
    """Rewrite the committed state's header to claim format ``found``; its new bytes."""
    header = Checkpointer(ckdir).read_header()
    assert header is not None
    data = json.dumps({**header, "format": found}).encode()
    state = MAGIC + data + len(data).to_bytes(8, "big") + MAGIC
    (ckdir / store.STATE_FILE).write_bytes(state)
    return state


def test_a_newer_format_is_refused_with_what_to_do_and_never_written_over(ckdir: Path) -> None:
    Checkpointer(ckdir).take({"x": [1, 2], "t": torch.ones(3)})
    state = with_format(ckdir, 4)
    blobs = sorted(p.name for p in (ckdir / store.BLOB_DIR).iterdir())
    with pytest.raises(CheckpointError, match="has format 4, written by a newer jupyter-gpufrac"
                       r".*nothing was loaded\. Install that newer version"):
        restore(ckdir)
    # A kernel that could not restore it goes on; its checkpoints must not destroy it.
    with pytest.raises(CheckpointError, match=r"format 4.*it was not overwritten"):
        Checkpointer(ckdir).take({"y": 1})
    assert (ckdir / store.STATE_FILE).read_bytes() == state
    assert sorted(p.name for p in (ckdir / store.BLOB_DIR).iterdir()) == blobs


def test_an_older_unknown_format_is_refused_by_number(ckdir: Path) -> None:
    Checkpointer(ckdir).take({"x": 1})
    with_format(ckdir, 1)
    with pytest.raises(CheckpointError,
                       match="has format 1, which this version of jupyter-gpufrac does not read"):
        restore(ckdir)
