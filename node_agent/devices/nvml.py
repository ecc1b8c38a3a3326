"""NvmlBackend: the node's real GPUs through nvidia-ml-py, initialised lazily."""

from __future__ import annotations

import contextlib
import ctypes
import importlib.metadata
import logging
import threading
from collections.abc import Callable
from pathlib import Path
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
    Sweep,
)

log = logging.getLogger(__name__)

T = TypeVar("T")

MIG_UNSUPPORTED = (
    "MIG mode is enabled on this GPU; gpufrac does not place fractional leases on MIG "
    "instances yet, so it is not offered (disable MIG with `nvidia-smi -mig 0` to use it)"
)

# 12.535.77 sized process records wrongly (the second process read as pid 2147483648);
# the next major may change the API under us.
SUPPORTED = ((12, 535, 108), (14,))
INSTALL = "pip install 'nvidia-ml-py>=12.535.108,<14'"

# What the agent calls; a module without them is not the nvidia-ml-py it was written for.
REQUIRED = (
    "NVMLError", "NVMLError_FunctionNotFound", "NVMLError_NotSupported", "NVMLError_GpuIsLost",
    "NVMLError_NoPermission", "NVMLLibraryMismatchError", "nvmlInit", "nvmlShutdown",
    "nvmlDeviceGetCount", "nvmlDeviceGetHandleByIndex", "nvmlDeviceGetUUID",
    "nvmlDeviceGetName", "nvmlDeviceGetMemoryInfo", "nvmlMemory_v2",
    "nvmlDeviceGetUtilizationRates", "nvmlDeviceGetMigMode", "NVML_DEVICE_MIG_ENABLE",
    "nvmlDeviceGetComputeRunningProcesses_v3", "nvmlDeviceGetComputeRunningProcesses_v2",
    "nvmlDeviceGetGraphicsRunningProcesses_v3", "nvmlDeviceGetGraphicsRunningProcesses_v2",
    "nvmlDeviceGetMPSComputeRunningProcesses_v3", "nvmlDeviceGetMPSComputeRunningProcesses_v2",
    "nvmlDeviceGetProcessUtilization", "NVMLError_NotFound",
)

# The C name of each kind of process list without a version suffix: the first record layout,
# which drivers before R460 have only.
PROCESS_KINDS = {
    "compute": "nvmlDeviceGetComputeRunningProcesses",
    "graphics": "nvmlDeviceGetGraphicsRunningProcesses",
    "mps": "nvmlDeviceGetMPSComputeRunningProcesses",
}


def _version_tuple(text: str) -> tuple[int, ...]:
    parts = []
    for part in text.split("."):
        digits = "".join(c for c in part if c.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


def load_pynvml() -> ModuleType:
    """nvidia-ml-py's ``pynvml``, checked: a supported version, and not shadowed.

    Raises BackendUnavailable saying what to install or remove.
    """
    try:
        dist = importlib.metadata.distribution("nvidia-ml-py")
    except importlib.metadata.PackageNotFoundError:
        raise BackendUnavailable(f"nvidia-ml-py is not installed: {INSTALL}") from None
    low, high = SUPPORTED
    if not low <= _version_tuple(dist.version) < high:
        raise BackendUnavailable(
            f"nvidia-ml-py {dist.version} is not supported (gpufrac needs 12.535.108 or later "
            f"and below 14): {INSTALL}")
    try:
        import pynvml
    except Exception as exc:  # a broken or foreign module must not take the agent down
        raise BackendUnavailable(f"the pynvml module cannot be imported ({exc}): {INSTALL}") \
            from exc
    # An old `pynvml` package (a folder) wins over nvidia-ml-py's pynvml.py beside it.
    expected = Path(str(dist.locate_file("pynvml.py"))).resolve()
    found = Path(getattr(pynvml, "__file__", "") or "?").resolve()
    missing = [name for name in REQUIRED if not hasattr(pynvml, name)]
    if found != expected or missing:
        raise BackendUnavailable(
            f"the pynvml module at {found} is not the one from nvidia-ml-py {dist.version} "
            f"({expected}); an old `pynvml` package shadows it: `pip uninstall pynvml`, "
            f"then {INSTALL}")
    return pynvml


class _ProcessInfoV1(ctypes.Structure):
    """The first process record (pid, bytes), which nvidia-ml-py no longer wraps."""

    _fields_ = [("pid", ctypes.c_uint), ("usedGpuMemory", ctypes.c_ulonglong)]


class NvmlBackend:
    """GPUs through NVML. ``nvml`` is the pynvml module (a test passes a fake one)."""

    name = "nvml"
    simulated = False

    def __init__(self, nvml: ModuleType | None = None) -> None:
        self._nvml: Any = nvml
        self._lock = threading.Lock()
        self._initialised = False
        self._handles: dict[str, Any] = {}
        # The last UUID and name seen at each index: a GPU that stops answering keeps them.
        self._known: dict[int, tuple[str, str]] = {}
        # Per kind of process list, the versions this driver has (probed on first use).
        self._versions: dict[str, list[int]] = {kind: [3, 2, 1] for kind in PROCESS_KINDS}
        self._unhealthy: set[str] = set()
        # Per GPU, the newest utilization sample read: the next read asks only for newer ones.
        self._sampled: dict[str, int] = {}

    def start(self) -> None:
        """Initialise NVML now; raises BackendUnavailable with what to do when it cannot."""
        with self._lock:
            self._init_locked()

    def gpus(self) -> list[GpuInfo]:
        with self._lock:
            self._init_locked()
            out = [self._describe(index)
                   for index in range(self._call(self._nvml.nvmlDeviceGetCount))]
            self._note_health(out)
            return out

    def processes(self, uuid: str) -> list[ProcessMemory]:
        """Compute, graphics and MPS client processes on ``uuid``; one entry per pid."""
        with self._lock:
            self._init_locked()
            handle = self._handle(uuid)
            used: dict[int, int | None] = {}
            for kind in PROCESS_KINDS:
                try:
                    listed = self._process_list(kind, handle)
                except NotSupported:
                    if kind == "compute":
                        raise
                    continue  # graphics and MPS lists are extras some boards do not keep
                for pid, nbytes in listed:
                    # A process in two lists reports its one footprint in each.
                    known = used.get(pid)
                    used[pid] = nbytes if known is None else max(known, nbytes or 0)
            return [ProcessMemory(pid, nbytes) for pid, nbytes in used.items()]

    def process_utilization(self, uuid: str) -> dict[int, int]:
        with self._lock:
            self._init_locked()
            handle = self._handle(uuid)
            samples = self._call(_samples_since, self._nvml, handle, self._sampled.get(uuid, 0))
            latest: dict[int, tuple[int, int]] = {}
            for sample in samples:
                stamp, pid = int(sample.timeStamp), int(sample.pid)
                if stamp >= latest.get(pid, (-1, 0))[0]:
                    latest[pid] = (stamp, min(100, int(sample.smUtil)))
            if latest:
                self._sampled[uuid] = max(stamp for stamp, _ in latest.values())
            return {pid: util for pid, (_, util) in latest.items()}

    def sweep(self) -> Sweep:
        gpus = self.gpus()
        processes: dict[str, dict[int, int | None]] = {}
        utilization: dict[str, dict[int, int]] = {}
        for gpu in gpus:
            if not gpu.healthy:
                continue
            try:
                processes[gpu.uuid] = {p.pid: p.used for p in self.processes(gpu.uuid)}
            except DeviceError as exc:
                log.debug("no process list for %s: %s", gpu.uuid, exc)
            try:
                utilization[gpu.uuid] = self.process_utilization(gpu.uuid)
            except DeviceError as exc:
                log.debug("no process utilization for %s: %s", gpu.uuid, exc)
        return Sweep(gpus, processes, utilization)

    def track(self, pid: int, uuid: str) -> None:
        """NVML sees processes by itself."""

    def untrack(self, pid: int) -> None:
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
        if self._nvml is None:
            self._nvml = load_pynvml()
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
        name = getattr(fn, "__name__", "nvml")
        try:
            return fn(*args, **kwargs)
        except nvml.NVMLError_NotSupported as exc:
            raise NotSupported(f"{name}: not supported on this device") from exc
        except (nvml.NVMLError_FunctionNotFound, nvml.NVMLLibraryMismatchError) as exc:
            raise _Missing(f"{name}: this driver does not have it") from exc
        except nvml.NVMLError_GpuIsLost as exc:
            raise GpuLost(f"{name}: GPU is lost; check `nvidia-smi` and dmesg") from exc
        except nvml.NVMLError_NoPermission as exc:
            raise NoPermission(f"{name}: no permission; run the agent as root") from exc
        except nvml.NVMLError as exc:
            raise DeviceError(f"{name}: {exc}") from exc

    def _handle(self, uuid: str) -> Any:
        handle = self._handles.get(uuid)
        if handle is None:
            for index in range(self._call(self._nvml.nvmlDeviceGetCount)):
                with contextlib.suppress(DeviceError):  # one bad GPU hides no other
                    h = self._call(self._nvml.nvmlDeviceGetHandleByIndex, index)
                    self._handles[_text(self._call(self._nvml.nvmlDeviceGetUUID, h))] = h
            handle = self._handles.get(uuid)
        if handle is None:
            raise GpuLost(f"no GPU {uuid} on this node")
        return handle

    def _process_list(self, kind: str, handle: Any) -> list[tuple[int, int | None]]:
        """(pid, bytes or None) from the newest version of the ``kind`` list this driver has."""
        nvml = self._nvml
        versions = self._versions[kind]
        while versions:
            version = versions[0]
            try:
                if version == 1:
                    procs = self._call(processes_v1, nvml, PROCESS_KINDS[kind], handle)
                else:
                    fn = getattr(nvml, f"{PROCESS_KINDS[kind]}_v{version}", None)
                    if fn is None:  # a pynvml stand-in that leaves it out
                        raise _Missing(f"{PROCESS_KINDS[kind]}_v{version}")
                    procs = self._call(fn, handle)
            except _Missing:
                versions.pop(0)
                log.debug("NVML: %s processes: no v%d in this driver", kind, version)
                continue
            # usedGpuMemory is None where the driver withholds it (e.g. in some containers).
            return [(int(p.pid), _known_bytes(p.usedGpuMemory)) for p in procs]
        raise NotSupported(f"this driver lists no {kind} processes")

    def _describe(self, index: int) -> GpuInfo:
        """GPU ``index``; any error of its own makes it unhealthy, never the whole node."""
        nvml = self._nvml
        uuid, name = self._known.get(index, (f"GPU-unreadable-index-{index}", "unknown GPU"))
        try:
            handle = self._call(nvml.nvmlDeviceGetHandleByIndex, index)
            uuid = _text(self._call(nvml.nvmlDeviceGetUUID, handle))
            name = _text(self._call(nvml.nvmlDeviceGetName, handle))
            self._known[index] = (uuid, name)
            self._handles[uuid] = handle
            return self._measure(index, uuid, name, handle)
        except DeviceError as exc:
            return GpuInfo(uuid, index, name, 0, 0, 0, healthy=False, error=str(exc))

    def _measure(self, index: int, uuid: str, name: str, handle: Any) -> GpuInfo:
        nvml = self._nvml
        try:
            # v1 counts the driver's reserve as used; v2 says it apart.
            mem = self._call(nvml.nvmlDeviceGetMemoryInfo, handle, version=nvml.nvmlMemory_v2)
            reserved = int(getattr(mem, "reserved", 0))
        except (NotSupported, _Missing):
            mem = self._call(nvml.nvmlDeviceGetMemoryInfo, handle)
            reserved = 0
        try:
            utilization: int | None = int(
                self._call(nvml.nvmlDeviceGetUtilizationRates, handle).gpu
            )
        except (NotSupported, NoPermission, _Missing):
            utilization = None
        error = MIG_UNSUPPORTED if self._mig_enabled(handle) else None
        return GpuInfo(
            uuid, index, name, int(mem.total), int(mem.used), int(mem.free), reserved,
            utilization, healthy=error is None, error=error,
        )

    def _mig_enabled(self, handle: Any) -> bool:
        try:
            current, _pending = self._call(self._nvml.nvmlDeviceGetMigMode, handle)
        except (NotSupported, _Missing):
            return False
        return bool(current == self._nvml.NVML_DEVICE_MIG_ENABLE)

    def _note_health(self, gpus: list[GpuInfo]) -> None:
        """Log each GPU once when it turns unhealthy and once when it comes back."""
        now = {g.uuid for g in gpus if not g.healthy}
        for gpu in gpus:
            if gpu.uuid in now - self._unhealthy:
                log.warning("GPU %d (%s) is unhealthy: %s", gpu.index, gpu.uuid, gpu.error)
            elif gpu.uuid in self._unhealthy - now:
                log.warning("GPU %d (%s) answers again", gpu.index, gpu.uuid)
        self._unhealthy = now


class _Missing(NotSupported):
    """The driver lacks the function: an older generation than nvidia-ml-py's."""


def _samples_since(nvml: Any, handle: Any, since: int) -> list[Any]:
    """Per-process utilization samples newer than ``since`` (µs); none is not an error."""
    try:
        return list(nvml.nvmlDeviceGetProcessUtilization(handle, since))
    except nvml.NVMLError_NotFound:
        return []


def processes_v1(nvml: Any, symbol: str, handle: Any) -> list[_ProcessInfoV1]:
    """The first-generation process list, through nvidia-ml-py's loaded library."""
    lookup = getattr(nvml, "_nvmlGetFunctionPointer", None)
    if lookup is None:  # a pynvml stand-in with no C library behind it
        raise nvml.NVMLError_FunctionNotFound()
    fn = lookup(symbol)
    count = ctypes.c_uint(0)
    records: Any = None
    # Ask the count, then fill; with room for processes started in between.
    for _attempt in range(3):
        ret = fn(handle, ctypes.byref(count), records)
        if ret == nvml.NVML_SUCCESS:
            return [] if records is None else list(records[: count.value])
        if ret != nvml.NVML_ERROR_INSUFFICIENT_SIZE:
            raise nvml.NVMLError(ret)
        count.value = count.value * 2 + 5
        records = (_ProcessInfoV1 * count.value)()
    raise nvml.NVMLError(nvml.NVML_ERROR_INSUFFICIENT_SIZE)


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _known_bytes(value: Any) -> int | None:
    # nvidia-ml-py turns NVML_VALUE_NOT_AVAILABLE into None; the v1 records keep the raw value.
    return None if value is None or int(value) == 2**64 - 1 else int(value)
