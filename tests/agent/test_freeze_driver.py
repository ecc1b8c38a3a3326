"""The agent's freeze path through the real ctypes calls, against the stand-in libcuda built from
C: which calls it makes (with their timeouts and GPU pairs), retries, fallbacks, and what it
finds after its own restart. The node is simulated; the driver is the stand-in's."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from harness.agent import AgentProcess, wait_for
from node_agent.client import AgentClient

from .conftest import Holder, notebook_holding
from .fake_cuda import FakeCuda, build

KINDS = ("migrate", "shrink", "killed", "park", "unparked", "frozen", "moved")


@pytest.fixture(scope="module")
def libraries(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("libcuda")
    return {variant: build(variant, root / variant) for variant in ("r550", "r570", "r580")}


@pytest.fixture
def driver(shared_tmp: Path, libraries: dict[str, Path],
           start_agent: Callable[..., AgentProcess]
           ) -> Iterator[Callable[..., tuple[AgentProcess, FakeCuda]]]:
    """An agent whose freezer is the driver's, on the stand-in of driver ``variant``."""
    def start(variant: str, *args: str, spec: str = "2x2GiB") -> tuple[AgentProcess, FakeCuda]:
        fake = FakeCuda(shared_tmp / f"cuda-{variant}-{time.monotonic_ns()}")
        agent = start_agent("--freezer", "driver", *args, spec=spec,
                            env=fake.env(libraries[variant]))
        return agent, fake
    yield start


def _notebook(agent: AgentProcess, holders: Callable[..., Holder]
              ) -> tuple[AgentClient, dict[str, Any], Holder]:
    """A client, and a notebook lease whose process holds 20 MiB."""
    lease, proc = notebook_holding(agent, holders, "512Mi", "1Gi", 20)
    return agent.client(), lease, proc


def _calls(fake: FakeCuda, pid: int) -> list[str]:
    return [c.short for c in fake.calls(pid) if c.short != "state"]


def _heard(agent: AgentProcess, cursor: int) -> list[dict[str, Any]]:
    return agent.client().directives(client="jupyter", after=cursor, timeout=0, kinds=KINDS)[0]


def test_park_and_thaw_make_the_four_calls_with_the_lock_timeout(
    driver: Callable[..., tuple[AgentProcess, FakeCuda]], holders: Callable[..., Holder]
) -> None:
    agent, fake = driver("r570", "--freeze-lock-timeout", "2.5")
    c, lease, proc = _notebook(agent, holders)
    assert c.node()["freezing"]["available"] and not c.node()["freezing"]["remap"]
    frozen = c.freeze(lease["id"])
    assert frozen["frozen"] and fake.state(proc.pid) == "checkpointed"
    assert _calls(fake, proc.pid) == ["lock", "checkpoint"]
    assert [c.args for c in fake.calls(proc.pid) if c.short == "lock"] == ["timeoutMs=2500"]
    c.unpark(lease["id"])
    wait_for(lambda: c.lease(lease["id"])["state"] == "active", what="thawed")
    assert fake.state(proc.pid) == "running"
    assert _calls(fake, proc.pid) == ["lock", "checkpoint", "restore", "unlock"]
    assert proc.alive()


def test_a_driver_without_the_api_parks_and_reclaims_the_old_way_and_says_why(
    driver: Callable[..., tuple[AgentProcess, FakeCuda]], holders: Callable[..., Holder]
) -> None:
    agent, fake = driver("r550")
    c = agent.client()
    freezing = c.node()["freezing"]
    assert not freezing["available"] and "r570" in freezing["why"]
    lease, proc = notebook_holding(agent, holders, "512Mi", "1Gi", 20)
    with pytest.raises(Exception) as err:
        c.freeze(lease["id"])
    assert getattr(err.value, "status", None) == 409 and "r570" in str(err.value)
    assert c.lease(lease["id"])["state"] == "active" and _calls(fake, proc.pid) == []


def test_a_lock_that_times_out_is_tried_again_then_given_up_for_the_fallback(
    driver: Callable[..., tuple[AgentProcess, FakeCuda]], holders: Callable[..., Holder]
) -> None:
    agent, fake = driver("r570", "--freeze-attempts", "3")
    c, lease, proc = _notebook(agent, holders)
    fake.fail("lock", "CUDA_ERROR_TIMEOUT", pid=proc.pid, once=False)
    with pytest.raises(Exception) as err:
        c.freeze(lease["id"])
    assert "after 3 tries" in str(err.value)
    assert _calls(fake, proc.pid) == ["lock", "lock", "lock"]
    after = c.lease(lease["id"])
    assert after["state"] == "active" and not after["frozen"] and "after 3 tries" in after["fallback"]
    # A lock that times out once, then goes through: frozen at the second try.
    fake.clear_script()
    fake.clear_calls()
    fake.fail("lock", "CUDA_ERROR_TIMEOUT", pid=proc.pid, once=True)
    assert c.freeze(lease["id"])["frozen"]
    assert _calls(fake, proc.pid) == ["lock", "lock", "checkpoint"]


def test_a_checkpoint_the_driver_refuses_leaves_the_kernel_running(
    driver: Callable[..., tuple[AgentProcess, FakeCuda]], holders: Callable[..., Holder]
) -> None:
    agent, fake = driver("r570")
    c, lease, proc = _notebook(agent, holders)
    fake.fail("checkpoint", "CUDA_ERROR_NOT_SUPPORTED", pid=proc.pid)
    with pytest.raises(Exception) as err:
        c.freeze(lease["id"])
    assert "CUDA_ERROR_NOT_SUPPORTED" in str(err.value)
    assert fake.state(proc.pid) == "running" and c.lease(lease["id"])["state"] == "active"


def test_a_thaw_that_fails_restarts_the_kernel_from_its_checkpoint(
    driver: Callable[..., tuple[AgentProcess, FakeCuda]], holders: Callable[..., Holder]
) -> None:
    agent, fake = driver("r570")
    c, lease, proc = _notebook(agent, holders)
    c.freeze(lease["id"])
    _, cursor = c.directives(client="jupyter", after=-1, timeout=0)
    fake.fail("restore", "CUDA_ERROR_OUT_OF_MEMORY", pid=proc.pid, leaves="failed")
    c.unpark(lease["id"])
    wait_for(lambda: c.lease(lease["id"])["state"] == "killed", what="stopped after the thaw")
    killed = next(d for d in _heard(agent, cursor) if d["kind"] == "killed")
    assert killed["cause"] == "thaw_failed" and "CUDA_ERROR_OUT_OF_MEMORY" in killed["reason"]
    wait_for(lambda: not proc.alive(), what="the wedged process ended")
    assert not c.lease(lease["id"])["frozen"]


def test_the_agent_restarted_finds_its_frozen_kernels_by_the_driver_s_state(
    driver: Callable[..., tuple[AgentProcess, FakeCuda]], holders: Callable[..., Holder]
) -> None:
    agent, fake = driver("r570")
    c = agent.client()
    kept, kept_proc = notebook_holding(agent, holders, "512Mi", "1Gi", 20)
    lost, lost_proc = notebook_holding(agent, holders, "512Mi", "1Gi", 20)
    c.freeze(kept["id"])
    c.freeze(lost["id"])
    agent.kill()
    fake.set_state(lost_proc.pid, "failed")  # the driver lost it while the agent was away
    agent.start()
    c = agent.client()
    assert c.lease(kept["id"])["state"] == "parked" and c.lease(kept["id"])["frozen"]
    wait_for(lambda: c.lease(lost["id"])["state"] == "killed", what="the lost one restarted")
    c.unpark(kept["id"])
    wait_for(lambda: c.lease(kept["id"])["state"] == "active", what="the kept one thawed")
    assert fake.state(kept_proc.pid) == "running" and kept_proc.alive()


def test_a_freeze_cut_short_by_an_agent_restart_is_undone(
    driver: Callable[..., tuple[AgentProcess, FakeCuda]], holders: Callable[..., Holder]
) -> None:
    agent, fake = driver("r570")
    c, lease, proc = _notebook(agent, holders)
    fake.delay("checkpoint", 5.0, pid=proc.pid)
    threading.Thread(target=lambda: _ignore(lambda: c.freeze(lease["id"])), daemon=True).start()
    wait_for(lambda: c.lease(lease["id"])["state"] == "freezing", what="the freeze under way")
    agent.kill()
    fake.clear_script()
    wait_for(lambda: fake.state(proc.pid) in ("checkpointed", "locked"), what="the driver done")
    agent.start()
    c = agent.client()
    wait_for(lambda: fake.state(proc.pid) == "running", what="the half-done freeze undone")
    assert c.lease(lease["id"])["state"] == "active" and proc.alive()


def _ignore(call: Callable[[], object]) -> None:
    with contextlib.suppress(Exception):  # the agent it asked was killed under it
        call()


def test_a_kernel_that_exits_mid_freeze_is_let_go(
    driver: Callable[..., tuple[AgentProcess, FakeCuda]], holders: Callable[..., Holder]
) -> None:
    agent, fake = driver("r570", "--orphan-grace", "60")
    c, lease, proc = _notebook(agent, holders)
    fake.delay("checkpoint", 1.0, pid=proc.pid)
    errors: list[str] = []
    thread = threading.Thread(target=lambda: _note(errors, lambda: c.freeze(lease["id"])))
    thread.start()
    wait_for(lambda: c.lease(lease["id"])["state"] == "freezing", what="the freeze under way")
    proc.stop()
    thread.join(30)
    after = c.lease(lease["id"])
    assert not after["frozen"] and after["state"] == "active"
    wait_for(lambda: c.lease(lease["id"])["pids"] == [], what="its dead process forgotten")


def _note(errors: list[str], call: Callable[[], object]) -> None:
    try:
        call()
    except Exception as exc:
        errors.append(str(exc))


def test_two_thaws_at_once_thaw_once(
    driver: Callable[..., tuple[AgentProcess, FakeCuda]], holders: Callable[..., Holder]
) -> None:
    agent, fake = driver("r570")
    c, lease, proc = _notebook(agent, holders)
    c.freeze(lease["id"])
    fake.delay("restore", 0.5, pid=proc.pid)
    results: list[dict[str, Any]] = []
    threads = [threading.Thread(target=lambda: results.append(c.unpark(lease["id"])))
               for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    # Both calls waited for the one thaw and answered it done.
    assert [r["state"] for r in results] == ["active", "active"]
    assert _calls(fake, proc.pid).count("restore") == 1


@pytest.mark.parametrize("variant", ["r580", "r570"])
def test_a_move_thaws_onto_the_other_gpu_where_the_driver_remaps(
    driver: Callable[..., tuple[AgentProcess, FakeCuda]], holders: Callable[..., Holder],
    variant: str,
) -> None:
    """r580 takes pairs of GPU UUIDs at restore: the notebook moves with nothing restarted.
    r570 cannot: its client is asked to move it the old way."""
    agent, fake = driver(variant, "--freeze-remap")
    c = agent.client()
    gpu0, gpu1 = (g["uuid"] for g in c.node()["gpus"])
    a, a_proc = notebook_holding(agent, holders, "0.25", "1", 20)
    b, b_proc = notebook_holding(agent, holders, "0.25", "1", 20)
    moving, proc = (b, b_proc) if b["physical_gpu"] == gpu1 else (a, a_proc)
    _, cursor = c.directives(client="jupyter", after=-1, timeout=0)
    c.create_lease(client="run", kind="job")  # needs GPU 1 whole: the spread notebook goes home
    if variant == "r570":
        said = wait_for(lambda: [d for d in _heard(agent, cursor) if d["kind"] == "migrate"],
                        what="the migrate directive")
        assert said[0]["lease_id"] == moving["id"] and _calls(fake, proc.pid) == []
        return
    moved = wait_for(lambda: (x := c.lease(moving["id"]))["state"] == "active" and x,
                     what="the move by freezing")
    assert moved["physical_gpus"] == [gpu0] and moved["pids"] == [proc.pid] and proc.alive()
    restore = next(c for c in fake.calls(proc.pid) if c.short == "restore")
    assert restore.args == f"gpuPairs={gpu1}>{gpu0}"
    assert _calls(fake, proc.pid) == ["lock", "checkpoint", "restore", "unlock"]
    [said] = [d for d in _heard(agent, cursor) if d["kind"] in ("moved", "migrate")]
    assert said["kind"] == "moved" and (said["from_gpu"], said["to_gpu"]) == (gpu1, gpu0)
    assert "nothing restarted" in said["reason"]
