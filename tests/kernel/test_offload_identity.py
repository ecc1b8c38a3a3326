"""One tensor that several references reach stays one object through offload and reload.

Without a GPU the two real seams of the code stand in for the devices, and nothing of offload
itself is patched. ``offload`` takes ``on_gpu`` and ``host`` as arguments: a predicate that
says "on the device" for the test's original CPU tensors makes it copy them to the host through
its real replacement logic. ``reload`` moves a record's tensors to ``record.device``: the test
points those records at ``meta``, the second device every torch build has, so reload really
makes new tensor objects there (meta keeps shape and dtype, not data, and identity is what is
checked here). Module records stay on ``cpu``: torch keeps a parameter's identity moving
between cpu and cuda, but swaps in new parameters moving cpu -> meta, an artifact of meta.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any, NamedTuple

import torch

from jupyter_gpufrac.kernel import offload


class StandIn:
    """Tensors standing in for "on the GPU": the originals, never the copies made of them."""

    def __init__(self, tensors: Iterable[torch.Tensor]) -> None:
        self.ids = {id(t) for t in tensors}
        self.keep = list(tensors)  # alive, so no copy can reuse one of their ids

    def __call__(self, tensor: Any) -> bool:
        return id(tensor) in self.ids


def to_meta(records: list[offload.Offloaded]) -> list[offload.Offloaded]:
    # The records say where the tensors came from: meta is a device reload can really reach.
    return [r if r.kind == "module" else dataclasses.replace(r, device="meta") for r in records]


class Batch(NamedTuple):
    x: torch.Tensor
    label: str


def test_a_tensor_in_a_name_a_list_and_the_output_cache_comes_back_as_one_object() -> None:
    """The GPU acceptance test's namespace: ``pair[0] is big`` after offload and reload."""
    big, other = torch.ones(64), torch.zeros(3)
    model = torch.nn.Linear(4, 4)
    ns: dict[str, Any] = {"big": big, "pair": [big, other], "Out": {3: big}, "_": big,
                          "_3": big, "model": model}
    moved = offload.offload(ns, host="cpu", on_gpu=StandIn([big, other, *model.parameters()]))
    assert ns["big"] is not big and ns["pair"][0] is ns["big"] is ns["_"] is ns["Out"][3]
    back, left = offload.reload(ns, to_meta(moved), None)
    assert sorted(r.name for r in back) == ["big", "model", "pair"] and left == []
    assert ns["pair"][0] is ns["big"] and ns["big"].device.type == "meta"
    assert ns["pair"][1].device.type == "meta"
    # Shown outputs stay on the host, still one object among themselves.
    assert ns["_"] is ns["_3"] is ns["Out"][3] and ns["_"].device.type == "cpu"
    # What reload returns names the objects now bound, so a second reload forgets nothing.
    assert {r.name: r.obj_id for r in back}["big"] == id(ns["big"])


def assert_one_object_each(ns: dict[str, Any], when: str) -> None:
    one = ns["big"]
    assert ns["shared"] is ns["holder"][0] is ns["by_key"]["t"], when
    assert ns["shared"][0] is one and ns["shared"][1] == "label", when
    assert ns["holder"][1]["deep"][0] is one and ns["holder"][2] is ns["holder"], when
    assert isinstance(ns["batch"], Batch) and ns["batch"].x is one, when


def test_tuples_nested_containers_and_namedtuples_keep_one_object_per_tensor() -> None:
    big = torch.arange(8.0)
    shared = (big, "label")
    ns: dict[str, Any] = {"big": big, "shared": shared, "holder": [shared, {"deep": [big]}],
                          "by_key": {"t": shared}, "batch": Batch(big, "b")}
    ns["holder"].append(ns["holder"])  # a list that holds itself ends the walk, not Python
    moved = offload.offload(ns, host="cpu", on_gpu=StandIn([big]))
    assert ns["big"] is not big
    assert_one_object_each(ns, "offload")
    back, left = offload.reload(ns, to_meta(moved), None)
    assert {r.name for r in back} == {"big", "shared", "holder", "by_key", "batch"}
    assert left == [] and ns["big"].device.type == "meta"
    assert_one_object_each(ns, "reload")


def test_a_module_keeps_its_parameters_and_the_optimizer_state_follows_as_one_object() -> None:
    """The module moves in place, so the optimizer's keys stay its parameters; its state comes
    back as the objects the notebook's names hold, and a CPU ``step`` stays on the CPU."""
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    weight = model.weight
    state = opt.state[weight]
    # Adam keeps ``step`` on the CPU (not capturable): only the moments live on the GPU.
    device = StandIn([*model.parameters(), *(s[k] for s in opt.state.values()
                                              for k in ("exp_avg", "exp_avg_sq"))])
    ns: dict[str, Any] = {"model": model, "opt": opt, "moments": [state["exp_avg"]],
                          "avg": state["exp_avg"]}
    moved = offload.offload(ns, host="cpu", on_gpu=device)
    assert ns["model"] is model and model.weight is weight
    assert opt.param_groups[0]["params"][0] is weight
    assert opt.state[weight]["exp_avg"] is ns["avg"] is ns["moments"][0]
    assert not device(ns["avg"])
    step = opt.state[weight]["step"]
    back, left = offload.reload(ns, to_meta(moved), None)
    assert left == [] and {r.name for r in back} == {"model", "opt", "avg", "moments"}
    assert opt.state[weight]["exp_avg"] is ns["avg"] is ns["moments"][0]
    assert ns["avg"].device.type == "meta" and opt.state[weight]["exp_avg_sq"].is_meta
    assert opt.state[weight]["step"] is step and step.device.type == "cpu"


def test_names_that_share_a_tensor_come_back_together_or_not_at_all() -> None:
    big, small = torch.ones(64), torch.ones(2)
    ns: dict[str, Any] = {"big": big, "pair": [big, small], "small": small, "alone": torch.ones(1)}
    ns["alone"] = alone = ns["alone"]
    moved = to_meta(offload.offload(ns, host="cpu", on_gpu=StandIn([big, small, alone])))
    sizes = {r.name: r.nbytes for r in moved}
    # Room for ``big`` alone: it would come back without its alias in ``pair``, so it waits.
    back, left = offload.reload(ns, moved, sizes["big"] + sizes["alone"])
    assert [r.name for r in back] == ["alone"]
    assert sorted(r.name for r in left) == ["big", "pair", "small"]
    assert ns["pair"][0] is ns["big"] and ns["big"].device.type == "cpu"
    back, left = offload.reload(ns, left, None)
    assert left == [] and ns["pair"][0] is ns["big"] and ns["pair"][1] is ns["small"]
    assert ns["big"].is_meta and ns["small"].is_meta
