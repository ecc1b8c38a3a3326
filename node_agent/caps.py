"""Memory caps for GPU frameworks, set in the environment of what runs under a lease."""

from __future__ import annotations

# What caps GPU memory in frameworks other than PyTorch (capped by the kernel hook), set from
# the lease: JAX allocates as it goes up to a fraction, CuPy's pool has a byte limit,
# TensorFlow grows as it goes (the hook adds its limit), CUDA MPS pins a per-client limit.
FRAMEWORK_CAPS = (
    "XLA_PYTHON_CLIENT_PREALLOCATE",
    "XLA_PYTHON_CLIENT_MEM_FRACTION",
    "CUPY_GPU_MEMORY_LIMIT",
    "TF_FORCE_GPU_ALLOW_GROWTH",
    "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT",
)


def framework_caps(limit: int, context: int, total: int | None, devices: int) -> dict[str, str]:
    """Each framework's cap at the lease's limit: its allocator gets the limit less the CUDA
    context, which the share counts (MPS limits the whole client, context included)."""
    allocator = max(0, limit - context)
    caps = {
        "XLA_PYTHON_CLIENT_PREALLOCATE": "false",
        "CUPY_GPU_MEMORY_LIMIT": str(allocator),
        "TF_FORCE_GPU_ALLOW_GROWTH": "true",
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": ",".join(
            f"{index}={max(1, limit // 2**20)}M" for index in range(devices)),
    }
    if total:
        caps["XLA_PYTHON_CLIENT_MEM_FRACTION"] = f"{min(1.0, allocator / total):.4f}"
    return caps
