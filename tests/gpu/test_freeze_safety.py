"""Freezing on a real GPU: each promise of the strict stand-in and of the agent, checked against
the driver itself, every figure written down. ``tests/gpu/run-freezing`` runs this (at most 5
minutes on one GPU) and then the freeze bench at 16 GiB; the remap check needs two GPUs.

The CUDA programs are tests/agent/fake_cuda/target.py, which calls libcuda through ctypes as
it does the stand-in; the agent is a real one on NVML with the driver's freezer. Each check
writes what it saw to $GPUFRAC_GPU_RESULTS/freeze_safety.jsonl (default gpu-results/) whether
it passes or not: what the driver did is the point, and the issue asks for every figure.
"""

from __future__ import annotations

import ctypes.util
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from agent.fake_cuda import Target
from memory_cgroups import memory_cgroup

from harness.agent import AgentProcess, nvml_memory_of, wait_for
from node_agent.devices.base import FreezeError, full_permutation
from node_agent.devices.cuda import DriverFreezer

pytestmark = pytest.mark.gpu

MiB, GiB = 2**20, 2**30
RESULTS = Path(os.environ.get("GPUFRAC_GPU_RESULTS", "gpu-results"))


def _probe() -> tuple[list[str], str | None]:
    """The GPUs' UUIDs, and why the driver cannot freeze (None: it can), asked in a fresh
    process so that no CUDA state enters pytest's own."""
    code = ("import json, pynvml\n"
            "from node_agent.devices.cuda import DriverFreezer\n"
            "pynvml.nvmlInit()\n"
            "uuids = [pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(i))\n"
            "         for i in range(pynvml.nvmlDeviceGetCount())]\n"
            "uuids = [u.decode() if isinstance(u, bytes) else u for u in uuids]\n"
            "print(json.dumps([uuids, DriverFreezer().unavailable() if uuids else None]))")
    try:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              timeout=120)
    except subprocess.TimeoutExpired:
        return [], None
    if done.returncode != 0:
        return [], None
    uuids, why = json.loads(done.stdout.strip().splitlines()[-1])
    return list(uuids), why


GPUS, CANNOT_FREEZE = _probe()
if not GPUS:
    pytest.skip("no CUDA GPU here (NVML lists none)", allow_module_level=True)
if CANNOT_FREEZE:
    pytest.skip(f"the driver cannot freeze processes: {CANNOT_FREEZE}", allow_module_level=True)


def record(check: str, **facts: Any) -> None:
    """One line of what a check saw, for the report."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    line = json.dumps({"check": check, "time": time.time(), **facts}, default=str)
    print(line, flush=True)
    with open(RESULTS / "freeze_safety.jsonl", "a") as f:
        f.write(line + "\n")


@pytest.fixture
def targets() -> Iterator[Callable[..., Target]]:
    made: list[Target] = []

    def start(gpu: str = GPUS[0], **kwargs: Any) -> Target:
        made.append(Target({"CUDA_VISIBLE_DEVICES": gpu}, **kwargs))
        return made[-1]

    yield start
    for t in made:
        if t.alive():
            t.proc.send_signal(signal.SIGCONT)
        t.stop()


def _timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    started = time.monotonic()
    try:
        return time.monotonic() - started, fn()
    except FreezeError as exc:
        return time.monotonic() - started, exc


def _outcome(value: Any) -> str:
    return f"{value.kind}: {value}" if isinstance(value, FreezeError) else repr(value)


def test_the_driver_s_answers_to_each_strict_rule(targets: Callable[..., Target]) -> None:
    """GetState on a process without CUDA; a lock timing out behind long work; the process's
    calls blocked while checkpointed; NVML no longer listing it; a SIGSTOPped target."""
    freezer = DriverFreezer()
    plain = targets(cuda=False)
    seconds, state = _timed(lambda: freezer.state(plain.pid))
    record("getstate_without_cuda", seconds=seconds, outcome=_outcome(state))
    assert isinstance(state, FreezeError)

    busy = targets()
    busy.hold(64)
    assert busy.ask("work 20000") == "ok"  # a stream callback of 20 s: the lock waits for it
    seconds, locked = _timed(lambda: freezer.lock(busy.pid, timeout=1.0))
    record("lock_behind_long_work", seconds=seconds, outcome=_outcome(locked),
           state_after=_outcome(_timed(lambda: freezer.state(busy.pid))[1]))
    assert isinstance(locked, FreezeError) and locked.kind == "timeout"
    assert freezer.state(busy.pid) == "running"

    kernel = targets()
    kernel.hold(256)
    held = nvml_memory_of(kernel.pid)
    lock_s, _ = _timed(lambda: freezer.lock(kernel.pid, timeout=10.0))
    checkpoint_s, _ = _timed(lambda: freezer.checkpoint(kernel.pid))
    left = nvml_memory_of(kernel.pid)
    kernel.send("check")
    blocked = True
    try:
        kernel.answer(1.0)
        blocked = False
    except TimeoutError:
        pass
    restore_s, _ = _timed(lambda: freezer.restore(kernel.pid))
    unlock_s, _ = _timed(lambda: freezer.unlock(kernel.pid))
    answer = kernel.answer(30)
    record("calls_blocked_while_checkpointed", nvml_before=held, nvml_checkpointed=left,
           blocked=blocked, answer_after_thaw=answer, lock_s=lock_s, checkpoint_s=checkpoint_s,
           restore_s=restore_s, unlock_s=unlock_s, nvml_after=nvml_memory_of(kernel.pid))
    assert blocked and answer == "ok" and left <= 64 * MiB < held

    stopped = targets()
    stopped.hold(64)
    stopped.proc.send_signal(signal.SIGSTOP)
    code = (f"from node_agent.devices.cuda import DriverFreezer\n"
            f"DriverFreezer().lock({stopped.pid}, timeout=5.0)\nprint('returned')")
    try:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              timeout=20)
        outcome = done.stdout.strip() or done.stderr.strip()[-300:]
    except subprocess.TimeoutExpired:
        outcome = "hung for 20 s"
    stopped.proc.send_signal(signal.SIGCONT)
    record("lock_on_a_sigstopped_target", outcome=outcome,
           state_after_sigcont=_outcome(_timed(lambda: freezer.state(stopped.pid))[1]))


def test_a_restore_into_a_full_gpu_as_the_driver_answers_it(targets: Callable[..., Target]) -> None:
    """cuda-checkpoint#44 on this driver: a restore out of memory, then one with room."""
    freezer = DriverFreezer()
    kernel = targets()
    kernel.hold(1024)
    freezer.lock(kernel.pid, timeout=10)
    freezer.checkpoint(kernel.pid)
    free = _free(GPUS[0])
    filler = targets()
    filler.hold(max(0, free // MiB - 512))
    _, first = _timed(lambda: freezer.restore(kernel.pid))
    state = _outcome(_timed(lambda: freezer.state(kernel.pid))[1])
    filler.stop()
    wait_for(lambda: _free(GPUS[0]) > free - 256 * MiB, 30, "the filler's memory back")
    _, second = _timed(lambda: freezer.restore(kernel.pid))
    _, unlock = _timed(lambda: freezer.unlock(kernel.pid))
    record("restore_without_room", first=_outcome(first), state_after_first=state,
           second_with_room=_outcome(second), unlock=_outcome(unlock),
           state_at_end=_outcome(_timed(lambda: freezer.state(kernel.pid))[1]))


def _free(uuid: str) -> int:
    import pynvml

    pynvml.nvmlInit()
    try:
        handle = pynvml.nvmlDeviceGetHandleByUUID(uuid)
        return int(pynvml.nvmlDeviceGetMemoryInfo(handle, version=pynvml.nvmlMemory_v2).free)
    finally:
        pynvml.nvmlShutdown()


@pytest.mark.skipif(len(GPUS) < 2, reason="remapping needs two GPUs")
def test_a_remap_of_a_kernel_restricted_by_cuda_visible_devices(
    targets: Callable[..., Target],
) -> None:
    """--freeze-remap stays off until this passes: full pairs, a kernel that sees one GPU."""
    freezer = DriverFreezer()
    kernel = targets(GPUS[0])
    kernel.hold(256)
    freezer.lock(kernel.pid, timeout=10)
    freezer.checkpoint(kernel.pid)
    pairs = full_permutation({GPUS[0]: GPUS[1]}, GPUS)
    seconds, restored = _timed(lambda: freezer.restore(kernel.pid, pairs))
    if not isinstance(restored, FreezeError):
        freezer.unlock(kernel.pid)
    record("remap_under_cuda_visible_devices", pairs=pairs, seconds=seconds,
           outcome=_outcome(restored), can_remap=freezer.can_remap(),
           answer=kernel.ask("check", 30) if not isinstance(restored, FreezeError) else None)


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[AgentProcess]:
    with AgentProcess(tmp_path / "agent", None, ["--poll-interval", "0.05"]) as running:
        freezing = wait_for(lambda: (f := running.client().node()["freezing"])["why"] is None
                            or "still checking" not in f["why"], 120, "the canary's verdict")
        record("canary", freezing=running.client().node()["freezing"], verdict=freezing)
        yield running


def test_the_agent_on_the_real_driver(agent: AgentProcess, targets: Callable[..., Target],
                                      tmp_path: Path) -> None:
    """The canary passed; a kernel in a memory cgroup below its GPU bytes is refused and lives;
    frozen_bytes against NVML under a fast poll; a thaw into a full GPU waits, no wedge."""
    c = agent.client()
    freezing = c.node()["freezing"]
    assert freezing["available"], freezing

    lease = c.create_lease(client="gpu-test", request="2Gi", limit="4Gi")
    with memory_cgroup(768 * MiB) as cgroup:
        boxed = targets(lease["physical_gpu"], preexec=cgroup.preexec)
        try:
            c.register_pid(lease["id"], boxed.pid)
            boxed.ask("host 300")
            boxed.hold(1024)
            wait_for(lambda: c.lease(lease["id"])["usage"] >= GiB, 30, "measured")
            try:
                c.freeze(lease["id"])
                refused = None
            except Exception as exc:
                refused = str(exc)
            record("memory_cgroup_below_gpu_bytes", refused=refused, alive=boxed.alive())
            assert refused and "memory limit" in refused and boxed.alive()
        finally:
            boxed.stop()
    c.release(lease["id"])

    lease = c.create_lease(client="gpu-test", request="2Gi", limit="8Gi")
    pair = [targets(lease["physical_gpu"]) for _ in range(2)]
    for kernel in pair:
        c.register_pid(lease["id"], kernel.pid)
        kernel.hold(1536)
    nvml = wait_for(lambda: (s := sum(nvml_memory_of(k.pid) for k in pair)) >= 3 * GiB and s,
                    30, "NVML to list both")
    frozen = c.freeze(lease["id"])
    record("frozen_bytes_under_fast_poll", nvml_before=nvml, frozen_bytes=frozen["frozen_bytes"],
           nvml_after=[nvml_memory_of(k.pid) for k in pair])
    assert frozen["frozen_bytes"] >= nvml

    free = _free(lease["physical_gpu"])
    filler = targets(lease["physical_gpu"])
    filler.hold(max(0, (free - frozen["frozen_bytes"]) // MiB + 256))
    waiting = c.unpark(lease["id"])
    time.sleep(1.0)  # twenty polls: it must not have tried a restore
    still = c.lease(lease["id"])
    filler.stop()
    back = wait_for(lambda: (x := c.lease(lease["id"]))["state"] == "active" and x, 60,
                    "the thaw once room came")
    record("thaw_into_a_full_gpu", waiting=waiting["state"], reason=still["reason"],
           thawed=back["state"], answers=[k.ask("check", 30) for k in pair])
    assert still["state"] == "pending" and still["frozen"]


def test_sigterm_mid_freeze_of_8_gib(tmp_path: Path, targets: Callable[..., Target]) -> None:
    """The agent stops only once its freeze is done: the driver's state and its ledger agree."""
    agent = AgentProcess(tmp_path / "agent", None, ["--poll-interval", "0.2"]).start()
    try:
        c = agent.client()
        wait_for(lambda: c.node()["freezing"]["available"], 120, "the canary")
        lease = c.create_lease(client="gpu-test", request="10Gi", limit="12Gi")
        kernel = targets(lease["physical_gpu"])
        c.register_pid(lease["id"], kernel.pid)
        kernel.hold(8192)
        wait_for(lambda: c.lease(lease["id"])["usage"] >= 8 * GiB, 60, "measured")
        threading.Thread(target=lambda: _quietly(lambda: c.freeze(lease["id"])),
                         daemon=True).start()
        wait_for(lambda: c.lease(lease["id"])["state"] == "freezing", 30, "the freeze under way")
        grace = c.node()["freezing"]["stop_grace"]
        started = time.monotonic()
        assert agent.process is not None
        agent.process.terminate()
        code = agent.process.wait(600)
        stopped = time.monotonic() - started
        state = DriverFreezer().state(kernel.pid)
        agent.start()
        after = agent.client().lease(lease["id"])
        record("sigterm_mid_freeze_8gib", stop_grace=grace, exit_code=code, stopped_s=stopped,
               driver_state=state, ledger_state=after["state"], frozen=after["frozen"])
        assert code == 0 and (state == "checkpointed") == after["frozen"]
    finally:
        agent.stop()


def _quietly(call: Callable[[], object]) -> None:
    try:
        call()
    except Exception as exc:  # its agent was stopped under it
        record("sigterm_mid_freeze_caller", error=str(exc))


def test_root_without_persistence_mode_is_recorded() -> None:
    """cuda-checkpoint#25: what persistence mode is here (the canary above ran under it)."""
    import pynvml

    pynvml.nvmlInit()
    try:
        modes = [pynvml.nvmlDeviceGetPersistenceMode(pynvml.nvmlDeviceGetHandleByIndex(i))
                 for i in range(pynvml.nvmlDeviceGetCount())]
    finally:
        pynvml.nvmlShutdown()
    record("persistence_mode", euid=os.geteuid(), modes=modes,
           libcuda=ctypes.util.find_library("cuda"))
