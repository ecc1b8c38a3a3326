"""One conformance suite for every GpuBackend, plus what only NVML has to cope with."""

from __future__ import annotations

import ast
import inspect
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pynvml
import pytest

from harness.agent import wait_for
from node_agent import procs
from node_agent.devices import (
    BackendUnavailable,
    GpuBackend,
    GpuLost,
    NotSupported,
    NvmlBackend,
    SimulatedBackend,
    open_backend,
)
from node_agent.devices.nvml import MIG_UNSUPPORTED, PROCESS_KINDS, REQUIRED
from node_agent.devices.simulated import parse_spec
from node_agent.quantities import GiB, QuantityError

from .conftest import Holder
from .fake_pynvml import FakeNvml


def _real_nvml_works() -> bool:
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return False
    pynvml.nvmlShutdown()
    return True


BACKENDS = ["simulated", "nvml-on-fake"] + (["nvml"] if _real_nvml_works() else [])


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> Iterator[tuple[GpuBackend, SimulatedBackend | None]]:
    """(backend under test, the simulated node behind it or None on real hardware)."""
    sim = SimulatedBackend("2x1GiB")
    made: GpuBackend
    if request.param == "simulated":
        made = sim
    elif request.param == "nvml-on-fake":
        made = NvmlBackend(FakeNvml(sim))
    else:
        made, sim = NvmlBackend(), None  # type: ignore[assignment]
    yield made, sim
    made.close()


def test_conformance_gpus(backend: tuple[GpuBackend, SimulatedBackend | None]) -> None:
    b, _ = backend
    assert isinstance(b, GpuBackend)
    gpus = b.gpus()
    assert gpus, "a node has at least one GPU"
    assert [g.index for g in gpus] == sorted(g.index for g in gpus)
    assert len({g.uuid for g in gpus}) == len(gpus)
    for g in gpus:
        assert g.uuid.startswith(("GPU-", "MIG-"))
        assert g.memory_total > 0
        assert 0 <= g.memory_used <= g.memory_total
        assert g.memory_free <= g.memory_total
        assert g.healthy


def test_conformance_unknown_gpu(backend: tuple[GpuBackend, SimulatedBackend | None]) -> None:
    b, _ = backend
    with pytest.raises(GpuLost):
        b.processes("GPU-00000000-0000-0000-0000-00000000dead")


def test_conformance_process_memory_is_what_it_holds(
    backend: tuple[GpuBackend, SimulatedBackend | None], holders: Callable[..., Holder]
) -> None:
    b, sim = backend
    if sim is None:
        pytest.skip("real NVML: device memory cannot be allocated without CUDA here")
    uuid = b.gpus()[1].uuid
    h = holders()
    b.track(h.pid, uuid)
    sim.track(h.pid, uuid)  # the driver "sees" it: the fake reads the simulated node
    h.hold(64)
    procs = {p.pid: p.used for p in b.processes(uuid)}
    assert procs[h.pid] is not None and procs[h.pid] >= 60 * 2**20
    assert h.pid not in {p.pid for p in b.processes(b.gpus()[0].uuid)}
    assert b.gpus()[1].memory_used >= 60 * 2**20
    h.stop()
    wait_for(lambda: h.pid not in {p.pid for p in b.processes(uuid)}, what="dead process gone")


def test_a_simulated_context_is_charged_from_the_first_use_of_the_device(
    holders: Callable[..., Holder]
) -> None:
    """As NVML: a process placed on a GPU is not listed and costs nothing until it uses the
    device; from then on it pays its context, even once it holds nothing else."""
    sim = SimulatedBackend("1x4GiB:context=300Mi")
    uuid = sim.gpus()[0].uuid
    h = holders()
    sim.track(h.pid, uuid)
    assert sim.processes(uuid) == [] and sim.gpus()[0].memory_used == 0
    h.hold(64)
    [listed] = sim.processes(uuid)
    assert listed.pid == h.pid and listed.used is not None
    assert 300 * 2**20 + 60 * 2**20 <= listed.used < 300 * 2**20 + 80 * 2**20
    h.hold(0)  # freed at once: the blocks are mmapped
    [listed] = sim.processes(uuid)
    assert listed.pid == h.pid and listed.used is not None
    assert 300 * 2**20 <= listed.used < 300 * 2**20 + 16 * 2**20


def test_conformance_faults(backend: tuple[GpuBackend, SimulatedBackend | None]) -> None:
    b, sim = backend
    if sim is None:
        pytest.skip("faults are scripted on the simulated node only")
    lost, quirky = (g.uuid for g in sim.gpus())
    sim.set_fault(lost, "lost")
    sim.set_fault(quirky, "not_supported")
    gpus = {g.uuid: g for g in b.gpus()}
    assert not gpus[lost].healthy and gpus[lost].error
    assert gpus[quirky].healthy and gpus[quirky].utilization is None
    with pytest.raises(GpuLost):
        b.processes(lost)
    with pytest.raises(NotSupported):
        b.processes(quirky)
    sim.set_fault(lost, None)
    assert all(g.healthy for g in b.gpus())


def test_conformance_sweep_is_the_calls_in_one_pass(
    backend: tuple[GpuBackend, SimulatedBackend | None], holders: Callable[..., Holder]
) -> None:
    b, sim = backend
    swept = b.sweep()
    assert [g.uuid for g in swept.gpus] == [g.uuid for g in b.gpus()]
    if sim is None:
        return
    first, second = (g.uuid for g in swept.gpus)
    h = holders()
    b.track(h.pid, second)
    sim.track(h.pid, second)
    h.hold(64)
    swept = b.sweep()
    used = swept.processes[second][h.pid]
    assert used is not None and used >= 60 * 2**20
    assert h.pid not in swept.processes[first]
    assert set(swept.utilization) <= {first, second}
    assert swept.gpus[1].memory_used >= 60 * 2**20
    # A GPU that is lost, or does not list processes, has neither entry.
    sim.set_fault(first, "lost")
    sim.set_fault(second, "not_supported")
    swept = b.sweep()
    assert not swept.gpus[0].healthy
    assert swept.processes == {} and swept.utilization == {}


def test_a_simulated_sweep_reads_each_tracked_process_once(
    monkeypatch: pytest.MonkeyPatch, holders: Callable[..., Holder]
) -> None:
    sim = SimulatedBackend("2x1GiB")
    h = holders()
    sim.track(h.pid, sim.gpus()[0].uuid)
    reads: list[int] = []
    stat = procs.stat
    monkeypatch.setattr(procs, "stat", lambda pid: reads.append(pid) or stat(pid))
    for _ in range(3):
        sim.sweep()
    assert reads.count(h.pid) == 3


# Each line on stdin starts a child that, half a second on (it is seen by then), takes
# 32 MiB and keeps it until its stdin closes.
SPAWN = (
    "import subprocess, sys\n"
    "hold = ('import sys, time; time.sleep(0.5); b = bytearray(32 << 20); '\n"
    "        'b[::4096] = b\"x\" * len(b[::4096]); sys.stdin.read()')\n"
    "kids = []\n"
    "for line in sys.stdin:\n"
    "    kids.append(subprocess.Popen([sys.executable, '-c', hold], stdin=subprocess.PIPE))\n"
    "    print(kids[-1].pid, flush=True)\n"
)


def test_a_simulated_gpu_counts_what_a_tracked_process_started() -> None:
    """Children see their parent's GPU (CUDA_VISIBLE_DEVICES is inherited): those started
    before the parent was tracked, and those started after."""
    sim = SimulatedBackend("2x1GiB")
    uuid = sim.gpus()[1].uuid
    parent = subprocess.Popen([sys.executable, "-c", SPAWN], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    assert parent.stdin is not None and parent.stdout is not None

    def spawn() -> int:
        assert parent.stdin is not None and parent.stdout is not None
        parent.stdin.write("\n")
        parent.stdin.flush()
        return int(parent.stdout.readline())

    def holds(pid: int) -> bool:
        return (sim.sweep().processes[uuid].get(pid) or 0) >= 30 * 2**20

    try:
        before = spawn()
        sim.sweep()  # the node as it was: nothing of the parent is tracked yet
        sim.track(parent.pid, uuid)
        sim.sweep()
        after = spawn()
        sim.sweep()
        wait_for(lambda: holds(before) and holds(after), what="both children counted")
        assert before not in sim.sweep().processes[sim.gpus()[0].uuid]
    finally:
        parent.stdin.close()
        parent.wait()
        # Its children read their stdin to the end: they exit with it.


def test_nvml_is_lazy_and_explains_a_missing_driver() -> None:
    fake = FakeNvml(SimulatedBackend("1x1GiB"), no_library=True)
    backend = NvmlBackend(fake)
    assert fake.init_calls == 0, "constructing must not touch NVML"
    with pytest.raises(BackendUnavailable, match="--simulate"):
        backend.gpus()


def test_nvml_withheld_usage_and_no_process_list(holders: Callable[..., Holder]) -> None:
    sim = SimulatedBackend("1x1GiB")
    uuid = sim.gpus()[0].uuid
    h = holders()
    sim.track(h.pid, uuid)
    h.hold(8)
    hidden = NvmlBackend(FakeNvml(sim, hide_usage=True))
    assert [p.used for p in hidden.processes(uuid)] == [None]
    old = NvmlBackend(FakeNvml(sim, no_process_list=True))
    with pytest.raises(NotSupported, match="driver"):
        old.processes(uuid)


def test_nvml_mig_reported_as_unsupported() -> None:
    backend = NvmlBackend(FakeNvml(SimulatedBackend("2x1GiB"), mig={1}))
    gpus = backend.gpus()
    assert gpus[0].healthy
    assert not gpus[1].healthy and gpus[1].error == MIG_UNSUPPORTED


def test_open_backend_falls_back_to_simulation() -> None:
    if _real_nvml_works():
        pytest.skip("this machine has a GPU")
    with pytest.raises(BackendUnavailable, match="--simulate"):
        open_backend()
    assert open_backend(fallback_simulate="2x16GiB").simulated


def test_simulated_specs() -> None:
    assert parse_spec("2x16GiB") == [("GPU 16GiB (simulated)", 16 * GiB, 0, 0)] * 2
    boards = parse_spec("4xH100-80GB")
    # Named boards keep what the driver reserves and what a CUDA context takes.
    assert len(boards) == 4 and boards[0] == (
        "NVIDIA H100 80GB HBM3 (simulated)", 80 * GiB, 528 * 2**20, 500 * 2**20)
    tuned = parse_spec("1xH100-80GB:context=300Mi,1x8GiB:reserved=256Mi:context=200Mi")
    assert [(b.reserved, b.context) for b in tuned] == [
        (528 * 2**20, 300 * 2**20), (256 * 2**20, 200 * 2**20)]
    for bad in ("", "2x", "x16GiB", "0x16GiB", "2x0.5", "2xbanana", "1x8GiB:context",
                "1x8GiB:vram=1Gi", "1x8GiB:context=0.5", "1x1GiB:reserved=1Gi"):
        with pytest.raises(QuantityError, match="simulate"):
            parse_spec(bad)


def _pynvml_calls() -> list[tuple[str, int, set[str]]]:
    """(function, positional count, keyword names) for every pynvml call in node_agent."""
    source = Path(__file__).parents[2] / "node_agent" / "devices" / "nvml.py"
    calls = []
    for node in ast.walk(ast.parse(source.read_text())):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        args = node.args
        # self._call(nvml.nvmlX, *args, **kwargs) passes the function as the first argument.
        if isinstance(func, ast.Attribute) and func.attr == "_call" and args:
            func, args = args[0], args[1:]
        if isinstance(func, ast.Attribute) and func.attr.startswith("nvml"):
            calls.append((func.attr, len(args), {k.arg for k in node.keywords if k.arg}))
    return calls


def test_every_pynvml_call_exists_with_its_arguments() -> None:
    calls = _pynvml_calls()
    assert len({name for name, _, _ in calls}) >= 8, calls
    for name, npos, keywords in calls:
        fn = getattr(pynvml, name, None)
        assert fn is not None, f"pynvml.{name} does not exist in nvidia-ml-py {pynvml.__name__}"
        inspect.signature(fn).bind(*range(npos), **dict.fromkeys(keywords))
    # The names NvmlBackend looks up by version, and checks for when it loads pynvml.
    missing = [name for name in REQUIRED if not hasattr(pynvml, name)]
    assert not missing, f"nvidia-ml-py lacks {missing}"
    for symbol in PROCESS_KINDS.values():
        for version in (2, 3):
            inspect.signature(getattr(pynvml, f"{symbol}_v{version}")).bind("handle")
