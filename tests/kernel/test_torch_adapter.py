"""The CUDA adapter: no-ops without CUDA, and the torch API it calls exists as it calls it."""

from __future__ import annotations

import inspect
import os

import pytest
import torch

from jupyter_gpufrac.kernel import torch_adapter

# (function, parameters our calls pass by position or name), as torch_adapter calls them.
CALLS = [
    (torch.cuda.is_available, []),
    (torch.cuda.is_initialized, []),
    (torch.cuda.current_device, []),
    (torch.cuda.device_count, []),
    (torch.cuda.get_device_properties, ["device"]),
    (torch.cuda.set_per_process_memory_fraction, ["fraction", "device"]),
    (torch.cuda.empty_cache, []),
    (torch.cuda.memory_reserved, ["device"]),
    (torch.cuda.memory_allocated, ["device"]),
    (torch.cuda.mem_get_info, ["device"]),
    (torch.cuda.get_rng_state_all, []),
    (torch.cuda.set_rng_state, ["new_state", "device"]),
    (torch.get_rng_state, []),
    (torch.set_rng_state, ["new_state"]),
]


@pytest.mark.parametrize(("func", "params"), CALLS, ids=lambda v: getattr(v, "__name__", ""))
def test_torch_functions_exist_with_the_parameters_we_pass(func: object, params: list[str]) -> None:
    signature = inspect.signature(func)  # type: ignore[arg-type]
    names = list(signature.parameters)
    assert names[: len(params)] == params, names


def test_out_of_memory_error_is_found() -> None:
    assert torch.OutOfMemoryError in torch_adapter.oom_exception_types()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without CUDA")
def test_everything_is_a_clean_no_op_without_cuda() -> None:
    assert not torch_adapter.cuda_available()
    assert torch_adapter.set_memory_cap(1 << 30, 16 << 30) is None
    assert torch_adapter.empty_cache() is False
    assert torch_adapter.reserved_bytes() is None
    assert torch_adapter.allocated_bytes() is None
    assert torch_adapter.free_bytes() is None
    assert torch_adapter.device_total() is None
    assert torch_adapter.current_device() == "cpu"
    assert torch_adapter.cuda_rng_states() is None
    assert torch_adapter.set_cuda_rng_states([b"x"]) is False


def test_a_parked_kernel_never_asks_cuda_until_it_attaches_to_a_gpu(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The driver reads CUDA_VISIBLE_DEVICES when it initialises: one question from a parked
    # kernel (is_available initialises it) and the GPU it gets back would stay invisible.
    asked: list[str] = []

    def is_available() -> bool:
        asked.append("is_available")
        return True

    monkeypatch.setattr(torch.cuda, "is_available", is_available)
    monkeypatch.setattr(torch_adapter, "_cuda_held", False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    torch_adapter.hold_cuda()
    assert torch_adapter.current_device() == "cpu"
    assert torch_adapter.reserved_bytes() is None and torch_adapter.cuda_rng_states() is None
    assert torch_adapter.set_memory_cap(1 << 30) is None and not torch_adapter.empty_cache()
    assert asked == []
    assert torch_adapter.attach_cuda("GPU-1,GPU-2")
    assert torch_adapter.cuda_available() and asked == ["is_available"]
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "GPU-1,GPU-2"


def test_a_process_that_initialised_cuda_cannot_be_pointed_at_another_gpu(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(torch_adapter, "_cuda_held", True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert not torch_adapter.attach_cuda("GPU-1")
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "" and not torch_adapter.cuda_available()
