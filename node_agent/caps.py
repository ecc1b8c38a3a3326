"""Memory caps for GPU frameworks, set in the environment of what runs under a lease."""

from __future__ import annotations

import math
import os
import stat

# What caps GPU memory in frameworks other than PyTorch (capped by the kernel hook), set from
# the lease: JAX allocates as it goes up to a fraction, CuPy's pool has a byte limit,
# TensorFlow grows as it goes (the hook adds its limit), CUDA MPS pins a per-client limit.
FRAMEWORK_CAPS = (
    "XLA_PYTHON_CLIENT_PREALLOCATE",
    "XLA_PYTHON_CLIENT_MEM_FRACTION",
    "CUPY_GPU_MEMORY_LIMIT",
    "TF_FORCE_GPU_ALLOW_GROWTH",
    "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT",
    "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE",
)


def framework_caps(limit: int, context: int, total: int | None, devices: int,
                   compute_limit: float | None = None) -> dict[str, str]:
    """Each framework's cap at the lease's limit: its allocator gets the limit less the CUDA
    context, which the share counts (MPS limits the whole client, context included). A compute
    limit becomes MPS's active-thread percentage (read by CUDA only where MPS runs)."""
    allocator = max(0, limit - context)
    caps = {
        "XLA_PYTHON_CLIENT_PREALLOCATE": "false",
        "CUPY_GPU_MEMORY_LIMIT": str(allocator),
        "TF_FORCE_GPU_ALLOW_GROWTH": "true",
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": ",".join(
            f"{index}={max(1, limit // 2**20)}M" for index in range(devices)),
    }
    if compute_limit is not None:
        caps["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(max(1, math.ceil(compute_limit * 100)))
    if total:
        caps["XLA_PYTHON_CLIENT_MEM_FRACTION"] = f"{min(1.0, allocator / total):.4f}"
    return caps


def mps_running(uid: int | None = None) -> bool:
    """Whether a CUDA MPS control daemon serves this machine (``uid`` None), or the processes of
    user ``uid``: its pipe directory and control pipe belong to root (a system daemon) or to
    that user, nobody else may write into the directory, and nvidia-cuda-mps-control runs as
    their owner. A path any user can create decides nothing: MPS serves only its own user's
    clients, so one user's daemon (or a fake directory) never turns freezing off for others."""
    folder = os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps")
    try:
        where = os.lstat(folder)
        control = os.lstat(os.path.join(folder, "control"))
    except OSError:
        return False
    owners = {0} if uid is None else {0, uid}
    if (not stat.S_ISDIR(where.st_mode) or where.st_uid not in owners
            or where.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
            or not (stat.S_ISFIFO(control.st_mode) or stat.S_ISSOCK(control.st_mode))
            or control.st_uid != where.st_uid):
        return False
    return _daemon_runs(where.st_uid)


def _daemon_runs(uid: int) -> bool:
    """Whether nvidia-cuda-mps-control runs as ``uid`` (its name is cut to 15 characters)."""
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/comm") as f:
                if f.read().strip() != "nvidia-cuda-mps":
                    continue
            if os.stat(f"/proc/{entry.name}").st_uid == uid:
                return True
        except OSError:
            continue
    return False
