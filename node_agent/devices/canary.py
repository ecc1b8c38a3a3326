"""The canary: a tiny CUDA process of the agent's own, frozen and thawed once to prove freezing works."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys

# What the canary holds on its GPU, and the pattern it writes there and reads back after a thaw.
CANARY_BYTES = 64 * 2**20
PATTERN = bytes(range(256)) * 16


class CudaError(RuntimeError):
    """A CUDA call of this process failed; the message names the call and the CUresult."""

    def __init__(self, call: str, code: int, name: str) -> None:
        super().__init__(f"{call} failed with {name}")
        self.call, self.code, self.name = call, code, name


class CudaProcess:
    """This process's own CUDA, through libcuda with ctypes: a context on the first GPU it may
    see (CUDA_VISIBLE_DEVICES), device memory, and host functions queued as GPU work."""

    def __init__(self, library: str = "libcuda.so.1") -> None:
        self.lib = ctypes.CDLL(library)
        self._call("cuInit", ctypes.c_uint(0))
        device = ctypes.c_int(0)
        self._call("cuDeviceGet", ctypes.byref(device), ctypes.c_int(0))
        uuid = (ctypes.c_ubyte * 16)()
        self._call("cuDeviceGetUuid", ctypes.byref(uuid), device)
        text = bytes(uuid).hex()
        self.uuid = f"GPU-{text[:8]}-{text[8:12]}-{text[12:16]}-{text[16:20]}-{text[20:]}"
        self.context = ctypes.c_void_p()
        self._call("cuDevicePrimaryCtxRetain", ctypes.byref(self.context), device)
        self._call("cuCtxSetCurrent", self.context)

    def alloc(self, nbytes: int) -> int:
        ptr = ctypes.c_ulonglong(0)
        self._call("cuMemAlloc_v2", ctypes.byref(ptr), ctypes.c_size_t(nbytes))
        return ptr.value

    def free(self, ptr: int) -> None:
        self._call("cuMemFree_v2", ctypes.c_ulonglong(ptr))

    def write(self, ptr: int, data: bytes) -> None:
        self._call("cuMemcpyHtoD_v2", ctypes.c_ulonglong(ptr), data, ctypes.c_size_t(len(data)))

    def read(self, ptr: int, nbytes: int) -> bytes:
        out = ctypes.create_string_buffer(nbytes)
        self._call("cuMemcpyDtoH_v2", out, ctypes.c_ulonglong(ptr), ctypes.c_size_t(nbytes))
        return out.raw

    def synchronize(self) -> None:
        self._call("cuCtxSynchronize")

    def _call(self, name: str, *args: object) -> None:
        code = getattr(self.lib, name)(*args)
        if code != 0:
            text = ctypes.c_char_p()
            known = self.lib.cuGetErrorName(ctypes.c_int(code), ctypes.byref(text)) == 0
            raise CudaError(name, code, text.value.decode() if known and text.value
                            else f"CUresult {code}")


def spawn(uuid: str, library: str = "libcuda.so.1") -> subprocess.Popen[str]:
    """The canary on GPU ``uuid``: it answers ``ready <uuid>`` once it holds its memory (or
    ``error <why>``), then ``ok``/``bad`` to each ``check`` of that memory; it ends with its
    stdin."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": uuid}
    return subprocess.Popen([sys.executable, "-m", "node_agent.devices.canary", library],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)


def main() -> int:
    try:
        cuda = CudaProcess(*sys.argv[1:2])
        ptr = cuda.alloc(CANARY_BYTES)
        pattern = PATTERN * (CANARY_BYTES // len(PATTERN))
        cuda.write(ptr, pattern)
        cuda.synchronize()
    except (OSError, CudaError) as exc:
        print(f"error {exc}", flush=True)
        return 1
    print(f"ready {cuda.uuid}", flush=True)
    for line in sys.stdin:
        if line.strip() == "check":
            # Blocks while frozen, as any CUDA call of a frozen process does.
            print("ok" if cuda.read(ptr, CANARY_BYTES) == pattern else "bad", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
