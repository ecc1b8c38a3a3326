"""A pynvml stand-in built on the simulated node; raises nvidia-ml-py's own exception classes."""

from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Any

import pynvml as real

from node_agent.devices import SimulatedBackend


@dataclass
class _Handle:
    index: int


@dataclass
class _Process:
    pid: int
    usedGpuMemory: int | None
    gpuInstanceId: int = 0xFFFFFFFF
    computeInstanceId: int = 0xFFFFFFFF


class FakeNvml(types.ModuleType):
    """Answers like nvidia-ml-py on a node described by a SimulatedBackend.

    Knobs: ``no_library`` (no driver), ``mig`` (indexes in MIG mode), ``hide_usage`` (the
    driver withholds per-process memory), ``no_process_list`` (no process list in this driver),
    ``no_utilization`` (utilization unsupported).
    """

    def __init__(self, sim: SimulatedBackend, **knobs: Any) -> None:
        super().__init__("pynvml")
        self.sim = sim
        self.no_library = knobs.get("no_library", False)
        self.mig: set[int] = set(knobs.get("mig", ()))
        self.hide_usage = knobs.get("hide_usage", False)
        self.no_process_list = knobs.get("no_process_list", False)
        self.no_utilization = knobs.get("no_utilization", False)
        self.init_calls = 0
        self._initialised = False
        for name in dir(real):
            if name.startswith("NVML") or name == "nvmlMemory_v2":
                setattr(self, name, getattr(real, name))

    def _check(self) -> None:
        if not self._initialised:
            raise real.NVMLError_Uninitialized()

    def _gpu(self, handle: _Handle) -> Any:
        self._check()
        gpu = self.sim.gpus()[handle.index]
        if not gpu.healthy:
            raise real.NVMLError_GpuIsLost()
        return gpu

    def nvmlInit(self) -> None:
        self.init_calls += 1
        if self.no_library:
            raise real.NVMLError_LibraryNotFound()
        self._initialised = True

    def nvmlShutdown(self) -> None:
        self._check()
        self._initialised = False

    def nvmlDeviceGetCount(self) -> int:
        self._check()
        return len(self.sim.gpus())

    def nvmlDeviceGetHandleByIndex(self, index: int) -> _Handle:
        self._check()
        if not 0 <= index < len(self.sim.gpus()):
            raise real.NVMLError_InvalidArgument()
        return _Handle(index)

    def nvmlDeviceGetUUID(self, handle: _Handle) -> str:
        self._check()
        return self.sim.gpus()[handle.index].uuid

    def nvmlDeviceGetName(self, handle: _Handle) -> str:
        self._check()
        return self.sim.gpus()[handle.index].name

    def nvmlDeviceGetMemoryInfo(self, handle: _Handle, version: int | None = None) -> Any:
        gpu = self._gpu(handle)
        fields = {"total": gpu.memory_total, "free": gpu.memory_free, "used": gpu.memory_used}
        if version == real.nvmlMemory_v2:
            fields["reserved"] = 0
            fields["version"] = version
        return types.SimpleNamespace(**fields)

    def nvmlDeviceGetComputeRunningProcesses_v3(self, handle: _Handle) -> list[_Process]:
        gpu = self._gpu(handle)
        if self.no_process_list:
            raise real.NVMLError_FunctionNotFound()
        from node_agent.devices import GpuLost, NotSupported

        try:
            procs = self.sim.processes(gpu.uuid)
        except GpuLost:
            raise real.NVMLError_GpuIsLost() from None
        except NotSupported:
            raise real.NVMLError_NotSupported() from None
        return [_Process(p.pid, None if self.hide_usage else p.used) for p in procs]

    def nvmlDeviceGetUtilizationRates(self, handle: _Handle) -> Any:
        gpu = self._gpu(handle)
        if self.no_utilization or gpu.utilization is None:
            raise real.NVMLError_NotSupported()
        return types.SimpleNamespace(gpu=gpu.utilization, memory=0)

    def nvmlDeviceGetMigMode(self, handle: _Handle) -> list[int]:
        self._gpu(handle)
        mode = real.NVML_DEVICE_MIG_ENABLE if handle.index in self.mig else real.NVML_DEVICE_MIG_DISABLE
        return [mode, mode]

    def nvmlDeviceGetProcessUtilization(self, handle: _Handle, since: int) -> list[Any]:
        self._gpu(handle)
        raise real.NVMLError_NotSupported()
