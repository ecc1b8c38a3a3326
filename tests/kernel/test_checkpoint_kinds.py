"""Every kind of object a notebook makes round-trips, or is named; one bad object costs only itself."""

from __future__ import annotations

import random
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from jupyter_gpufrac.kernel.checkpoint import Checkpointer, CheckpointError


def round_trip(ckdir: Path, ns: dict[str, Any]) -> tuple[dict[str, Any], Any]:
    """Checkpoint ``ns``, load it into a fresh namespace with a fresh Checkpointer."""
    Checkpointer(ckdir).take(ns)
    fresh: dict[str, Any] = {}
    loaded = Checkpointer(ckdir).load(fresh)
    return fresh, loaded


class Poisoned:
    """Pickles fine; rebuilding it raises, as some C-extension objects do."""

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return (_explode, ("no way back",))


def _explode(message: str) -> None:
    raise RuntimeError(message)


def test_bare_storages_and_their_neighbours_come_back(ckdir: Path) -> None:
    storage = torch.arange(8, dtype=torch.uint8).untyped_storage()
    ns: dict[str, Any] = {"storage": storage, "a": 1, "b": [1, 2], "c": {"k": "v"},
                          "t": torch.ones(3), "s": "text"}
    fresh, loaded = round_trip(ckdir, ns)
    assert loaded.lost == {} and set(fresh) == set(ns)
    assert isinstance(fresh["storage"], torch.UntypedStorage)
    assert bytes(fresh["storage"]) == bytes(range(8))
    assert fresh["b"] == [1, 2] and torch.equal(fresh["t"], torch.ones(3))


def test_an_object_that_cannot_be_rebuilt_costs_only_its_group(ckdir: Path) -> None:
    shared = [1, 2, 3]
    ns: dict[str, Any] = {"poison": Poisoned(), "holder": {"p": None}, "x": shared,
                          "y": {"x": shared}, "t": torch.arange(4.0)}
    ns["holder"]["p"] = ns["poison"]  # poison and holder share an object: one group
    fresh, loaded = round_trip(ckdir, ns)
    assert set(loaded.lost) == {"poison", "holder"}
    assert "RuntimeError: no way back" in loaded.lost["poison"]
    assert fresh["y"]["x"] is fresh["x"] == [1, 2, 3]
    assert torch.equal(fresh["t"], torch.arange(4.0))


def test_inference_and_no_grad_tensors_round_trip_and_checkpoint_again(ckdir: Path) -> None:
    model = torch.nn.Linear(3, 2)
    with torch.inference_mode():
        y_preds = model(torch.ones(4, 3))
    with torch.no_grad():
        frozen = model(torch.ones(1, 3))
    ns: dict[str, Any] = {"y_preds": y_preds, "frozen": frozen, "model": model}
    ck = Checkpointer(ckdir)
    ck.take(ns)
    ck.take(ns)  # the incremental cache must cope with tensors without a version counter
    fresh: dict[str, Any] = {}
    loaded = Checkpointer(ckdir).load(fresh)
    assert loaded.lost == {}
    assert torch.equal(fresh["y_preds"], y_preds) and torch.equal(fresh["frozen"], frozen)
    # An inference tensor comes back as one: code relying on that behaves as before.
    assert fresh["y_preds"].is_inference() and not fresh["frozen"].is_inference()
    assert fresh["model"].weight.requires_grad and not fresh["model"].weight.is_inference()


@pytest.mark.parametrize("changed", ["base", "window"])
def test_a_change_through_either_of_two_restored_views_is_saved(ckdir: Path, changed: str) -> None:
    # Restored separately onto one storage, the two tensors no longer share a version
    # counter: the next checkpoint must still see a change made through either of them.
    base = torch.arange(10.0)
    ck = Checkpointer(ckdir)
    ck.take({"base": base, "window": base[2:5]})
    ns: dict[str, Any] = {}
    ck.load(ns)
    ns[changed].mul_(-1)
    expected = ns["base"].clone()
    ck.take(ns)
    fresh: dict[str, Any] = {}
    Checkpointer(ckdir).load(fresh)
    assert torch.equal(fresh["base"], expected) and fresh["base"][2] == -2.0
    assert torch.equal(fresh["window"], expected[2:5])


def test_a_restored_view_that_died_after_writing_is_not_missed(ckdir: Path) -> None:
    base = torch.arange(4.0)
    ck = Checkpointer(ckdir)
    ck.take({"base": base, "head": base[:2]})
    ns: dict[str, Any] = {}
    ck.load(ns)
    ns.pop("head").add_(10)  # written through, then gone: base's own counter never moved
    ck.take(ns)
    fresh: dict[str, Any] = {}
    Checkpointer(ckdir).load(fresh)
    assert fresh["base"].tolist() == [10.0, 11.0, 2.0, 3.0]


def test_views_in_different_groups_still_share_memory(ckdir: Path) -> None:
    base = torch.arange(10.0)
    ns: dict[str, Any] = {"base": base, "window": base[2:5]}
    fresh, _ = round_trip(ckdir, ns)
    fresh["window"][0] = 100.0
    assert fresh["base"][2] == 100.0


def test_special_tensor_kinds_round_trip(ckdir: Path) -> None:
    dense = torch.tensor([[0.0, 1.5], [2.0, 0.0]])
    ns: dict[str, Any] = {
        "coo": dense.to_sparse(),
        "csr": dense.to_sparse_csr(),
        "quantized": torch.quantize_per_tensor(torch.tensor([0.1, 0.5]), 0.1, 0, torch.quint8),
        "conj": torch.tensor([1 + 2j, 3 - 1j]).conj(),
        "neg": torch.tensor([1.0, -2.0])._neg_view(),
        "half": torch.ones(3, dtype=torch.bfloat16),
    }
    fresh, loaded = round_trip(ckdir, ns)
    assert loaded.lost == {}
    assert torch.equal(fresh["coo"].to_dense(), dense)
    assert torch.equal(fresh["csr"].to_dense(), dense)
    assert torch.equal(fresh["quantized"].dequantize(), ns["quantized"].dequantize())
    assert torch.equal(fresh["conj"].resolve_conj(), ns["conj"].resolve_conj())
    assert torch.equal(fresh["neg"].resolve_neg(), ns["neg"].resolve_neg())
    assert fresh["half"].dtype == torch.bfloat16


def test_training_state_round_trips_and_continues(ckdir: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    data = TensorDataset(torch.randn(16, 4), torch.randn(16, 1))
    loader = DataLoader(data, batch_size=4, shuffle=True,
                        generator=torch.Generator().manual_seed(3))
    loss = torch.nn.functional.mse_loss(model(data.tensors[0]), data.tensors[1])
    loss.backward()
    opt.step()
    sched.step()
    gen = torch.Generator().manual_seed(9)
    ns: dict[str, Any] = {"model": model, "opt": opt, "sched": sched, "loader": loader,
                          "gen": gen}
    fresh, loaded = round_trip(ckdir, ns)
    assert loaded.lost == {}
    # Parameters come back with their gradients, still shared with the optimizer and scheduler.
    params = list(fresh["model"].parameters())
    assert params[0] is fresh["opt"].param_groups[0]["params"][0]
    assert fresh["sched"].optimizer is fresh["opt"]
    assert torch.equal(params[0].grad, next(model.parameters()).grad)
    assert fresh["opt"].param_groups[0]["lr"] == opt.param_groups[0]["lr"] == 0.005
    # Generators continue: the same batches and the same draws as the undisturbed originals.
    assert [b[0].tolist() for b in fresh["loader"]] == [b[0].tolist() for b in loader]
    assert torch.equal(torch.rand(3, generator=fresh["gen"]), torch.rand(3, generator=gen))


def test_what_cannot_be_saved_is_named_with_the_reason(ckdir: Path) -> None:
    ns: dict[str, Any] = {"lock": threading.Lock(), "gen": (i for i in range(3)), "ok": 1}
    fresh, loaded = round_trip(ckdir, ns)
    assert fresh == {"ok": 1}
    assert "lock" in loaded.lost["lock"] and "generator" in loaded.lost["gen"]


def test_python_and_numpy_generators_continue_exactly(ckdir: Path) -> None:
    numpy = pytest.importorskip("numpy")
    random.seed(11)
    numpy.random.seed(12)
    ns: dict[str, Any] = {"rng": numpy.random.default_rng(13)}
    Checkpointer(ckdir).take(ns)
    expected = (random.random(), float(numpy.random.rand()), float(ns["rng"].random()))
    random.seed(0)
    numpy.random.seed(0)
    fresh: dict[str, Any] = {}
    loaded = Checkpointer(ckdir).load(fresh)
    assert {"python", "numpy"} <= set(loaded.rng) and loaded.rng_state
    assert (random.random(), float(numpy.random.rand()), float(fresh["rng"].random())) == expected


def test_only_changed_groups_are_written_again(ckdir: Path) -> None:
    ns: dict[str, Any] = {"a": [1, 2], "b": {"k": 1}, "t": torch.ones(1000)}
    ck = Checkpointer(ckdir)
    first = ck.take(ns)
    assert first.groups_written >= 3 and first.bytes_written == 4000
    same = ck.take(ns)
    assert same.group_bytes_written == 0 and same.bytes_written == 0
    ns["a"].append(3)
    changed = ck.take(ns)
    # One group was pickled anew (a's); b's and t's were not, and no tensor was written.
    assert changed.groups_written == 1 and changed.bytes_written == 0


def test_a_budgeted_restore_keeps_the_largest_on_disk_until_asked(ckdir: Path) -> None:
    base = torch.arange(100_000.0)
    ns: dict[str, Any] = {"big": torch.ones(250_000), "base": base, "window": base[:10],
                          "small": torch.ones(4), "xs": [1, 2]}
    Checkpointer(ckdir).take(ns)
    ck = Checkpointer(ckdir)
    restored: dict[str, Any] = {}
    loaded = ck.load(restored, budget=600_000, measure="bytes")
    # big (1 MB) goes first; base and window (400 kB, one storage) then fit.
    assert set(loaded.deferred) == {"big"} and loaded.deferred["big"] >= 1_000_000
    assert set(restored) == {"base", "window", "small", "xs"} and loaded.lost == {}
    loaded = Checkpointer(ckdir).load({}, budget=100_000, measure="bytes")
    assert set(loaded.deferred) == {"big", "base", "window"}, "a view waits with its base"
    # Checkpoints taken meanwhile keep what waits on disk.
    restored["xs"].append(3)
    ck.take(restored)
    again: dict[str, Any] = {}
    assert Checkpointer(ckdir).load(again).deferred == {}
    assert torch.equal(again["big"], ns["big"]) and again["xs"] == [1, 2, 3]
    # Loading it on demand, in the kernel that deferred it.
    assert ck.load_deferred(restored, ["big"]) == (["big"], {})
    assert torch.equal(restored["big"], ns["big"]) and ck.deferred == []


def test_a_name_bound_anew_is_not_overwritten_by_what_waited(ckdir: Path) -> None:
    Checkpointer(ckdir).take({"big": torch.ones(100_000), "other": torch.zeros(100_000)})
    ck = Checkpointer(ckdir)
    ns: dict[str, Any] = {}
    assert set(ck.load(ns, budget=0, measure="bytes").deferred) == {"big", "other"}
    ns["big"] = "new"
    ck.take(ns)
    fresh: dict[str, Any] = {}
    Checkpointer(ckdir).load(fresh)
    assert fresh["big"] == "new" and torch.equal(fresh["other"], torch.zeros(100_000))
    assert ck.load_deferred(ns) == (["other"], {}) and ns["big"] == "new"
    with pytest.raises(CheckpointError, match="not kept on disk: big"):
        ck.load_deferred(ns, ["big"])
