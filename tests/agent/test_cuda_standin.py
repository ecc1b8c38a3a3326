"""The stand-in libcuda.so.1 is as strict as the driver's public contract: each behaviour the
agent must survive, called raw (ctypes on the library, from another process) on small real CUDA
programs, with the public source it comes from. What the agent makes of them is in
test_freeze_driver.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from memory_cgroups import memory_cgroup

from harness.agent import ROOT, wait_for

from .conftest import CONTEXT, GPU, OLD, Drive
from .fake_cuda import FakeCuda, Target

# Calls libcuda raw, as a driver client written in C would: argv[1] is a JSON list of
# [call, pid, ...]; "init" calls cuInit; "restore" takes [old, new] UUID pairs. Prints the
# CUresult of each (GetState: [CUresult, state]).
RAW = """
import ctypes, json, sys
from node_agent.devices.cuda import CUcheckpointGpuPair, CUcheckpointRestoreArgs, parse_uuid
lib = ctypes.CDLL("libcuda.so.1")
out = []
for call, *args in json.loads(sys.argv[1]):
    if call == "init":
        out.append(lib.cuInit(0))
    elif call == "state":
        state = ctypes.c_int(-1)
        out.append([lib.cuCheckpointProcessGetState(args[0], ctypes.byref(state)), state.value])
    elif call == "restore" and len(args) > 1:
        pairs = (CUcheckpointGpuPair * len(args[1]))(
            *(CUcheckpointGpuPair(parse_uuid(o), parse_uuid(n)) for o, n in args[1]))
        restore = CUcheckpointRestoreArgs(
            gpuPairs=ctypes.cast(pairs, ctypes.POINTER(CUcheckpointGpuPair)),
            gpuPairsCount=len(args[1]))
        out.append(lib.cuCheckpointProcessRestore(args[0], ctypes.byref(restore)))
    else:
        out.append(getattr(lib, "cuCheckpointProcess" + call.title())(args[0], None))
print(json.dumps(out))
"""
SUCCESS, INVALID_VALUE, OUT_OF_MEMORY, NOT_INITIALIZED = 0, 1, 2, 3
ILLEGAL_STATE, NOT_PERMITTED, TIMEOUT = 401, 800, 909
RUNNING, LOCKED, CHECKPOINTED = 0, 1, 2
MiB = 2**20
GPUS = [f"GPU-5ca1ab1e-0000-4000-8000-00000000000{i}" for i in range(4)]

Raw = Callable[..., list[Any]]


@pytest.fixture
def raw(fake: FakeCuda, libraries: dict[str, Path]) -> Raw:
    """The calls, in a fresh process on the r580 stand-in; ``timeout``: how long to wait."""
    def run(*calls: list[Any], timeout: float = 30) -> list[Any]:
        done = subprocess.run([sys.executable, "-c", RAW, json.dumps(calls)], capture_output=True,
                              text=True, timeout=timeout, cwd=ROOT,
                              env={**os.environ, **fake.env(libraries["r580"])})
        assert done.returncode == 0, done.stderr
        results: list[Any] = json.loads(done.stdout)
        return results
    return run


def test_getstate_needs_no_cuinit_in_the_caller_and_every_other_call_does(
    raw: Raw, started: Callable[..., Target]
) -> None:
    """[API] checkpoint group: restore needs cuInit (or persistence mode) in the caller;
    NOTES: GetState itself does not."""
    pid = started().pid
    assert raw(["state", pid], ["lock", pid], ["init"], ["lock", pid]) == [
        [SUCCESS, RUNNING], NOT_INITIALIZED, SUCCESS, SUCCESS]


def test_a_process_that_never_initialised_cuda_is_refused_even_its_state(
    raw: Raw, started: Callable[..., Target]
) -> None:
    """cuda-checkpoint on a process without CUDA says "initialization error"
    (CUDA_ERROR_NOT_INITIALIZED); Modal's and CRIU's code read that as "no CUDA here"."""
    plain = started(cuda=False)
    result = raw(["init"], ["state", plain.pid], ["lock", plain.pid])
    assert result[1][0] == NOT_INITIALIZED and result[2] == NOT_INITIALIZED


def test_every_call_out_of_order_is_illegal_state_and_the_order_goes_round(
    raw: Raw, started: Callable[..., Target]
) -> None:
    """[API] lock only from RUNNING, checkpoint only from LOCKED, restore only from
    CHECKPOINTED (then LOCKED), unlock only from LOCKED."""
    pid = started().pid
    assert raw(["init"], ["checkpoint", pid], ["restore", pid], ["unlock", pid],
               ["lock", pid], ["lock", pid], ["restore", pid], ["checkpoint", pid],
               ["checkpoint", pid], ["lock", pid], ["unlock", pid], ["restore", pid],
               ["restore", pid], ["lock", pid], ["unlock", pid], ["checkpoint", pid],
               ["state", pid]) == [
        SUCCESS, ILLEGAL_STATE, ILLEGAL_STATE, ILLEGAL_STATE,
        SUCCESS, ILLEGAL_STATE, ILLEGAL_STATE, SUCCESS,
        ILLEGAL_STATE, ILLEGAL_STATE, ILLEGAL_STATE, SUCCESS,
        ILLEGAL_STATE, ILLEGAL_STATE, SUCCESS, ILLEGAL_STATE, [SUCCESS, RUNNING]]


def test_a_lock_waits_for_submitted_work_and_past_its_timeout_leaves_it_running(
    drive: Drive, fake: FakeCuda, started: Callable[..., Target]
) -> None:
    """[README] a suspend completes the work already submitted, stream callbacks included;
    [API] past the lock's timeout the process is left RUNNING."""
    busy = started()
    assert busy.ask("work 1000") == "ok"
    [timed_out] = drive("r580", ["lock", busy.pid, 0.2])
    assert timed_out["kind"] == "timeout" and fake.state(busy.pid) == "running"
    locked: list[float] = []
    thread = threading.Thread(target=lambda: locked.append(
        time.monotonic() if drive("r580", ["lock", busy.pid, 30.0]) == [{"ok": None}] else 0.0))
    thread.start()
    assert busy.answer(30) == "worked"
    worked = time.monotonic()
    thread.join(30)
    assert locked and locked[0] >= worked, "the lock returned before the work had run"
    assert fake.state(busy.pid) == "locked"


def test_the_process_s_own_cuda_calls_wait_while_it_is_locked_or_checkpointed(
    drive: Drive, fake: FakeCuda, started: Callable[..., Target]
) -> None:
    """[README] the driver APIs that launch work or touch GPU state block until resumed; CPU
    threads run on."""
    kernel = started()
    drive("r580", ["lock", kernel.pid, 5.0])
    kernel.send("check")
    with pytest.raises(TimeoutError):
        kernel.answer(0.5)
    drive("r580", ["checkpoint", kernel.pid], ["restore", kernel.pid])
    with pytest.raises(TimeoutError):
        kernel.answer(0.5)
    drive("r580", ["unlock", kernel.pid])
    assert kernel.answer(10) == "ok"  # and what it held came back


def test_a_checkpoint_copies_the_memory_into_the_process_and_releases_the_gpu(
    drive: Drive, fake: FakeCuda, started: Callable[..., Target]
) -> None:
    """[README] device memory is copied "into allocations managed by the CUDA driver" in the
    process, then every GPU resource is released; a restore brings it back."""
    kernel = started(mib=64)
    before = fake.record(kernel.pid)
    assert before is not None and before.device == 64 * MiB and before.context == CONTEXT
    drive("r580", ["lock", kernel.pid, 5.0], ["checkpoint", kernel.pid])
    frozen = fake.record(kernel.pid)
    assert frozen is not None and (frozen.device, frozen.context, frozen.copy) == (0, 0, 64 * MiB)
    drive("r580", ["restore", kernel.pid], ["unlock", kernel.pid])
    back = fake.record(kernel.pid)
    assert back is not None and (back.device, back.context, back.copy) == (64 * MiB, CONTEXT, 0)
    assert kernel.ask("check") == "ok"


def test_the_copy_is_charged_to_the_process_s_memory_cgroup_whose_limit_can_end_it(
    drive: Drive, fake: FakeCuda, libraries: dict[str, Path]
) -> None:
    """[README] by its reasoning (NOTES): the copy lands in the process, so its cgroup pays;
    below the limit a kernel holding less on the GPU than its limit leaves is OOM-killed."""
    fake.gpus([(OLD, GPU, CONTEXT)])
    with memory_cgroup(400 * MiB) as cgroup:
        kernel = Target({**fake.env(libraries["r580"]), "CUDA_VISIBLE_DEVICES": OLD},
                        preexec=cgroup.preexec)
        try:
            assert kernel.ask("host 150") == "ok" and kernel.ask("alloc 300") == "ok"
            [lock, checkpoint] = drive("r580", ["lock", kernel.pid, 5.0],
                                       ["checkpoint", kernel.pid])
            assert lock == {"ok": None} and "error" in checkpoint
            assert kernel.proc.wait(10) == -signal.SIGKILL  # the cgroup's OOM killer
        finally:
            kernel.stop()


def test_a_restore_without_room_wedges_the_process_for_good(
    raw: Raw, fake: FakeCuda, started: Callable[..., Target]
) -> None:
    """cuda-checkpoint#44: out of memory, the process stays CHECKPOINTED; with room again,
    restore answers 304 and unlock 401, for good."""
    pid = started(mib=64).pid
    assert raw(["init"], ["lock", pid], ["checkpoint", pid]) == [SUCCESS] * 3
    fake.fill(OLD, GPU - 32 * MiB)
    assert raw(["init"], ["restore", pid], ["state", pid]) == [
        SUCCESS, OUT_OF_MEMORY, [SUCCESS, CHECKPOINTED]]
    fake.fill(OLD, 0)
    assert raw(["init"], ["restore", pid], ["unlock", pid], ["state", pid]) == [
        SUCCESS, 304, ILLEGAL_STATE, [SUCCESS, CHECKPOINTED]]


def test_gpu_pairs_must_be_a_permutation_of_every_gpu_the_driver_sees(
    raw: Raw, fake: FakeCuda, libraries: dict[str, Path]
) -> None:
    """cuda-checkpoint#35 and cuda-python's checkpoint tests: a single pair 0->1 on a four-GPU
    node is INVALID_VALUE, so is an identity over two of four; CUDA_VISIBLE_DEVICES does not
    shrink the set. [API]: the new GPU must be the same chip."""
    fake.gpus([(uuid, GPU, CONTEXT) for uuid in GPUS])
    kernel = Target({**fake.env(libraries["r580"]), "CUDA_VISIBLE_DEVICES": GPUS[0]})
    try:
        kernel.hold(8)
        pid = kernel.pid
        full = [[GPUS[0], GPUS[1]], [GPUS[1], GPUS[0]], [GPUS[2], GPUS[2]], [GPUS[3], GPUS[3]]]
        assert raw(["init"], ["lock", pid], ["checkpoint", pid],
                   ["restore", pid, [[GPUS[0], GPUS[1]]]],
                   ["restore", pid, [[GPUS[0], GPUS[0]], [GPUS[1], GPUS[1]]]],
                   ["restore", pid, [[GPUS[0], GPUS[1]], [GPUS[1], GPUS[1]], [GPUS[2], GPUS[2]],
                                     [GPUS[3], GPUS[3]]]],
                   ["restore", pid, full], ["unlock", pid]) == [
            SUCCESS, SUCCESS, SUCCESS, INVALID_VALUE, INVALID_VALUE, INVALID_VALUE, SUCCESS,
            SUCCESS]
        record = fake.record(pid)
        assert record is not None and record.gpu == GPUS[1]
        assert kernel.ask("check") == "ok"
        # Another chip is refused too.
        fake.gpus([(GPUS[0], GPU, CONTEXT), (GPUS[1], GPU, CONTEXT), (GPUS[2], GPU, CONTEXT),
                   (GPUS[3], GPU, CONTEXT)], name="NVIDIA L4")
        assert raw(["init"], ["lock", pid], ["checkpoint", pid])[1:] == [SUCCESS, SUCCESS]
        fake.gpus([(GPUS[0], GPU, CONTEXT), (GPUS[1], GPU, CONTEXT)])
        with (fake.root / "gpus").open("a") as f:
            f.write(f"{GPUS[2]} {GPU} {CONTEXT} NVIDIA L4\n{GPUS[3]} {GPU} {CONTEXT} NVIDIA L4\n")
        swap_chips = [[GPUS[1], GPUS[2]], [GPUS[2], GPUS[1]], [GPUS[0], GPUS[0]],
                      [GPUS[3], GPUS[3]]]
        assert raw(["init"], ["restore", pid, swap_chips]) == [SUCCESS, INVALID_VALUE]
    finally:
        kernel.stop()


def test_a_stopped_process_leaves_the_call_waiting_until_it_runs_again(
    drive: Drive, fake: FakeCuda, started: Callable[..., Target]
) -> None:
    """CRIU's cuda plugin: the calls are served by a thread in the target (the plugin resumes
    a stopped one first); a SIGSTOPped target cannot answer."""
    kernel = started()
    kernel.proc.send_signal(signal.SIGSTOP)
    try:
        with pytest.raises(subprocess.TimeoutExpired):
            drive("r580", ["lock", kernel.pid, 1.0], timeout=3)
    finally:
        kernel.proc.send_signal(signal.SIGCONT)
    # The request it took while stopped is served once it runs.
    wait_for(lambda: fake.state(kernel.pid) == "locked", what="the lock served after SIGCONT")


def test_scripted_hangs_stand_for_nccl_peers_and_unanswered_calls(
    drive: Drive, fake: FakeCuda, started: Callable[..., Target]
) -> None:
    """cuda-checkpoint#30: with NCCL, any call on a peer hangs (GetState too) while one is
    locked."""
    pid = started().pid
    fake.hang("state", pid=pid)
    with pytest.raises(subprocess.TimeoutExpired):
        drive("r580", ["state", pid], timeout=3)
    fake.clear_script()
    assert drive("r580", ["state", pid]) == [{"ok": "running"}]


def test_as_root_without_persistence_mode_the_call_is_refused_and_the_process_dies(
    raw: Raw, fake: FakeCuda, started: Callable[..., Target]
) -> None:
    """cuda-checkpoint#25: "operation not permitted", and the process is killed; persistence
    mode (nvidia-smi -pm 1) is the fix."""
    if os.geteuid() != 0:
        pytest.skip("the refusal is of root's calls")
    kernel = started()
    fake.persistence(False)
    assert raw(["init"], ["lock", kernel.pid]) == [SUCCESS, NOT_PERMITTED]
    assert kernel.proc.wait(10) == -signal.SIGKILL
    fake.persistence(True)
    other = started()
    assert raw(["init"], ["lock", other.pid]) == [SUCCESS, SUCCESS]


def test_a_process_in_another_pid_namespace_is_refused(
    raw: Raw, fake: FakeCuda, libraries: dict[str, Path]
) -> None:
    """cuda-checkpoint#41 (NOTES): the caller and the process must share a PID namespace."""
    fake.gpus([(OLD, GPU, CONTEXT)])
    try:
        kernel = Target({**fake.env(libraries["r580"]), "CUDA_VISIBLE_DEVICES": OLD},
                        prefix=["unshare", "--pid", "--fork"])
    except AssertionError as exc:
        pytest.skip(f"no PID namespace for a test process here: {exc}")
    try:
        kernel.hold(8)
        assert raw(["init"], ["state", kernel.pid], ["lock", kernel.pid]) == [
            SUCCESS, [NOT_PERMITTED, -1], NOT_PERMITTED]
    finally:
        kernel.stop()


def test_a_lock_can_crash_its_process(
    raw: Raw, fake: FakeCuda, started: Callable[..., Target]
) -> None:
    """cuda-checkpoint#58: Lock has crashed a target."""
    kernel = started()
    fake.crash("lock", pid=kernel.pid)
    assert raw(["init"], ["lock", kernel.pid])[1] != SUCCESS
    assert kernel.proc.wait(10) == -signal.SIGKILL


def test_slow_copies_take_the_scripted_rate(
    drive: Drive, fake: FakeCuda, started: Callable[..., Target]
) -> None:
    """The copy speed the test sets (the H100 measured here: 8 GiB in 7.2 s): the checkpoint
    is under way, its process in the newer drivers' CHECKPOINTING state, while it copies."""
    kernel = started(mib=64)
    fake.rate(32 * MiB)
    thread = threading.Thread(target=lambda: drive("r580", ["lock", kernel.pid, 5.0],
                                                   ["checkpoint", kernel.pid]))
    thread.start()
    wait_for(lambda: fake.state(kernel.pid) == "checkpointing", what="the copy under way")
    thread.join(30)
    assert fake.state(kernel.pid) == "checkpointed"
