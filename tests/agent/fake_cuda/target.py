"""A small CUDA program for the freeze tests, driven over stdin: it runs against the stand-in
libcuda.so.1 and against a real driver alike (libcuda through ctypes, as the agent's canary).

One command a line, one answer a line (``ok``, or the CUDA error; ``ready <uuid>`` first):
  alloc MIB    device memory, written with a pattern
  host MIB     host memory (a notebook's data in RAM), touched
  work MS      a host function queued as GPU work that runs MS milliseconds
  sync         waits for the queued work
  check        reads every allocation back: ok, or bad
  free         frees the device memory
Started with ``--no-cuda`` it never initialises CUDA (and answers ``ready -``).
"""

from __future__ import annotations

import ctypes
import sys
import time

from node_agent.devices.canary import PATTERN, CudaError, CudaProcess

MiB = 2**20
HOST_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


def main() -> int:
    if "--no-cuda" in sys.argv:
        print("ready -", flush=True)
        for _ in sys.stdin:
            print("ok", flush=True)
        return 0
    cuda = CudaProcess()
    cuda.lib.cuLaunchHostFunc.argtypes = [ctypes.c_void_p, HOST_FN, ctypes.c_void_p]
    held: list[tuple[int, bytes]] = []
    host: list[bytearray] = []
    callbacks: list[object] = []
    print(f"ready {cuda.uuid}", flush=True)
    for line in sys.stdin:
        word, _, arg = line.strip().partition(" ")
        try:
            if word == "alloc":
                data = PATTERN * (int(arg) * MiB // len(PATTERN))
                ptr = cuda.alloc(len(data))
                cuda.write(ptr, data)
                held.append((ptr, data))
            elif word == "host":
                block = bytearray(int(arg) * MiB)
                block[::4096] = b"x" * len(block[::4096])
                host.append(block)
            elif word == "work":
                callback = HOST_FN(lambda _, seconds=int(arg) / 1000: time.sleep(seconds))
                callbacks.append(callback)  # alive until it has run
                cuda._call("cuLaunchHostFunc", None, callback, None)
            elif word == "sync":
                cuda.synchronize()
            elif word == "check":
                good = all(cuda.read(ptr, len(data)) == data for ptr, data in held)
                print("ok" if good else "bad", flush=True)
                continue
            elif word == "free":
                for ptr, _ in held:
                    cuda.free(ptr)
                held.clear()
            print("ok", flush=True)
        except CudaError as exc:
            print(exc.name, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
