"""The only place that calls torch.cuda: every call no-ops cleanly without torch or CUDA."""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

log = logging.getLogger(__name__)

# While the kernel is parked nothing here may touch CUDA: the driver reads
# CUDA_VISIBLE_DEVICES once, when it initialises, and the GPU is chosen only at the next cell.
_cuda_held = False


def hold_cuda() -> None:
    """From now on every call here answers as if there were no CUDA, without asking CUDA."""
    global _cuda_held
    _cuda_held = True


def attach_cuda(visible: str) -> bool:
    """Let CUDA see ``visible`` (GPU UUIDs) from now on; False when CUDA was initialised
    already in this process (then the driver keeps what it saw at that time)."""
    global _cuda_held
    torch = torch_module()
    if torch is not None and torch.cuda.is_initialized():
        return False
    os.environ["CUDA_VISIBLE_DEVICES"] = visible
    _cuda_held = False
    return True


def torch_module() -> Any | None:
    """The torch module if the user imported it; we never import torch ourselves (it is slow)."""
    return sys.modules.get("torch")


def cuda_available() -> bool:
    """True when torch is imported and sees a CUDA device."""
    torch = torch_module()
    if torch is None or _cuda_held:
        return False
    try:
        return bool(torch.cuda.is_available())
    except Exception:  # a broken driver must not break the kernel
        log.debug("torch.cuda.is_available failed", exc_info=True)
        return False


def device_total() -> int | None:
    """Total memory of the kernel's CUDA device, or None."""
    if not cuda_available():
        return None
    torch = torch_module()
    assert torch is not None
    return int(torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory)


def set_memory_cap(nbytes: int, total: int | None = None) -> float | None:
    """Cap the caching allocator at ``nbytes`` on every visible device (a multi-GPU lease has
    the same request and limit on each); returns the fraction applied to the current device,
    None without CUDA. ``total`` is the lease's GPU size when the agent told us."""
    if not cuda_available():
        return None
    torch = torch_module()
    assert torch is not None
    current = torch.cuda.current_device()
    applied: float | None = None
    for index in range(torch.cuda.device_count()):
        size = total or int(torch.cuda.get_device_properties(index).total_memory)
        fraction = max(0.0, min(1.0, nbytes / size))
        torch.cuda.set_per_process_memory_fraction(fraction, index)
        if index == current:
            applied = fraction
    return applied


def empty_cache() -> bool:
    """Give cached allocator blocks back to the GPU; False without CUDA."""
    if not cuda_available():
        return False
    torch = torch_module()
    assert torch is not None
    torch.cuda.empty_cache()
    return True


def reserved_bytes() -> int | None:
    """Bytes the caching allocator holds on the device (what the lease is charged), or None."""
    if not cuda_available():
        return None
    torch = torch_module()
    assert torch is not None
    return int(torch.cuda.memory_reserved(torch.cuda.current_device()))


def allocated_bytes() -> int | None:
    """Bytes live tensors occupy on the device, or None."""
    if not cuda_available():
        return None
    torch = torch_module()
    assert torch is not None
    return int(torch.cuda.memory_allocated(torch.cuda.current_device()))


def free_bytes() -> int | None:
    """Free device memory as the driver sees it, or None."""
    if not cuda_available():
        return None
    torch = torch_module()
    assert torch is not None
    free, _total = torch.cuda.mem_get_info(torch.cuda.current_device())
    return int(free)


def current_device() -> str:
    """Where restored GPU tensors go: the kernel's CUDA device, else the CPU."""
    if not cuda_available():
        return "cpu"
    torch = torch_module()
    assert torch is not None
    return f"cuda:{torch.cuda.current_device()}"


def cuda_rng_states() -> list[bytes] | None:
    """The CUDA generators' states, or None without CUDA (or before CUDA is initialised)."""
    torch = torch_module()
    if torch is None or not cuda_available() or not torch.cuda.is_initialized():
        # Reading the state would initialise CUDA; an uninitialised generator has its seed state.
        return None
    return [bytes(s.tolist()) for s in torch.cuda.get_rng_state_all()]


def set_cuda_rng_states(states: list[bytes]) -> bool:
    """Restore CUDA generator states saved by :func:`cuda_rng_states`; False without CUDA."""
    torch = torch_module()
    if torch is None or not cuda_available():
        return False
    tensors = [torch.tensor(list(s), dtype=torch.uint8) for s in states]
    count = min(len(tensors), torch.cuda.device_count())
    for index in range(count):
        torch.cuda.set_rng_state(tensors[index], index)
    return True


def oom_exception_types() -> tuple[type[BaseException], ...]:
    """Exception classes PyTorch raises when the allocator runs out (empty before torch loads)."""
    return _exception_types(("OutOfMemoryError",))


def gpu_error_types() -> tuple[type[BaseException], ...]:
    """Exception classes that may carry a GPU memory failure: the allocator's, CUDA's own
    ("CUDA error: out of memory"), and the RuntimeErrors of cuBLAS, cuDNN and the like."""
    return (*_exception_types(("OutOfMemoryError", "AcceleratorError")), RuntimeError)


def _exception_types(names: tuple[str, ...]) -> tuple[type[BaseException], ...]:
    torch = torch_module()
    if torch is None:
        return ()
    types: list[type[BaseException]] = []
    pairs = [(owner, name) for name in names for owner in (torch, getattr(torch, "cuda", None))]
    for owner, name in pairs:
        cls = getattr(owner, name, None)
        if isinstance(cls, type) and issubclass(cls, BaseException) and cls not in types:
            types.append(cls)
    return tuple(types)
