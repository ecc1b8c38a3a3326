"""Builds the C stand-in for libcuda.so.1, scripts and reads the state it shares, runs its programs."""

from __future__ import annotations

import fcntl
import os
import shutil
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from queue import Empty, Queue
from typing import Any

from harness.agent import ROOT, ChildProcess

SOURCE = Path(__file__).with_name("fake_cuda.c")
TARGET = Path(__file__).with_name("target.py")
MiB = 2**20

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
    subprocess.run([gcc, "-O1", "-Wall", "-Wextra", "-Werror", "-shared", "-fPIC", "-pthread",
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


@dataclass(frozen=True)
class Record:
    """What a CUDA process of the stand-in wrote of itself (its ``proc-<pid>`` file)."""

    start: int
    state: str
    gpu: str  # "-" before it has a context
    device: int
    context: int
    copy: int  # bytes its last checkpoint copied into its own memory
    wedged: bool  # a restore ran out of memory: no later one works


@dataclass
class FakeCuda:
    """The folder FAKE_CUDA_STATE names: the node's GPUs, the processes' records, scripted
    failures and hangs, the call log."""

    root: Path

    def __post_init__(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        self.root.chmod(0o1777)  # targets of other users write their records here

    def env(self, library: Path, *, resident: bool = False) -> dict[str, str]:
        """What a process needs to load ``library``'s libcuda.so.1 acting on this folder;
        ``resident``: device memory counts as resident memory (what a simulated node sees)."""
        return {"LD_LIBRARY_PATH": str(library), "FAKE_CUDA_STATE": str(self.root),
                "FAKE_CUDA_RESIDENT": "1" if resident else "0"}

    def gpus(self, gpus: Sequence[tuple[str, int, int]], name: str = "NVIDIA H100 80GB HBM3") -> None:
        """The GPUs the kernel-mode driver sees: (uuid, total bytes, context bytes) each."""
        with self._locked():
            (self.root / "gpus").write_text("".join(f"{u} {t} {c} {name}\n" for u, t, c in gpus))

    def fill(self, uuid: str, nbytes: int) -> None:
        """Something the agent does not see holds ``nbytes`` on ``uuid`` (0: nothing)."""
        with self._locked():
            (self.root / "fill").write_text(f"{uuid} {nbytes}\n")

    def persistence(self, on: bool) -> None:
        with self._locked():
            (self.root / "persistence").write_text("on\n" if on else "off\n")

    def hang(self, function: str, *, pid: int | None = None) -> None:
        """Make ``function`` block (before it acts) until :meth:`clear_script`."""
        self._append(f"hang {FUNCTIONS.get(function, function)} {'*' if pid is None else pid}")

    def crash(self, function: str, *, pid: int | None = None) -> None:
        """The target dies as ``function`` comes to it."""
        self._append(f"crash {FUNCTIONS.get(function, function)} {'*' if pid is None else pid}")

    def rate(self, bytes_per_second: int) -> None:
        """Checkpoints and restores copy at this speed."""
        self._append(f"rate {bytes_per_second}")

    def record(self, pid: int) -> Record | None:
        """What process ``pid`` wrote of itself (None: it never initialised CUDA here)."""
        with self._locked():
            path = self.root / f"proc-{pid}"
            text = path.read_text().split() if path.exists() else []
        if len(text) != 7:
            return None
        return Record(int(text[0]), text[1], text[2], int(text[3]), int(text[4]), int(text[5]),
                      text[6] == "1")

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
        """The pid's checkpoint state as its record says."""
        record = self.record(pid)
        assert record is not None, f"process {pid} never initialised CUDA"
        return record.state

    def set_state(self, pid: int, state: str) -> None:
        """Put process ``pid`` in ``state``, as a driver failure would leave it."""
        assert state in STATES, state
        with socket.socket(socket.AF_UNIX) as sock:
            sock.settimeout(10)
            sock.connect(str(self.root / f"sock-{pid}"))
            sock.sendall(f"set {state}\n".encode())
            assert sock.recv(32).strip() == b"0"

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


class Target(ChildProcess):
    """A small CUDA program (target.py) on the stand-in or a real driver: it holds device and
    host memory, queues work, and answers one line per command. A command sent while it is
    frozen is answered once it is thawed: :meth:`send` then :meth:`answer`."""

    def __init__(self, env: dict[str, str], *, cuda: bool = True, prefix: Sequence[str] = (),
                 preexec: Any = None, user: int | None = None) -> None:
        """``prefix``: a command it runs under (``unshare --pid --fork``); ``preexec``: run in
        the child before it starts (joining a cgroup); ``user``: the uid it runs as."""
        self.proc = subprocess.Popen(
            [*prefix, sys.executable, str(TARGET), *([] if cuda else ["--no-cuda"])],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT), **env}, preexec_fn=preexec, user=user)
        self._lines: Queue[str] = Queue()
        threading.Thread(target=self._read, daemon=True).start()
        ready = self.answer(30)
        assert ready.startswith("ready "), ready
        self.uuid, pid = ready.split()[1:3]
        self.pid = int(pid)  # its own (under a prefix, not the prefix command's)

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line.strip())
        self._lines.put("")  # it ended

    def send(self, command: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()

    def answer(self, timeout: float = 10.0) -> str:
        """The next line it says; TimeoutError when none comes within ``timeout`` s."""
        try:
            return self._lines.get(timeout=timeout)
        except Empty:
            raise TimeoutError(f"process {self.pid} said nothing within {timeout:g} s") from None

    def ask(self, command: str, timeout: float = 10.0) -> str:
        self.send(command)
        return self.answer(timeout)

    def hold(self, mib: int) -> None:
        """Hold ``mib`` more MiB of device memory (as the simulated node's Holder does)."""
        assert self.ask(f"alloc {mib}") == "ok"
