"""DriverFreezer through its real ctypes path, against a libcuda.so.1 built from C here: three
driver generations, real CUDA processes, scripted driver failures and the call log they leave."""

from __future__ import annotations

import ctypes
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from harness.agent import wait_for
from node_agent.devices import DriverFreezer
from node_agent.devices.base import FreezeError, Freezer
from node_agent.devices.cuda import (
    CUcheckpointCheckpointArgs,
    CUcheckpointGpuPair,
    CUcheckpointLockArgs,
    CUcheckpointRestoreArgs,
    CUcheckpointUnlockArgs,
    parse_uuid,
)

from .conftest import CONTEXT, GPU, OLD, SAME, Drive
from .fake_cuda import VARIANTS, FakeCuda, Target

NEW = "GPU-5ca1ab1e-0000-4000-8000-0000000000AB"  # NVML prints lower case; either is read


def checkpoint_calls(fake: FakeCuda, pid: int) -> list[tuple[str, str, str]]:
    """(call, args, result) for ``pid``, leaving out state queries."""
    return [(c.short, c.args, c.result) for c in fake.calls(pid) if c.short != "state"]


OK = "CUDA_SUCCESS"
FREEZE = (["lock", "PID", 1.0], ["checkpoint", "PID"])


def ops(pid: int, *steps: Any) -> list[list[Any]]:
    """The steps with "PID" replaced by ``pid``."""
    return [[pid if a == "PID" else a for a in step] for step in steps]


# --- what each driver offers ------------------------------------------------------------

@pytest.mark.parametrize("variant", list(VARIANTS))
def test_each_driver_generation_says_whether_it_can_freeze_and_remap(
    variant: str, drive: Drive, fake: FakeCuda, target: int
) -> None:
    first, remap, second, state = drive(variant, ["unavailable"], ["can_remap"], ["unavailable"],
                                        ["state", target])
    if variant == "r550":
        reason = first["ok"]
        assert "CUDA 12.4" in reason and "r570" in reason and "12.8" in reason
        assert "cuCheckpointProcessLock" in reason
        assert second["ok"] == reason
        # Asked of a driver without the API, an operation says why instead of crashing.
        assert state["kind"] == "not_supported" and reason in state["error"]
    else:
        assert first["ok"] is None and second["ok"] is None
        assert state == {"ok": "running"}
    assert remap["ok"] is (variant == "r580")
    # Initialised once, lazily, with flags 0 (the target's own cuInit is logged too).
    assert [(c.function, c.args, c.result) for c in fake.calls() if c.pid is None][-1] == \
        ("cuInit", "flags=0", OK)


def test_without_libcuda_the_node_has_no_driver(drive: Drive, tmp_path: Path, target: int) -> None:
    missing = str(tmp_path / "nowhere" / "libcuda.so.1")
    reason, remap, lock = drive("r580", ["unavailable"], ["can_remap"], ["lock", target, 1.0],
                                library=missing)
    assert "cannot be loaded" in reason["ok"] and "NVIDIA driver is not installed" in reason["ok"]
    assert remap == {"ok": False}
    assert "NVIDIA driver is not installed" in lock["error"] and lock["kind"] == "not_supported"


def test_the_default_library_is_found_through_ld_library_path(drive: Drive) -> None:
    assert DriverFreezer()._library == "libcuda.so.1"
    # Without a library argument the runner's DriverFreezer() finds the r570 stand-in.
    [reason, remap] = drive("r570", ["unavailable"], ["can_remap"])
    assert reason == {"ok": None} and remap == {"ok": False}


def test_a_failed_cuinit_is_named_and_tried_again(drive: Drive, fake: FakeCuda) -> None:
    fake.fail("init", "CUDA_ERROR_NO_DEVICE", once=True)
    first, second = drive("r580", ["unavailable"], ["unavailable"])
    assert "cuInit failed" in first["ok"] and "CUDA_ERROR_NO_DEVICE" in first["ok"]
    assert "no CUDA-capable device" in first["ok"]
    assert second == {"ok": None}
    assert [c.result for c in fake.calls() if c.function == "cuInit"] == \
        ["CUDA_ERROR_NO_DEVICE", OK]


def test_a_driver_freezer_is_a_freezer() -> None:
    freezer = DriverFreezer("libcuda-absent.so.1")
    assert isinstance(freezer, Freezer) and freezer.name == "cuda-driver" and freezer.needs_proof


# --- the steps ---------------------------------------------------------------------------

def test_freeze_then_thaw_goes_through_the_four_calls(
    drive: Drive, fake: FakeCuda, target: int
) -> None:
    results = drive("r570", *ops(target, ["state", "PID"], ["lock", "PID", 2.5],
                                 ["checkpoint", "PID"], ["state", "PID"], ["restore", "PID"],
                                 ["unlock", "PID"], ["state", "PID"]))
    assert results == [{"ok": "running"}, {"ok": None}, {"ok": None}, {"ok": "checkpointed"},
                       {"ok": None}, {"ok": None}, {"ok": "running"}]
    assert checkpoint_calls(fake, target) == [
        ("lock", "timeoutMs=2500", OK), ("checkpoint", "-", OK), ("restore", "-", OK),
        ("unlock", "-", OK)]
    assert fake.state(target) == "running"


def test_a_short_lock_timeout_is_at_least_a_millisecond(
    drive: Drive, fake: FakeCuda, target: int
) -> None:
    # 0 ms would mean "wait forever" to the driver.
    assert drive("r570", ["lock", target, 0.0001]) == [{"ok": None}]
    assert checkpoint_calls(fake, target)[0] == ("lock", "timeoutMs=1", OK)


def test_a_lock_behind_long_work_times_out_leaves_the_process_running_and_may_be_retried(
    drive: Drive, fake: FakeCuda, started: Callable[..., Target]
) -> None:
    busy = started()
    busy.ask("work 1500")  # a host function queued as GPU work: the lock waits for it
    timed_out, state, again = drive("r570", ["lock", busy.pid, 0.3], ["state", busy.pid],
                                    ["lock", busy.pid, 5.0])
    assert timed_out["kind"] == "timeout"
    assert "cuCheckpointProcessLock" in timed_out["error"]
    assert "CUDA_ERROR_TIMEOUT" in timed_out["error"] and "0.3s" in timed_out["error"]
    assert state == {"ok": "running"} and again == {"ok": None}
    assert fake.state(busy.pid) == "locked"


def test_a_refused_checkpoint_says_why_and_leaves_the_process_locked(
    drive: Drive, fake: FakeCuda, target: int
) -> None:
    fake.fail("checkpoint", "CUDA_ERROR_NOT_SUPPORTED", pid=target, once=False)
    refused, state, unlock = drive("r580", *ops(target, *FREEZE, ["state", "PID"],
                                                ["unlock", "PID"]))[1:]
    assert refused["kind"] == "not_supported"
    message = refused["error"]
    assert "cuCheckpointProcessCheckpoint" in message and "CUDA_ERROR_NOT_SUPPORTED" in message
    assert "UVM" in message
    # The driver left it locked: reading that and unlocking it is the agent's (flows/freezing).
    assert state == {"ok": "locked"} and unlock == {"ok": None}
    assert fake.state(target) == "running"


def test_calls_out_of_order_are_the_drivers_illegal_state(
    drive: Drive, fake: FakeCuda, target: int
) -> None:
    restore, unlock, checkpoint, lock, again = drive(
        "r570", ["restore", target], ["unlock", target], ["checkpoint", target],
        ["lock", target, 1.0], ["lock", target, 1.0])
    for refused, symbol in ((restore, "Restore"), (unlock, "Unlock"),
                            (checkpoint, "Checkpoint"), (again, "Lock")):
        assert f"cuCheckpointProcess{symbol}" in refused["error"]
        assert refused["kind"] == "illegal_state" and "ILLEGAL_STATE" in refused["error"]
    assert lock == {"ok": None} and fake.state(target) == "locked"


def test_remap_on_r580_passes_a_full_permutation_and_leaves_identity_out(
    drive: Drive, fake: FakeCuda, target: int
) -> None:
    swap = {OLD: SAME, SAME: OLD}
    results = drive("r580", *ops(target, *FREEZE, ["restore", "PID", {OLD: OLD, SAME: SAME}],
                                 ["unlock", "PID"], *FREEZE, ["restore", "PID", swap],
                                 ["unlock", "PID"], ["state", "PID"]))
    assert results == [{"ok": None}] * 8 + [{"ok": "running"}]
    restores = [args for call, args, _ in checkpoint_calls(fake, target) if call == "restore"]
    # An identity remap is no remap (NULL args); a real one names every GPU of the node.
    assert restores == ["-", f"gpuPairs={OLD}>{SAME},{SAME}>{OLD}"]
    record = fake.record(target)
    assert record is not None and record.gpu == SAME


def test_a_remap_that_is_no_permutation_is_refused_without_asking_the_driver(
    drive: Drive, fake: FakeCuda, target: int
) -> None:
    refused, state = drive("r580", *ops(target, *FREEZE, ["restore", "PID", {OLD: SAME}],
                                        ["state", "PID"]))[2:]
    assert "permutation" in refused["error"] and "#35" in refused["error"]
    assert state == {"ok": "checkpointed"}
    assert [c for c, _, _ in checkpoint_calls(fake, target)] == ["lock", "checkpoint"]


def test_remap_on_r570_is_refused_without_asking_the_driver(
    drive: Drive, fake: FakeCuda, target: int
) -> None:
    refused, state, identity = drive(
        "r570", *ops(target, *FREEZE, ["restore", "PID", {OLD: SAME, SAME: OLD}],
                     ["state", "PID"], ["restore", "PID", {OLD: OLD}]))[2:]
    assert "r580" in refused["error"] and "CUDA 13.0" in refused["error"]
    assert "CUDA 12.8" in refused["error"] and refused["kind"] == "other"
    assert state == {"ok": "checkpointed"} and identity == {"ok": None}
    # The refused remap made no driver call; the identity one restored in place.
    assert checkpoint_calls(fake, target) == [
        ("lock", "timeoutMs=1000", OK), ("checkpoint", "-", OK), ("restore", "-", OK)]


def test_the_r570_driver_itself_refuses_gpu_pairs(fake: FakeCuda, libraries: dict[str, Path],
                                                 target: int, monkeypatch: pytest.MonkeyPatch) -> None:
    # What the agent's version check saves it from: r570 reads the pairs as reserved bytes.
    monkeypatch.setenv("FAKE_CUDA_STATE", str(fake.root))
    lib = ctypes.CDLL(str(libraries["r570"] / "libcuda.so.1"))
    assert lib.cuInit(0) == 0
    assert lib.cuCheckpointProcessLock(target, None) == 0
    assert lib.cuCheckpointProcessCheckpoint(target, None) == 0
    pair = CUcheckpointGpuPair(parse_uuid(OLD), parse_uuid(NEW))
    args = CUcheckpointRestoreArgs(gpuPairs=ctypes.pointer(pair), gpuPairsCount=1)
    assert lib.cuCheckpointProcessRestore(target, ctypes.byref(args)) == 1  # INVALID_VALUE
    assert fake.state(target) == "checkpointed"


def test_a_restore_out_of_memory_wedges_the_process_as_the_driver_does(
    drive: Drive, fake: FakeCuda, target: int
) -> None:
    [lock, checkpoint] = drive("r580", *ops(target, *FREEZE))
    fake.fill(OLD, GPU - CONTEXT)  # something else takes the GPU meanwhile
    oom, state = drive("r580", ["restore", target], ["state", target])
    fake.fill(OLD, 0)
    again, unlock, still = drive("r580", ["restore", target], ["unlock", target],
                                 ["state", target])
    assert lock == checkpoint == {"ok": None}
    assert oom["kind"] == "out_of_memory" and "CUDA_ERROR_OUT_OF_MEMORY" in oom["error"]
    assert "#44" in oom["error"]
    assert state == {"ok": "checkpointed"}
    # With room again, no restore works and the process cannot be unlocked (cuda-checkpoint#44).
    assert again["kind"] == "os_error" and "CUDA_ERROR_OPERATING_SYSTEM" in again["error"]
    assert unlock["kind"] == "illegal_state" and still == {"ok": "checkpointed"}


def test_a_pid_that_does_not_exist_and_a_process_without_cuda(
    drive: Drive, fake: FakeCuda, started: Callable[..., Target]
) -> None:
    gone = subprocess.Popen(["sleep", "120"])
    gone.kill()
    gone.wait()
    plain = started(cuda=False)
    state, lock, no_cuda, no_lock = drive("r580", ["state", gone.pid], ["lock", gone.pid, 1.0],
                                          ["state", plain.pid], ["lock", plain.pid, 1.0])
    for result, symbol in ((state, "cuCheckpointProcessGetState"),
                           (lock, "cuCheckpointProcessLock")):
        assert symbol in result["error"] and "CUDA_ERROR_INVALID_VALUE" in result["error"]
        assert "no longer exists" in result["error"] and result["kind"] == "gone"
    for result in (no_cuda, no_lock):
        assert result["kind"] == "no_cuda" and "CUDA_ERROR_NOT_INITIALIZED" in result["error"]


def test_the_newer_transitional_states_read_as_locked(
    drive: Drive, fake: FakeCuda, target: int
) -> None:
    fake.set_state(target, "checkpointing")
    [checkpointing] = drive("r580", ["state", target])
    fake.set_state(target, "restoring")
    [restoring] = drive("r580", ["state", target])
    assert checkpointing == restoring == {"ok": "locked"}


def test_checkpoints_of_different_processes_run_at_once(
    drive: Drive, fake: FakeCuda, started: Callable[..., Target]
) -> None:
    pids = [started(mib=64).pid, started(SAME, mib=64).pid]
    fake.rate(32 * 2**20)  # each copy takes two seconds
    results: list[list[dict[str, Any]]] = []
    thread = threading.Thread(target=lambda: results.append(drive("r580", ["checkpoint_all", pids])))
    thread.start()
    # Both copies under way at the same moment: the calls for different pids do not queue.
    wait_for(lambda: all((r := fake.record(pid)) is not None and r.state == "checkpointing"
                         for pid in pids), what="both checkpoints under way at once")
    thread.join(60)
    assert results[0][0]["ok"]["errors"] == []
    assert [fake.state(pid) for pid in pids] == ["checkpointed"] * 2


# --- the C ABI ----------------------------------------------------------------------------

def test_every_args_struct_is_64_bytes_as_in_cuda_h() -> None:
    for struct in (CUcheckpointLockArgs, CUcheckpointCheckpointArgs, CUcheckpointRestoreArgs,
                   CUcheckpointUnlockArgs):
        assert ctypes.sizeof(struct) == 64, struct.__name__
    assert ctypes.sizeof(CUcheckpointGpuPair) == 32
    assert CUcheckpointRestoreArgs.gpuPairsCount.offset == 8
    assert CUcheckpointRestoreArgs.reserved1.offset == 56
    assert CUcheckpointLockArgs.reserved1.offset == 8


def test_gpu_uuids_become_the_drivers_16_bytes() -> None:
    assert bytes(parse_uuid(NEW).bytes) == bytes.fromhex("5ca1ab1e000040008000" + "0000000000ab")
    for bad in ("5ca1ab1e-0000-4000-8000-000000000000", "GPU-5ca1ab1e-0000-4000-8000-00000000000",
                "MIG-5ca1ab1e-0000-4000-8000-000000000000"):
        with pytest.raises(FreezeError):
            parse_uuid(bad)
