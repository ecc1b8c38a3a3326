"""NvmlBackend: the node's real GPUs through nvidia-ml-py, initialised lazily."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from types import ModuleType
from typing import Any, TypeVar

from node_agent.devices.base import (
    BackendUnavailable,
    DeviceError,
    GpuInfo,
    GpuLost,
    NoPermission,
    NotSupported,
    ProcessMemory,
)

T = TypeVar("T")

MIG_UNSUPPORTED = (
    "MIG mode is enabled on this GPU; gpufrac does not place fractional leases on MIG "
    "instances yet, so it is not offered (disable MIG with `nvidia-smi -mig 0` to use it)"
)


class NvmlBackend:
    """GPUs through NVML. ``nvml`` is the pynvml module (a test passes a fake one)."""

    name = "nvml"
    simulated = False

    def __init__(self, nvml: ModuleType | None = None) -> None:
        if nvml is None:
            import pynvml

            nvml = pynvml
        self._nvml: Any = nvml
        self._lock = threading.Lock()
        self._initialised = False
        self._handles: dict[str, Any] = {}

    def start(self) -> None:
        """Initialise NVML now; raises BackendUnavailable with what to do when it cannot."""
        with self._lock:
            self._init_locked()

    def gpus(self) -> list[GpuInfo]:
        with self._lock:
            self._init_locked()
            out = []
            for index in range(self._call(self._nvml.nvmlDeviceGetCount)):
                out.append(self._describe(index))
            return out

    def processes(self, uuid: str) -> list[ProcessMemory]:
        with self._lock:
            self._init_locked()
            handle = self._handle(uuid)
            procs = self._call(self._nvml.nvmlDeviceGetComputeRunningProcesses, handle)
            # usedGpuMemory is None where the driver withholds it (e.g. in some containers).
            return [ProcessMemory(int(p.pid), _opt_int(p.usedGpuMemory)) for p in procs]

    def track(self, pid: int, uuid: str) -> None:
        """NVML sees processes by itself."""

    def close(self) -> None:
        with self._lock:
            if self._initialised:
                with contextlib.suppress(self._nvml.NVMLError):
                    self._nvml.nvmlShutdown()
                self._initialised = False
                self._handles.clear()

    # --- helpers -----------------------------------------------------------------
    def _init_locked(self) -> None:
        if self._initialised:
            return
        try:
            self._nvml.nvmlInit()
        except self._nvml.NVMLError as exc:
            raise BackendUnavailable(
                f"NVML could not start ({exc}); is the NVIDIA driver installed? "
                "Without a GPU, run the agent on a simulated node (--simulate 2x16GiB)"
            ) from exc
        self._initialised = True

    def _call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """The one place NVML errors become the project's own."""
        nvml = self._nvml
        try:
            return fn(*args, **kwargs)
        except nvml.NVMLError_NotSupported as exc:
            raise NotSupported(f"{fn.__name__}: not supported on this device") from exc
        except nvml.NVMLError_FunctionNotFound as exc:
            raise NotSupported(f"{fn.__name__}: this driver does not have it") from exc
        except nvml.NVMLError_GpuIsLost as exc:
            raise GpuLost(f"{fn.__name__}: GPU is lost; check `nvidia-smi` and dmesg") from exc
        except nvml.NVMLError_NoPermission as exc:
            raise NoPermission(f"{fn.__name__}: no permission; run the agent as root") from exc
        except nvml.NVMLError as exc:
            raise DeviceError(f"{fn.__name__}: {exc}") from exc

    def _handle(self, uuid: str) -> Any:
        handle = self._handles.get(uuid)
        if handle is None:
            for index in range(self._call(self._nvml.nvmlDeviceGetCount)):
                h = self._call(self._nvml.nvmlDeviceGetHandleByIndex, index)
                self._handles[_text(self._call(self._nvml.nvmlDeviceGetUUID, h))] = h
            handle = self._handles.get(uuid)
        if handle is None:
            raise GpuLost(f"no GPU {uuid} on this node")
        return handle

    def _describe(self, index: int) -> GpuInfo:
        nvml = self._nvml
        handle = self._call(nvml.nvmlDeviceGetHandleByIndex, index)
        uuid = _text(self._call(nvml.nvmlDeviceGetUUID, handle))
        self._handles[uuid] = handle
        name = _text(self._call(nvml.nvmlDeviceGetName, handle))
        try:
            # v1 gives wrong figures on newer drivers; v2 adds "reserved".
            mem = self._call(nvml.nvmlDeviceGetMemoryInfo, handle, version=nvml.nvmlMemory_v2)
            reserved = int(getattr(mem, "reserved", 0))
        except NotSupported:
            mem = self._call(nvml.nvmlDeviceGetMemoryInfo, handle)
            reserved = 0
        except GpuLost as exc:
            return GpuInfo(uuid, index, name, 0, 0, 0, healthy=False, error=str(exc))
        try:
            utilization: int | None = int(
                self._call(nvml.nvmlDeviceGetUtilizationRates, handle).gpu
            )
        except (NotSupported, NoPermission):
            utilization = None
        except GpuLost as exc:
            return GpuInfo(uuid, index, name, int(mem.total), 0, 0, healthy=False, error=str(exc))
        error = MIG_UNSUPPORTED if self._mig_enabled(handle) else None
        return GpuInfo(
            uuid, index, name, int(mem.total), int(mem.used), int(mem.free), reserved,
            utilization, healthy=error is None, error=error,
        )

    def _mig_enabled(self, handle: Any) -> bool:
        try:
            current, _pending = self._call(self._nvml.nvmlDeviceGetMigMode, handle)
        except DeviceError:
            return False
        return bool(current == self._nvml.NVML_DEVICE_MIG_ENABLE)


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _opt_int(value: Any) -> int | None:
    return None if value is None else int(value)
