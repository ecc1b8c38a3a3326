"""DriverFreezer through its real ctypes path, against a libcuda.so.1 built from C here: three
driver generations, real pids, scripted driver failures and the call log they leave."""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from harness.agent import ROOT
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

from .fake_cuda import VARIANTS, FakeCuda, build

OLD = "GPU-5ca1ab1e-0000-4000-8000-000000000000"
NEW = "GPU-5ca1ab1e-0000-4000-8000-0000000000AB"  # NVML prints lower case; either is read
SAME = "GPU-5ca1ab1e-0000-4000-8000-000000000002"

# Drives one DriverFreezer in a fresh process (libcuda found through LD_LIBRARY_PATH, as on a
# node): argv[1] is a JSON list of [operation, arguments...], argv[2] the library if not the
# default. Prints one {"ok": value} or {"error": message, "retry": bool} per operation.
DRIVE = """
import json, sys, threading, time
from node_agent.devices import DriverFreezer
from node_agent.devices.base import FreezeError
freezer = DriverFreezer(*sys.argv[2:])

def freeze_all(pids, timeout):
    errors = []
    def one(pid):
        try:
            freezer.freeze(pid, lock_timeout=timeout)
        except FreezeError as exc:
            errors.append(str(exc))
    threads = [threading.Thread(target=one, args=(pid,)) for pid in pids]
    started = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {"seconds": time.monotonic() - started, "errors": errors}

out = []
for op, *args in json.loads(sys.argv[1]):
    try:
        if op == "unavailable":
            value = freezer.unavailable()
        elif op == "can_remap":
            value = freezer.can_remap()
        elif op == "state":
            value = freezer.state(*args)
        elif op == "freeze":
            value = freezer.freeze(args[0], lock_timeout=args[1])
        elif op == "thaw":
            value = freezer.thaw(*args)
        elif op == "freeze_all":
            value = freeze_all(*args)
        out.append({"ok": value})
    except FreezeError as exc:
        out.append({"error": str(exc), "retry": exc.retry})
print(json.dumps(out))
"""

Drive = Callable[..., list[dict[str, Any]]]


@pytest.fixture(scope="module")
def libraries(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One fake libcuda.so.1 per driver generation."""
    root = tmp_path_factory.mktemp("libcuda")
    return {variant: build(variant, root / variant) for variant in VARIANTS}


@pytest.fixture
def fake(tmp_path: Path) -> FakeCuda:
    return FakeCuda(tmp_path / "cuda")


@pytest.fixture
def drive(fake: FakeCuda, libraries: dict[str, Path], tmp_path: Path) -> Drive:
    """Runs the operations through ``variant``'s library; ``library`` overrides the name."""

    def run(variant: str, *ops: list[Any], library: str | None = None) -> list[dict[str, Any]]:
        argv = [sys.executable, "-c", DRIVE, json.dumps(ops), *([library] if library else [])]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=60, cwd=ROOT,
                              env={**os.environ, **fake.env(libraries[variant])})
        assert done.returncode == 0, done.stderr
        results: list[dict[str, Any]] = json.loads(done.stdout)
        return results

    return run


def _sleeper() -> subprocess.Popen[bytes]:
    return subprocess.Popen(["sleep", "120"])


@pytest.fixture
def target() -> Iterator[int]:
    """A live process to freeze (the stand-in acts on any pid that exists)."""
    proc = _sleeper()
    yield proc.pid
    proc.kill()
    proc.wait()


def checkpoint_calls(fake: FakeCuda, pid: int) -> list[tuple[str, str, str]]:
    """(call, args, result) for ``pid``, leaving out state queries."""
    return [(c.short, c.args, c.result) for c in fake.calls(pid) if c.short != "state"]


OK = "CUDA_SUCCESS"


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
        assert state["retry"] is False and reason in state["error"]
    else:
        assert first["ok"] is None and second["ok"] is None
        assert state == {"ok": "running"}
    assert remap["ok"] is (variant == "r580")
    # Initialised once, lazily, with flags 0.
    assert [(c.function, c.args, c.result) for c in fake.calls() if c.pid is None] == \
        [("cuInit", "flags=0", OK)]


def test_without_libcuda_the_node_has_no_driver(drive: Drive, tmp_path: Path, target: int) -> None:
    missing = str(tmp_path / "nowhere" / "libcuda.so.1")
    reason, remap, freeze = drive("r580", ["unavailable"], ["can_remap"], ["freeze", target, 1.0],
                                  library=missing)
    assert "cannot be loaded" in reason["ok"] and "NVIDIA driver is not installed" in reason["ok"]
    assert remap == {"ok": False}
    assert "NVIDIA driver is not installed" in freeze["error"] and freeze["retry"] is False


def test_the_default_library_is_found_through_ld_library_path(drive: Drive, target: int) -> None:
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
    assert isinstance(freezer, Freezer) and freezer.name == "cuda-driver"


# --- freeze and thaw ---------------------------------------------------------------------

def test_freeze_then_thaw_goes_through_the_four_calls(
    drive: Drive, fake: FakeCuda, target: int
) -> None:
    results = drive("r570", ["state", target], ["freeze", target, 2.5], ["state", target],
                    ["thaw", target], ["state", target])
    assert results == [{"ok": "running"}, {"ok": None}, {"ok": "checkpointed"}, {"ok": None},
                       {"ok": "running"}]
    assert checkpoint_calls(fake, target) == [
        ("lock", "timeoutMs=2500", OK), ("checkpoint", "-", OK), ("restore", "-", OK),
        ("unlock", "-", OK)]
    assert fake.state(target) == "running"


def test_a_short_lock_timeout_is_at_least_a_millisecond(
    drive: Drive, fake: FakeCuda, target: int
) -> None:
    # 0 ms would mean "wait forever" to the driver.
    assert drive("r570", ["freeze", target, 0.0001]) == [{"ok": None}]
    assert checkpoint_calls(fake, target)[0] == ("lock", "timeoutMs=1", OK)


def test_a_lock_timeout_may_be_retried_and_leaves_the_process_running(
    drive: Drive, fake: FakeCuda, target: int
) -> None:
    fake.fail("lock", "CUDA_ERROR_TIMEOUT", pid=target, once=True)
    timed_out, state, again = drive("r570", ["freeze", target, 0.5], ["state", target],
                                    ["freeze", target, 0.5])
    assert timed_out["retry"] is True
    assert "cuCheckpointProcessLock" in timed_out["error"]
    assert "CUDA_ERROR_TIMEOUT" in timed_out["error"] and "0.5s" in timed_out["error"]
    assert state == {"ok": "running"}
    assert again == {"ok": None}
    # No checkpoint after the lock that timed out.
    assert checkpoint_calls(fake, target) == [
        ("lock", "timeoutMs=500", "CUDA_ERROR_TIMEOUT"), ("lock", "timeoutMs=500", OK),
        ("checkpoint", "-", OK)]


def test_a_refused_checkpoint_unlocks_the_process_again(
    drive: Drive, fake: FakeCuda, target: int
) -> None:
    fake.fail("checkpoint", "CUDA_ERROR_NOT_SUPPORTED", pid=target, once=False)
    refused, state = drive("r580", ["freeze", target, 1.0], ["state", target])
    assert refused["retry"] is False
    message = refused["error"]
    assert "cuCheckpointProcessCheckpoint" in message and "CUDA_ERROR_NOT_SUPPORTED" in message
    assert "UVM" in message and "unlocked again" in message
    assert state == {"ok": "running"} and fake.state(target) == "running"
    assert checkpoint_calls(fake, target) == [
        ("lock", "timeoutMs=1000", OK), ("checkpoint", "-", "CUDA_ERROR_NOT_SUPPORTED"),
        ("unlock", "-", OK)]


def test_a_process_that_cannot_be_unlocked_after_a_failed_checkpoint_is_named_locked(
    drive: Drive, fake: FakeCuda, target: int
) -> None:
    fake.fail("checkpoint", "CUDA_ERROR_UNKNOWN", pid=target)
    fake.fail("unlock", "CUDA_ERROR_OPERATING_SYSTEM", pid=target)
    [refused] = drive("r570", ["freeze", target, 1.0])
    assert "could not be unlocked" in refused["error"] and "block" in refused["error"]
    assert "CUDA_ERROR_OPERATING_SYSTEM" in refused["error"] and refused["retry"] is False
    assert fake.state(target) == "locked"


def test_freezing_a_frozen_process_is_the_drivers_illegal_state(
    drive: Drive, fake: FakeCuda, target: int
) -> None:
    thaw_running, freeze, again = drive("r570", ["thaw", target], ["freeze", target, 1.0],
                                        ["freeze", target, 1.0])
    assert "cuCheckpointProcessRestore" in thaw_running["error"]
    assert "CUDA_ERROR_ILLEGAL_STATE" in thaw_running["error"]
    assert "now 'running'" in thaw_running["error"]
    assert freeze == {"ok": None}
    assert "cuCheckpointProcessLock" in again["error"] and "ILLEGAL_STATE" in again["error"]
    assert again["retry"] is False and fake.state(target) == "checkpointed"


def test_remap_on_r580_passes_every_pair_and_leaves_identity_out(
    drive: Drive, fake: FakeCuda, target: int
) -> None:
    results = drive("r580", ["freeze", target, 1.0], ["thaw", target, {SAME: SAME}],
                    ["freeze", target, 1.0], ["thaw", target, {OLD: NEW, SAME: SAME}],
                    ["state", target])
    assert results == [{"ok": None}] * 4 + [{"ok": "running"}]
    restores = [args for call, args, _ in checkpoint_calls(fake, target) if call == "restore"]
    # An identity-only remap is no remap (NULL args); a real one names every GPU it used.
    assert restores == ["-", f"gpuPairs={OLD}>{NEW[:4]}{NEW[4:].lower()},{SAME}>{SAME}"]


def test_remap_on_r570_is_refused_without_asking_the_driver(
    drive: Drive, fake: FakeCuda, target: int
) -> None:
    freeze, refused, state, identity = drive(
        "r570", ["freeze", target, 1.0], ["thaw", target, {OLD: NEW}], ["state", target],
        ["thaw", target, {OLD: OLD}])
    assert freeze == {"ok": None}
    assert "r580" in refused["error"] and "CUDA 13.0" in refused["error"]
    assert "CUDA 12.8" in refused["error"] and refused["retry"] is False
    assert state == {"ok": "checkpointed"} and identity == {"ok": None}
    # The refused remap made no driver call; the identity one restored in place.
    assert checkpoint_calls(fake, target) == [
        ("lock", "timeoutMs=1000", OK), ("checkpoint", "-", OK), ("restore", "-", OK),
        ("unlock", "-", OK)]


def test_the_r570_driver_itself_refuses_gpu_pairs(fake: FakeCuda, libraries: dict[str, Path],
                                                 target: int, monkeypatch: pytest.MonkeyPatch) -> None:
    # What the agent's version check saves it from: r570 reads the pairs as reserved bytes.
    monkeypatch.setenv("FAKE_CUDA_STATE", str(fake.root))
    lib = ctypes.CDLL(str(libraries["r570"] / "libcuda.so.1"))
    assert lib.cuInit(0) == 0
    fake.set_state(target, "checkpointed")
    pair = CUcheckpointGpuPair(parse_uuid(OLD), parse_uuid(NEW))
    args = CUcheckpointRestoreArgs(gpuPairs=ctypes.pointer(pair), gpuPairsCount=1)
    assert lib.cuCheckpointProcessRestore(target, ctypes.byref(args)) == 1  # INVALID_VALUE
    assert fake.state(target) == "checkpointed"


def test_a_restore_out_of_memory_leaves_the_process_failed(
    drive: Drive, fake: FakeCuda, target: int
) -> None:
    fake.fail("restore", "CUDA_ERROR_OUT_OF_MEMORY", pid=target, leaves="failed")
    freeze, oom, state, again = drive("r580", ["freeze", target, 1.0], ["thaw", target],
                                      ["state", target], ["thaw", target])
    assert freeze == {"ok": None}
    assert "cuCheckpointProcessRestore" in oom["error"] and "CUDA_ERROR_OUT_OF_MEMORY" in oom["error"]
    assert "now 'failed'" in oom["error"] and "killing" in oom["error"] and oom["retry"] is False
    assert state == {"ok": "failed"}
    assert "CUDA_ERROR_ILLEGAL_STATE" in again["error"]
    # No unlock after a failed restore.
    assert [call for call, _, _ in checkpoint_calls(fake, target)] == \
        ["lock", "checkpoint", "restore", "restore"]


def test_a_pid_that_does_not_exist(drive: Drive, fake: FakeCuda) -> None:
    gone = _sleeper()
    gone.kill()
    gone.wait()
    state, freeze = drive("r580", ["state", gone.pid], ["freeze", gone.pid, 1.0])
    for result, symbol in ((state, "cuCheckpointProcessGetState"),
                           (freeze, "cuCheckpointProcessLock")):
        assert symbol in result["error"] and "CUDA_ERROR_INVALID_VALUE" in result["error"]
        assert "no longer exists" in result["error"] and result["retry"] is False
    assert [(c.short, c.result) for c in fake.calls(gone.pid)] == \
        [("state", "CUDA_ERROR_INVALID_VALUE"), ("lock", "CUDA_ERROR_INVALID_VALUE")]


def test_the_newer_transitional_states_read_as_locked(
    drive: Drive, fake: FakeCuda, target: int
) -> None:
    fake.set_state(target, "checkpointing")
    [checkpointing] = drive("r580", ["state", target])
    fake.set_state(target, "restoring")
    [restoring] = drive("r580", ["state", target])
    assert checkpointing == restoring == {"ok": "locked"}


def test_freezes_of_different_processes_run_at_once(drive: Drive, fake: FakeCuda) -> None:
    procs = [_sleeper(), _sleeper()]
    try:
        pids = [p.pid for p in procs]
        fake.delay("checkpoint", 0.8)
        [result] = drive("r580", ["freeze_all", pids, 1.0])
        assert result["ok"]["errors"] == []
        # Serialised they would take 1.6 s at least.
        assert result["ok"]["seconds"] < 1.5
        assert [fake.state(pid) for pid in pids] == ["checkpointed"] * 2
    finally:
        for p in procs:
            p.kill()
            p.wait()


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
