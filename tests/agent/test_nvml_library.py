"""The NVML backend through nvidia-ml-py's real ctypes path, against a libnvidia-ml.so.1 built
from C here: three driver generations, lost and refused GPUs, MIG, every kind of process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from harness.agent import ROOT, AgentProcess, wait_for
from node_agent.devices.nvml import MIG_UNSUPPORTED

from .fake_nvml import DRIVER, VARIANTS, FakeNode, Gpu, Proc, Sample, build

MiB, GiB = 2**20, 2**30
UUIDS = [f"GPU-5ca1ab1e-0000-4000-8000-00000000000{i}" for i in range(5)]

# Runs NvmlBackend in a fresh process (the library is found through LD_LIBRARY_PATH, as on a
# node). Each argument is a node file to put in place before one look at every GPU.
LOOK = """
import json, shutil, sys
from node_agent.devices import DeviceError, NvmlBackend
backend = NvmlBackend()
looks = []
for node in sys.argv[2:]:
    shutil.copy(node, sys.argv[1])
    gpus = backend.gpus()
    procs = {}
    for gpu in gpus:
        try:
            procs[gpu.uuid] = sorted([p.pid, p.used] for p in backend.processes(gpu.uuid))
        except DeviceError as exc:
            procs[gpu.uuid] = f"{type(exc).__name__}: {exc}"
    utilization = {}
    for gpu in gpus:
        try:
            utilization[gpu.uuid] = backend.process_utilization(gpu.uuid)
        except DeviceError as exc:
            utilization[gpu.uuid] = f"{type(exc).__name__}: {exc}"
    looks.append({"gpus": [g.to_json() for g in gpus], "procs": procs,
                  "versions": backend._versions, "utilization": utilization})
backend.close()
print(json.dumps(looks))
"""


@pytest.fixture(scope="module")
def libraries(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One fake libnvidia-ml.so.1 per driver generation."""
    root = tmp_path_factory.mktemp("libnvml")
    return {variant: build(variant, root / variant) for variant in VARIANTS}


@pytest.fixture
def look(tmp_path: Path, libraries: dict[str, Path]) -> Callable[..., list[dict[str, Any]]]:
    """Each node in turn as NvmlBackend sees it through ``variant``'s library."""

    def run(variant: str, *nodes: FakeNode) -> list[dict[str, Any]]:
        live = FakeNode(tmp_path / "node")
        for i, node in enumerate(nodes):
            node.path, node.driver = tmp_path / f"node-{i}", DRIVER[variant]
            node.write()
        done = subprocess.run(
            [sys.executable, "-c", LOOK, str(live.path), *(str(n.path) for n in nodes)],
            capture_output=True, text=True, timeout=60, cwd=ROOT,
            env={**os.environ, **live.env(libraries[variant])})
        assert done.returncode == 0, done.stderr
        looks: list[dict[str, Any]] = json.loads(done.stdout)
        return looks

    return run


def busy_node() -> FakeNode:
    """Two H100s; every kind of process on the first, one of them in two lists."""
    node = FakeNode(Path("unused"))
    node.gpus = [Gpu(UUIDS[0], 80 * GiB, reserved=528 * MiB, used=10 * MiB, utilization=30),
                 Gpu(UUIDS[1], 80 * GiB, reserved=528 * MiB)]
    node.procs = [
        Proc(0, "compute", 4101, 1 * GiB),
        Proc(0, "compute", 4102, 2 * GiB),  # the record nvidia-ml-py 12.535.77 misread
        Proc(0, "compute", 4105, None),  # the driver will not say
        Proc(0, "graphics", 4103, 256 * MiB),
        Proc(0, "graphics", 4101, 1 * GiB),
        Proc(0, "mps", 4104, 512 * MiB),
    ]
    return node


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_every_driver_generation_lists_every_process_once(
    variant: str, look: Callable[..., list[dict[str, Any]]]
) -> None:
    [seen] = look(variant, busy_node())
    gpu0 = seen["gpus"][0]
    procs = dict(map(tuple, seen["procs"][UUIDS[0]]))
    expected = {4101: GiB, 4102: 2 * GiB, 4105: None, 4103: 256 * MiB, 4104: 512 * MiB}
    process_bytes = (1 + 2) * GiB + 256 * MiB + 512 * MiB
    if variant == "r418":
        del expected[4104]  # no MPS list before R470
    assert procs == expected
    assert seen["procs"][UUIDS[1]] == []
    assert gpu0["uuid"] == UUIDS[0] and gpu0["healthy"] and gpu0["utilization"] == 30
    assert gpu0["memory_total"] == 80 * GiB
    if variant == "r550":
        # Memory v2 tells the driver's reserve apart: usable = total - reserved.
        assert gpu0["memory_reserved"] == 528 * MiB
        assert gpu0["memory_used"] == 10 * MiB + process_bytes
    else:
        # v1 only: the reserve is part of "used", and nothing is counted twice.
        assert gpu0["memory_reserved"] == 0
        assert gpu0["memory_used"] == 10 * MiB + process_bytes + 528 * MiB
    assert gpu0["memory_free"] == 80 * GiB - 528 * MiB - 10 * MiB - process_bytes
    # The newest record each driver has was found once and kept.
    newest = {"r550": [3, 2, 1], "r470": [2, 1], "r418": [1]}[variant]
    assert seen["versions"] == {"compute": newest, "graphics": newest,
                                "mps": [] if variant == "r418" else newest}


def test_a_failing_gpu_is_unhealthy_and_the_others_serve(
    look: Callable[..., list[dict[str, Any]]]
) -> None:
    healthy = FakeNode(Path("unused"))
    healthy.gpus = [Gpu(uuid, 80 * GiB, reserved=528 * MiB) for uuid in UUIDS]
    healthy.procs = [Proc(0, "compute", 4200, GiB), Proc(2, "compute", 4201, GiB)]
    broken = FakeNode(Path("unused"), procs=list(healthy.procs))
    broken.gpus = [Gpu(UUIDS[0], 80 * GiB, reserved=528 * MiB),
                   Gpu(UUIDS[1], 80 * GiB, state="nohandle"),
                   Gpu(UUIDS[2], 80 * GiB, state="lost"),
                   Gpu(UUIDS[3], 80 * GiB, state="noperm"),
                   Gpu(UUIDS[4], 80 * GiB, mig=True)]
    first, second = look("r550", healthy, broken)
    assert [g["healthy"] for g in first["gpus"]] == [True] * 5
    gpus = second["gpus"]
    assert [g["index"] for g in gpus] == [0, 1, 2, 3, 4]
    # Seen before, a GPU that stops answering keeps its UUID: its leases still point at it.
    assert [g["uuid"] for g in gpus] == UUIDS
    assert gpus[0]["healthy"] and dict(map(tuple, second["procs"][UUIDS[0]])) == {4200: GiB}
    assert not gpus[1]["healthy"] and "lost" in gpus[1]["error"]
    assert not gpus[2]["healthy"] and "lost" in gpus[2]["error"]
    assert second["procs"][UUIDS[2]].startswith("GpuLost")
    assert not gpus[3]["healthy"] and "permission" in gpus[3]["error"]
    assert not gpus[4]["healthy"] and gpus[4]["error"] == MIG_UNSUPPORTED


def test_a_gpu_that_never_answered_is_named_by_its_index(
    look: Callable[..., list[dict[str, Any]]]
) -> None:
    node = FakeNode(Path("unused"))
    node.gpus = [Gpu(UUIDS[0], 80 * GiB, state="nohandle"), Gpu(UUIDS[1], 80 * GiB)]
    [seen] = look("r470", node)
    lost, fine = seen["gpus"]
    assert lost["uuid"] == "GPU-unreadable-index-0" and not lost["healthy"]
    assert fine["uuid"] == UUIDS[1] and fine["healthy"]


def test_the_agent_serves_a_node_whose_gpus_fail_and_come_back(
    tmp_path: Path, libraries: dict[str, Path]
) -> None:
    node = FakeNode(tmp_path / "node")
    node.gpus = [Gpu(UUIDS[0], 80 * GiB, reserved=528 * MiB, state="nohandle"),
                 Gpu(UUIDS[1], 80 * GiB, reserved=528 * MiB)]
    node.write()
    holder = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                              stdin=subprocess.PIPE)
    agent = AgentProcess(tmp_path / "agent", None, ["--poll-interval", "0.05"],
                         env=node.env(libraries["r418"]))
    try:
        with agent:
            c = agent.client()
            gpus = c.node()["gpus"]
            assert [g["healthy"] for g in gpus] == [False, True] and "lost" in gpus[0]["error"]
            lease = c.create_lease(client="nvml-test", request="2Gi", limit="4Gi")
            assert lease["physical_gpu"] == UUIDS[1]
            c.register_pid(lease["id"], holder.pid)
            node.procs = [Proc(1, "compute", holder.pid, 3 * GiB // 2)]
            node.write()
            wait_for(lambda: c.lease(lease["id"])["usage"] == 3 * GiB // 2, 30,
                     "the agent to read the kernel's memory through the v1 records")
            # The GPU under the lease is lost: the node keeps serving and says so.
            node.gpus[1].state = "lost"
            node.write()
            wait_for(lambda: not c.node()["gpus"][1]["healthy"], 30, "the loss to be shown")
            node.gpus[1].state = "ok"
            node.gpus[0].state = "ok"
            node.write()
            wait_for(lambda: all(g["healthy"] for g in c.node()["gpus"]), 30, "the GPUs back")
            assert c.lease(lease["id"])["state"] == "active"
        log = agent.log_text()
        assert f"GPU 1 ({UUIDS[1]}) is unhealthy" in log and f"GPU 1 ({UUIDS[1]}) answers again" in log
    finally:
        holder.kill()
        holder.wait()


def serve_with(tmp_path: Path, pythonpath: Path, library: Path) -> subprocess.CompletedProcess[str]:
    node = FakeNode(tmp_path / "node", gpus=[Gpu(UUIDS[0], 80 * GiB)])
    node.write()
    env = {**os.environ, **node.env(library), "PYTHONPATH": str(pythonpath)}
    return subprocess.run(
        [sys.executable, "-m", "node_agent", "serve", "--socket", str(tmp_path / "a.sock"),
         "--state-dir", str(tmp_path / "state")],
        capture_output=True, text=True, timeout=60, cwd=ROOT, env=env)


def test_an_unsupported_nvidia_ml_py_is_named_with_the_fix(
    tmp_path: Path, libraries: dict[str, Path]
) -> None:
    # What `pip install nvidia-ml-py==12.535.77` leaves: found before the project's own.
    site = tmp_path / "site"
    info = site / "nvidia_ml_py-12.535.77.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: nvidia-ml-py\nVersion: 12.535.77\n")
    done = serve_with(tmp_path, site, libraries["r550"])
    assert done.returncode == 2
    assert "nvidia-ml-py 12.535.77 is not supported" in done.stderr
    assert "pip install 'nvidia-ml-py>=12.535.108,<14'" in done.stderr


def test_a_legacy_pynvml_package_shadowing_nvidia_ml_py_is_named(
    tmp_path: Path, libraries: dict[str, Path]
) -> None:
    # pynvml<12 installs a package named pynvml, which wins over nvidia-ml-py's pynvml.py.
    legacy = tmp_path / "site" / "pynvml"
    legacy.mkdir(parents=True)
    (legacy / "__init__.py").write_text("from ctypes import *\nNVML_SUCCESS = 0\n"
                                        "def nvmlInit():\n    pass\n")
    done = serve_with(tmp_path, legacy.parent, libraries["r550"])
    assert done.returncode == 2
    assert "pip uninstall pynvml" in done.stderr and str(legacy) in done.stderr


def test_process_utilization_is_read_once_per_sample(
    look: Callable[..., list[dict[str, Any]]]
) -> None:
    """The newest sample of each process, then only newer ones: a second look at the same
    samples finds none (the driver's NOT_FOUND), and a GPU never sampled gives nothing."""
    node = busy_node()
    node.samples = [Sample(0, 4101, 10, 30), Sample(0, 4101, 20, 55), Sample(0, 4102, 15, 5)]
    first, second = look("r550", node, node)
    assert first["utilization"][UUIDS[0]] == {"4101": 55, "4102": 5}
    assert first["utilization"][UUIDS[1]] == {}
    assert second["utilization"][UUIDS[0]] == {}
