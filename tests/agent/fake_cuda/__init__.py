"""Builds the C stand-in for libcuda.so.1 and scripts and reads the per-pid state it shares."""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

SOURCE = Path(__file__).with_name("fake_cuda.c")

# Driver generations: what each exports and accepts (see fake_cuda.c).
VARIANTS = {
    "r550": ["-DDRIVER_VERSION=12040"],
    "r570": ["-DDRIVER_VERSION=12080", "-DCHECKPOINT_API"],
    "r580": ["-DDRIVER_VERSION=13000", "-DCHECKPOINT_API", "-DREMAP"],
}
CUDA_VERSION = {"r550": 12040, "r570": 12080, "r580": 13000}

# The CUresult values the stand-in names (cuda.h).
RESULTS = {
    "CUDA_SUCCESS": 0, "CUDA_ERROR_INVALID_VALUE": 1, "CUDA_ERROR_OUT_OF_MEMORY": 2,
    "CUDA_ERROR_NOT_INITIALIZED": 3, "CUDA_ERROR_STUB_LIBRARY": 34, "CUDA_ERROR_NO_DEVICE": 100,
    "CUDA_ERROR_OPERATING_SYSTEM": 304, "CUDA_ERROR_ILLEGAL_STATE": 401,
    "CUDA_ERROR_NOT_READY": 600, "CUDA_ERROR_NOT_PERMITTED": 800, "CUDA_ERROR_NOT_SUPPORTED": 801,
    "CUDA_ERROR_TIMEOUT": 909, "CUDA_ERROR_UNKNOWN": 999,
}
STATES = ("running", "locked", "checkpointed", "failed", "checkpointing", "restoring")
# Short names a test may use for the calls.
FUNCTIONS = {
    "init": "cuInit", "state": "cuCheckpointProcessGetState", "lock": "cuCheckpointProcessLock",
    "checkpoint": "cuCheckpointProcessCheckpoint", "restore": "cuCheckpointProcessRestore",
    "unlock": "cuCheckpointProcessUnlock",
}


def build(variant: str, into: Path) -> Path:
    """Compile the ``variant`` library into ``into``/libcuda.so.1; the folder is returned."""
    gcc = shutil.which("gcc")
    assert gcc, "gcc is needed to build the fake libcuda.so.1"
    into.mkdir(parents=True, exist_ok=True)
    subprocess.run([gcc, "-O1", "-Wall", "-Wextra", "-Werror", "-shared", "-fPIC",
                    *VARIANTS[variant], "-o", str(into / "libcuda.so.1"), str(SOURCE)], check=True)
    return into


@dataclass(frozen=True)
class Call:
    """One line of the stand-in's call log."""

    function: str
    pid: int | None  # None for cuInit
    args: str  # "-" for NULL args; "timeoutMs=2000"; "gpuPairs=GPU-a>GPU-b,..."
    result: str  # the CUresult's name

    @property
    def short(self) -> str:
        """"lock", "checkpoint", ...: the function without its prefix."""
        return {v: k for k, v in FUNCTIONS.items()}.get(self.function, self.function)


@dataclass
class FakeCuda:
    """The folder FAKE_CUDA_STATE names: per-pid states, scripted failures, the call log."""

    root: Path

    def __post_init__(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)

    def env(self, library: Path) -> dict[str, str]:
        """What a process needs to load ``library``'s libcuda.so.1 acting on this folder."""
        return {"LD_LIBRARY_PATH": str(library), "FAKE_CUDA_STATE": str(self.root)}

    def fail(self, function: str, result: str | int, *, pid: int | None = None,
             once: bool = True, leaves: str | None = None) -> None:
        """Make ``function`` ("lock" or "cuCheckpointProcessLock", ...) return ``result`` (a
        CUresult name or number) for ``pid`` (None: every pid), the next time only or always;
        ``leaves``: the state the pid is left in (default: unchanged)."""
        code = RESULTS[result] if isinstance(result, str) else result
        assert leaves is None or leaves in STATES, leaves
        line = (f"fail {FUNCTIONS.get(function, function)} {'*' if pid is None else pid} {code} "
                f"{'once' if once else 'always'}{'' if leaves is None else ' ' + leaves}")
        self._append(line)

    def delay(self, function: str, seconds: float, *, pid: int | None = None) -> None:
        """Make every ``function`` call for ``pid`` (None: every pid) take ``seconds`` longer."""
        self._append(f"delay {FUNCTIONS.get(function, function)} "
                     f"{'*' if pid is None else pid} {round(seconds * 1000)}")

    def clear_script(self) -> None:
        with self._locked():
            (self.root / "script").unlink(missing_ok=True)

    def state(self, pid: int) -> str:
        """The pid's state as the stand-in keeps it ("running" until a call changes it)."""
        with self._locked():
            path = self.root / f"state-{pid}"
            return path.read_text().strip() if path.exists() else "running"

    def set_state(self, pid: int, state: str) -> None:
        assert state in STATES, state
        with self._locked():
            (self.root / f"state-{pid}").write_text(state + "\n")

    def calls(self, pid: int | None = None) -> list[Call]:
        """Every call logged so far, oldest first; only those for ``pid`` when given."""
        with self._locked():
            path = self.root / "calls"
            lines = path.read_text().splitlines() if path.exists() else []
        out = []
        for line in lines:
            function, who, args, result = line.split("\t")
            call = Call(function, None if who == "-" else int(who), args, result)
            if pid is None or call.pid == pid:
                out.append(call)
        return out

    def clear_calls(self) -> None:
        with self._locked():
            (self.root / "calls").unlink(missing_ok=True)

    def _append(self, line: str) -> None:
        with self._locked(), (self.root / "script").open("a") as f:
            f.write(line + "\n")

    @contextmanager
    def _locked(self) -> Iterator[None]:
        """The lock the library takes for every call: no torn reads or writes either side."""
        fd = os.open(self.root / "lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)
