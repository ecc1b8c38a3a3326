"""GPU backends: NVML for real nodes, a simulated node for everywhere else."""

from __future__ import annotations

from node_agent.devices.base import (
    BackendUnavailable,
    DeviceError,
    GpuBackend,
    GpuInfo,
    GpuLost,
    NoPermission,
    NotSupported,
    ProcessMemory,
    Sweep,
)
from node_agent.devices.cuda import DriverFreezer
from node_agent.devices.nvml import NvmlBackend
from node_agent.devices.simulated import SimulatedBackend

__all__ = [
    "BackendUnavailable",
    "DeviceError",
    "DriverFreezer",
    "GpuBackend",
    "GpuInfo",
    "GpuLost",
    "NoPermission",
    "NotSupported",
    "NvmlBackend",
    "ProcessMemory",
    "SimulatedBackend",
    "Sweep",
    "open_backend",
]


def open_backend(simulate: str | None = None, fallback_simulate: str | None = None) -> GpuBackend:
    """The backend for ``serve``: a simulated node when asked, else NVML, else the fallback.

    Raises BackendUnavailable (with what to do) when NVML cannot start and no fallback is given.
    """
    if simulate:
        return SimulatedBackend(simulate)
    nvml = NvmlBackend()
    try:
        nvml.start()
    except BackendUnavailable:
        if fallback_simulate:
            return SimulatedBackend(fallback_simulate)
        raise
    return nvml
