"""A restore streams storages: read in chunks by several threads, through a ring of host buffers to
their device, and gives every tensor back bit for bit with its sharing (issue 35)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from jupyter_gpufrac.kernel import stream
from jupyter_gpufrac.kernel.checkpoint import Checkpointer

MiB = 2**20


def noisy_bits(nbytes: int, seed: int) -> torch.Tensor:
    """Random bytes seen as float32: NaNs with payloads, infinities, denormals, -0.0 (only a
    bit-for-bit copy keeps them all)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=generator).view(
        torch.float32)


def namespace() -> dict[str, Any]:
    base = noisy_bits(3 * MiB + 4 * 123, 1)  # several chunks, and a last one cut short
    model = torch.nn.Linear(64, 32)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 64)).sum().backward()
    opt.step()
    return {
        "base": base,
        "view": base[1000:2000].view(10, 100),  # a view of base's storage
        "alias": base,  # the same tensor twice
        "in_a_list": [base[::3], noisy_bits(4096, 2)],  # another group viewing the same storage
        "half": torch.randn(5000).to(torch.float16),
        "ints": torch.arange(70_000, dtype=torch.int64),
        "empty": torch.empty(0),
        "bare": noisy_bits(MiB // 2, 3).untyped_storage(),
        "model": model, "opt": opt,
    }


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()
            and torch.equal(a.detach().contiguous().view(torch.uint8),
                            b.detach().contiguous().view(torch.uint8)))


@pytest.fixture
def small_ring(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Every storage through a ring of three 256 KiB pageable buffers (what a GPU restore does,
    with a device's pinned buffers): a few MiB need the ring many times over."""
    ring = stream.Ring(count=3, chunk=256 * 1024, pinned=False)
    taken = {"buffers": 0, "threads": 0}
    threads: set[int] = set()
    lock = threading.Lock()
    real_take = ring.take

    def take() -> tuple[int, Any]:
        with lock:
            taken["buffers"] += 1
            threads.add(threading.get_ident())
            taken["threads"] = len(threads)
        return real_take()

    monkeypatch.setattr(ring, "take", take)
    monkeypatch.setattr(stream, "HOST_VIA_RING", True)
    monkeypatch.setattr(stream, "CHUNK", ring.chunk)
    monkeypatch.setattr(stream, "_ring", ring)
    return taken


def test_a_restore_through_the_ring_gives_every_tensor_back_bit_for_bit_with_its_sharing(
    ckdir: Path, small_ring: dict[str, int]
) -> None:
    ns = namespace()
    Checkpointer(ckdir).take(ns)
    loaded: dict[str, Any] = {}
    result = Checkpointer(ckdir).load(loaded)
    assert not result.lost and set(result.restored) == set(ns)
    # Through the ring: a chunk at a time, by several threads at once.
    assert small_ring["buffers"] >= (3 * MiB + MiB // 2) // (256 * 1024)
    assert small_ring["threads"] > 1
    for name in ("base", "view", "half", "ints", "empty"):
        assert same_bits(loaded[name], ns[name]), name
        assert loaded[name].device.type == "cpu"
    assert same_bits(loaded["in_a_list"][0], ns["in_a_list"][0])
    assert same_bits(loaded["in_a_list"][1], ns["in_a_list"][1])
    assert bytes(loaded["bare"]) == bytes(ns["bare"])
    # Sharing as it was: one tensor, views of one storage (across groups too), at their offsets.
    assert loaded["alias"] is loaded["base"]
    storage = loaded["base"].untyped_storage()
    for viewer in (loaded["view"], loaded["in_a_list"][0]):
        assert viewer.untyped_storage().data_ptr() == storage.data_ptr()
    loaded["base"][1000] = 7.0
    assert loaded["view"][0, 0] == 7.0 and loaded["in_a_list"][0][0] == loaded["base"][0]
    # The model and its optimizer: parameters shared, values bit for bit.
    params = list(loaded["model"].parameters())
    assert loaded["opt"].param_groups[0]["params"][0] is params[0]
    for new, old in zip(params, ns["model"].parameters(), strict=True):
        assert same_bits(new, old)
    momentum = loaded["opt"].state[params[0]]["momentum_buffer"]
    assert same_bits(momentum, ns["opt"].state[next(ns["model"].parameters())]["momentum_buffer"])


def test_a_blob_cut_short_loses_its_variables_not_the_others(
    ckdir: Path, small_ring: dict[str, int]
) -> None:
    ns = {"big": noisy_bits(2 * MiB, 4), "other": torch.arange(10.0)}
    Checkpointer(ckdir).take(ns)
    blobs = sorted((ckdir / "blobs").iterdir(), key=lambda p: p.stat().st_size)
    with open(blobs[-1], "r+b") as f:  # the largest: big's storage
        f.truncate(MiB)
    loaded: dict[str, Any] = {}
    result = Checkpointer(ckdir).load(loaded)
    assert "big" in result.lost and "expects" in result.lost["big"]
    assert torch.equal(loaded["other"], ns["other"])
