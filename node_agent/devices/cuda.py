"""DriverFreezer: freezes a process's GPU state through libcuda's cuCheckpointProcess* API (ctypes)."""

from __future__ import annotations

import ctypes
import logging
import math
import os
import re
import threading
import time
from collections.abc import Mapping
from typing import Any

from node_agent.devices.base import (
    CHECKPOINTED,
    FAILED,
    GONE,
    ILLEGAL_STATE,
    LOCKED,
    NO_CUDA,
    NOT_PERMITTED,
    NOT_SUPPORTED,
    OS_ERROR,
    OTHER,
    OUT_OF_MEMORY,
    RUNNING,
    TIMEOUT,
    FreezeError,
)

log = logging.getLogger(__name__)

# CUresult values used here (cuda.h, CUDA 13.0).
CUDA_SUCCESS = 0
CUDA_ERROR_INVALID_VALUE = 1
CUDA_ERROR_OUT_OF_MEMORY = 2
CUDA_ERROR_NOT_INITIALIZED = 3
CUDA_ERROR_OPERATING_SYSTEM = 304
CUDA_ERROR_ILLEGAL_STATE = 401
CUDA_ERROR_NOT_READY = 600
CUDA_ERROR_NOT_PERMITTED = 800
CUDA_ERROR_NOT_SUPPORTED = 801
CUDA_ERROR_TIMEOUT = 909

# The API came into libcuda with r570 / CUDA 12.8; CUcheckpointRestoreArgs.gpuPairs with r580 /
# CUDA 13.0 (12.8's restore args were reserved bytes only, which must be zero).
CHECKPOINT_API_VERSION = 12080
REMAP_VERSION = 13000

CHECKPOINT_SYMBOLS = (
    "cuCheckpointProcessLock", "cuCheckpointProcessCheckpoint", "cuCheckpointProcessRestore",
    "cuCheckpointProcessUnlock", "cuCheckpointProcessGetState",
)

# CUprocessState. 4 (checkpointing) and 5 (restoring), from newer drivers, are transitions
# out of or back into LOCKED: the process's CUDA calls block as when locked, so the agent sees
# LOCKED and keeps the Freezer protocol's four states.
STATES = {0: RUNNING, 1: LOCKED, 2: CHECKPOINTED, 3: FAILED, 4: LOCKED, 5: LOCKED}

UUID = re.compile(r"^GPU-([0-9a-f]{8})-([0-9a-f]{4})-([0-9a-f]{4})-([0-9a-f]{4})-([0-9a-f]{12})$",
                  re.IGNORECASE)


class CUuuid(ctypes.Structure):
    # Unsigned bytes, not c_char: a c_char array stops at the first zero byte.
    _fields_ = [("bytes", ctypes.c_ubyte * 16)]


class CUcheckpointLockArgs(ctypes.Structure):
    _fields_ = [("timeoutMs", ctypes.c_uint), ("reserved0", ctypes.c_uint),
                ("reserved1", ctypes.c_uint64 * 7)]


class CUcheckpointGpuPair(ctypes.Structure):
    _fields_ = [("oldUuid", CUuuid), ("newUuid", CUuuid)]


class CUcheckpointRestoreArgs(ctypes.Structure):
    _fields_ = [("gpuPairs", ctypes.POINTER(CUcheckpointGpuPair)), ("gpuPairsCount", ctypes.c_uint),
                ("reserved", ctypes.c_char * (52 - ctypes.sizeof(ctypes.c_void_p))),
                ("reserved1", ctypes.c_uint64)]


class CUcheckpointCheckpointArgs(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_uint64 * 8)]


class CUcheckpointUnlockArgs(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_uint64 * 8)]


def cuda_version_text(version: int) -> str:
    """cuDriverGetVersion's number as people write it: 12080 -> "12.8"."""
    return f"{version // 1000}.{version % 1000 // 10}"


def parse_uuid(text: str) -> CUuuid:
    """A CUuuid from NVML's "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx"; FreezeError if malformed."""
    match = UUID.match(text)
    if not match:
        raise FreezeError(f"{text!r} is not a GPU UUID (GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx); "
                          "MIG instances cannot be remapped")
    return CUuuid((ctypes.c_ubyte * 16)(*bytes.fromhex("".join(match.groups()))))


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: it exists
        return True
    return True


class _Driver:
    """libcuda loaded and initialised: its version and the checkpoint calls, if any."""

    def __init__(self, lib: ctypes.CDLL, version: int) -> None:
        self.lib = lib
        self.version = version
        self.missing = [name for name in CHECKPOINT_SYMBOLS if not hasattr(lib, name)]
        if not self.missing:
            for name in CHECKPOINT_SYMBOLS:
                fn = getattr(lib, name)
                fn.restype = ctypes.c_int
                fn.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_int)] \
                    if name == "cuCheckpointProcessGetState" else [ctypes.c_int, ctypes.c_void_p]

    def result_name(self, code: int) -> str:
        """CUDA_ERROR_X: what it means, from the driver; the number where it will not say."""
        name, text = self._string("cuGetErrorName", code), self._string("cuGetErrorString", code)
        name = name or f"CUresult {code}"
        return f"{name}: {text}" if text else name

    def _string(self, symbol: str, code: int) -> str | None:
        fn = getattr(self.lib, symbol, None)
        if fn is None:
            return None
        out = ctypes.c_char_p()
        if fn(ctypes.c_int(code), ctypes.byref(out)) != CUDA_SUCCESS or not out.value:
            return None
        return out.value.decode(errors="replace")


class DriverFreezer:
    """The Freezer of a real node: the driver moves a process's GPU memory and context into its
    own host memory (checkpoint) and back (restore). ``library`` is found as the dynamic linker
    finds it (LD_LIBRARY_PATH, then the system's paths), or is a path."""

    name = "cuda-driver"
    needs_proof = True

    def __init__(self, library: str = "libcuda.so.1") -> None:
        self._library = library
        # Guards initialisation only: driver calls for different pids run concurrently.
        self._lock = threading.Lock()
        self._lib: ctypes.CDLL | None = None
        self._driver: _Driver | None = None
        self._reason: str | None = None  # why not, once known for good

    # --- Freezer ---------------------------------------------------------------------
    def unavailable(self) -> str | None:
        with self._lock:
            return self._init_locked()

    def can_remap(self) -> bool:
        driver = self._usable_or_none()
        return driver is not None and driver.version >= REMAP_VERSION

    def state(self, pid: int) -> str:
        driver = self._usable()
        out = ctypes.c_int(-1)
        self._call(driver, "cuCheckpointProcessGetState", pid, ctypes.byref(out))
        state = STATES.get(out.value)
        if state is None:
            raise FreezeError(f"cuCheckpointProcessGetState({pid}): the driver reports state "
                              f"{out.value}, which this agent does not know")
        return state

    def lock(self, pid: int, *, timeout: float) -> None:
        driver = self._usable()
        args = CUcheckpointLockArgs(timeoutMs=_milliseconds(timeout))
        started = time.monotonic()
        self._call(driver, "cuCheckpointProcessLock", pid, ctypes.byref(args), timeout=timeout)
        log.debug("locked pid %s in %.3fs", pid, time.monotonic() - started)

    def checkpoint(self, pid: int) -> None:
        driver = self._usable()
        started = time.monotonic()
        self._call(driver, "cuCheckpointProcessCheckpoint", pid, None)
        log.info("checkpointed pid %s in %.3fs", pid, time.monotonic() - started)

    def restore(self, pid: int, pairs: Mapping[str, str] | None = None) -> None:
        driver = self._usable()
        args: CUcheckpointRestoreArgs | None = None
        # Identity pairs are no remap: left out, the driver restores where the process was (an
        # identity remap has been reported to fail under CUDA_VISIBLE_DEVICES).
        if pairs and any(old.lower() != new.lower() for old, new in pairs.items()):
            if driver.version < REMAP_VERSION:
                raise FreezeError(
                    f"pid {pid} cannot be restored onto other GPUs: the NVIDIA driver (CUDA "
                    f"{cuda_version_text(driver.version)}) restores onto the same GPUs only; "
                    "remapping needs r580 / CUDA 13.0")
            if {o.lower() for o in pairs} != {n.lower() for n in pairs.values()}:
                raise FreezeError(f"the GPU pairs for pid {pid} are not a permutation of the "
                                  "node's GPUs, which the driver needs (cuda-checkpoint#35)")
            # The args keep the array alive (ctypes holds it in their _objects).
            array = (CUcheckpointGpuPair * len(pairs))(
                *(CUcheckpointGpuPair(parse_uuid(old), parse_uuid(new))
                  for old, new in pairs.items()))
            args = CUcheckpointRestoreArgs(
                gpuPairs=ctypes.cast(array, ctypes.POINTER(CUcheckpointGpuPair)),
                gpuPairsCount=len(pairs))
        started = time.monotonic()
        self._call(driver, "cuCheckpointProcessRestore", pid,
                   None if args is None else ctypes.byref(args))
        log.info("restored pid %s%s in %.3fs", pid, " onto other GPUs" if args else "",
                 time.monotonic() - started)

    def unlock(self, pid: int) -> None:
        self._call(self._usable(), "cuCheckpointProcessUnlock", pid, None)

    # --- helpers -----------------------------------------------------------------------
    def _usable_or_none(self) -> _Driver | None:
        with self._lock:
            self._init_locked()
            return self._driver if self._driver is not None and not self._driver.missing else None

    def _usable(self) -> _Driver:
        with self._lock:
            reason = self._init_locked()
            if reason is not None or self._driver is None:
                raise FreezeError(f"no process can be frozen on this node: {reason}",
                                  kind=NOT_SUPPORTED)
            return self._driver

    def _init_locked(self) -> str | None:
        """None once the checkpoint API is usable, else why not (a missing library or too old
        a driver for good; a failed cuInit is tried again on the next call)."""
        if self._reason is not None:
            return self._reason
        if self._driver is not None:
            return None
        if self._lib is None:
            try:
                self._lib = ctypes.CDLL(self._library)
            except OSError as exc:
                self._reason = (f"libcuda cannot be loaded ({exc}): the NVIDIA driver is not "
                                "installed on this node")
                return self._reason
            if not (hasattr(self._lib, "cuInit") and hasattr(self._lib, "cuDriverGetVersion")):
                self._reason = f"{self._library} is not the CUDA driver library (no cuInit)"
                return self._reason
            self._lib.cuInit.argtypes = [ctypes.c_uint]
            self._lib.cuDriverGetVersion.argtypes = [ctypes.POINTER(ctypes.c_int)]
        lib = self._lib
        probe = _Driver(lib, 0)
        ret = lib.cuInit(0)
        if ret != CUDA_SUCCESS:
            reason = (f"cuInit failed ({probe.result_name(ret)}); check the driver with "
                      "`nvidia-smi`")
            log.warning("CUDA driver: %s", reason)
            return reason
        version = ctypes.c_int(0)
        ret = lib.cuDriverGetVersion(ctypes.byref(version))
        if ret != CUDA_SUCCESS:
            return f"cuDriverGetVersion failed ({probe.result_name(ret)})"
        driver = _Driver(lib, version.value)
        if driver.missing:
            self._reason = (
                f"the NVIDIA driver (CUDA {cuda_version_text(driver.version)}) predates the "
                f"checkpoint API: it lacks {', '.join(driver.missing)}, which needs driver r570 "
                "/ CUDA 12.8 or newer")
            return self._reason
        self._driver = driver
        log.info("CUDA driver %s: processes can be frozen%s", cuda_version_text(driver.version),
                 " and thawed onto other GPUs" if driver.version >= REMAP_VERSION else "")
        return None

    def _call(self, driver: _Driver, symbol: str, pid: int, *args: Any,
              timeout: float | None = None) -> None:
        """The one place a CUresult becomes a FreezeError that says what happened."""
        ret = getattr(driver.lib, symbol)(pid, *args)
        if ret == CUDA_SUCCESS:
            return
        what = f"{symbol}({pid}) failed with {driver.result_name(ret)}"
        kind = OTHER
        if not _exists(pid):
            kind, advice = GONE, "the process no longer exists"
        # cuda.h lists NOT_READY among the lock's results: read as the timeout's other name.
        elif symbol == "cuCheckpointProcessLock" and ret in (CUDA_ERROR_TIMEOUT,
                                                              CUDA_ERROR_NOT_READY):
            kind = TIMEOUT
            advice = (f"its submitted GPU work did not finish within {timeout}s; it runs on "
                      "unlocked, and a later try may succeed")
        elif ret == CUDA_ERROR_NOT_INITIALIZED:
            # What cuda-checkpoint says of a process without CUDA ("initialization error").
            kind, advice = NO_CUDA, "the process has not initialised CUDA: none of it is on a GPU"
        elif ret == CUDA_ERROR_NOT_SUPPORTED:
            kind = NOT_SUPPORTED
            advice = ("the driver refuses to checkpoint this process: it uses something the "
                      "checkpoint API does not support (UVM/managed memory, CUDA IPC, MPS, MIG, "
                      "peer-to-peer between GPUs, multi-process NCCL)")
        elif ret == CUDA_ERROR_OUT_OF_MEMORY:
            kind = OUT_OF_MEMORY
            advice = ("the GPU has not enough free memory for it; after such a restore the "
                      "driver has refused every later one (cuda-checkpoint#44)")
        elif ret == CUDA_ERROR_ILLEGAL_STATE:
            kind, advice = ILLEGAL_STATE, "the process is not in the state this call needs"
        elif ret == CUDA_ERROR_INVALID_VALUE:
            advice = "the driver rejected the arguments"
        elif ret == CUDA_ERROR_NOT_PERMITTED:
            kind = NOT_PERMITTED
            advice = ("the driver refused the agent: as root this happens while persistence mode "
                      "is off (turn it on with `nvidia-smi -pm 1` or nvidia-persistenced; "
                      "cuda-checkpoint#25), and the agent and the process must share a PID "
                      "namespace")
        elif ret == CUDA_ERROR_OPERATING_SYSTEM:
            kind = OS_ERROR
            advice = ("an OS call failed: after a restore that ran out of memory this does not "
                      "pass (cuda-checkpoint#44); asked for a state, it has come from a "
                      "restricted container (cuda-checkpoint#37)")
        else:
            advice = "see the driver's message"
        raise FreezeError(f"{what}: {advice}", kind=kind)


def _milliseconds(seconds: float) -> int:
    """CUcheckpointLockArgs.timeoutMs: at least 1 (0 would mean no timeout), at most 2**32-1."""
    if math.isnan(seconds) or seconds <= 0:
        raise ValueError(f"lock_timeout must be positive seconds, not {seconds}")
    most = 2**32 - 1
    return most if seconds * 1000 >= most else max(1, math.ceil(seconds * 1000))
