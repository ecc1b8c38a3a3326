"""A small CUDA program for the freeze tests, driven over stdin: it runs against the stand-in
libcuda.so.1 and against a real driver alike (libcuda through ctypes, as the agent's canary).

One command a line, one answer a line (``ok``, or the CUDA error; first ``ready <uuid> <pid>``,
its pid as the node numbers it, also from a PID namespace of its own):
  alloc MIB    device memory, its first page written with a pattern
  host MIB     host memory (a notebook's data in RAM), touched
  work MS      a host function queued as GPU work that runs MS milliseconds
  sync         waits for the queued work
  check        reads the first page of every allocation back: ok, or bad
  free         frees the device memory
Started with ``--no-cuda`` it never initialises CUDA (and says ``ready - <pid>``).
"""

from __future__ import annotations

import ctypes
import os
import sys
import time

from node_agent.devices.canary import PATTERN, CudaError, CudaProcess

MiB = 2**20
HOST_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


def node_pid() -> int:
    """This process's pid as the node numbers it (the first of NSpid)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("NSpid:"):
                return int(line.split()[1])
    return os.getpid()


def worked(seconds: float) -> None:
    time.sleep(seconds)
    print("worked", flush=True)


def main() -> int:
    if "--no-cuda" in sys.argv:
        print(f"ready - {node_pid()}", flush=True)
        for _ in sys.stdin:
            print("ok", flush=True)
        return 0
    cuda = CudaProcess()
    cuda.lib.cuLaunchHostFunc.argtypes = [ctypes.c_void_p, HOST_FN, ctypes.c_void_p]
    held: list[tuple[int, bytes]] = []
    host: list[bytearray] = []
    callbacks: list[object] = []
    print(f"ready {cuda.uuid} {node_pid()}", flush=True)
    for line in sys.stdin:
        word, _, arg = line.strip().partition(" ")
        try:
            if word == "alloc":
                # One page written: the rest is untouched device memory, which the stand-in
                # does not make resident (the driver's is on the GPU, not in host memory).
                ptr = cuda.alloc(int(arg) * MiB)
                cuda.write(ptr, PATTERN)
                held.append((ptr, PATTERN))
            elif word == "host":
                block = bytearray(int(arg) * MiB)
                block[::4096] = b"x" * len(block[::4096])
                host.append(block)
            elif word == "work":
                # It says "worked" when it has run (a lock waits for it).
                callback = HOST_FN(lambda _, seconds=int(arg) / 1000: worked(seconds))
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
