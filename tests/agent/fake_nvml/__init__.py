"""Builds the C stand-in for libnvidia-ml.so.1 and writes the node it answers for."""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

SOURCE = Path(__file__).with_name("fake_nvml.c")

# Driver generations: what each exports (see fake_nvml.c).
VARIANTS = {
    "r550": ["-DPROCESS_API=3", "-DMEMORY_V2", "-DMIG"],
    "r470": ["-DPROCESS_API=2", "-DMIG"],
    "r418": ["-DPROCESS_API=1"],
}
DRIVER = {"r550": "550.54.15", "r470": "470.256.02", "r418": "418.226.00"}


def build(variant: str, into: Path) -> Path:
    """Compile the ``variant`` library into ``into``/libnvidia-ml.so.1; the folder is returned."""
    gcc = shutil.which("gcc")
    assert gcc, "gcc is needed to build the fake libnvidia-ml.so.1"
    into.mkdir(parents=True, exist_ok=True)
    subprocess.run([gcc, "-O1", "-Wall", "-Werror", "-shared", "-fPIC", *VARIANTS[variant],
                    "-o", str(into / "libnvidia-ml.so.1"), str(SOURCE)], check=True)
    return into


@dataclass
class Gpu:
    uuid: str
    total: int
    reserved: int = 0
    used: int = 0  # besides the processes' memory
    utilization: int = -1
    mig: bool = False
    state: str = "ok"  # ok, lost, nohandle, noperm
    name: str = "NVIDIA H100 80GB HBM3"


@dataclass
class Proc:
    gpu: int
    kind: str  # compute, graphics, mps
    pid: int
    used: int | None


@dataclass
class Sample:
    gpu: int
    pid: int
    stamp: int  # µs
    sm: int  # SM utilization, percent


@dataclass
class FakeNode:
    """The node the library answers for, in the file FAKE_NVML_NODE names."""

    path: Path
    driver: str = DRIVER["r550"]
    gpus: list[Gpu] = field(default_factory=list)
    procs: list[Proc] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)

    def write(self) -> None:
        """Write atomically: the library re-reads the file on every call."""
        lines = [f"driver {self.driver}"]
        lines += [f"gpu {g.uuid} {g.total} {g.reserved} {g.used} {g.utilization} {int(g.mig)} "
                  f"{g.state} {g.name}" for g in self.gpus]
        lines += [f"proc {p.gpu} {p.kind} {p.pid} {-1 if p.used is None else p.used}"
                  for p in self.procs]
        lines += [f"sample {u.gpu} {u.pid} {u.stamp} {u.sm}" for u in self.samples]
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text("\n".join(lines) + "\n")
        os.replace(tmp, self.path)

    def env(self, library: Path) -> dict[str, str]:
        """What a process needs to load the library for this node."""
        return {"LD_LIBRARY_PATH": str(library), "FAKE_NVML_NODE": str(self.path)}
