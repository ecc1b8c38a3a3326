"""The agent's freeze path through the real ctypes calls, against the strict stand-in libcuda
built from C, on small real CUDA programs: which calls it makes (with their timeouts and GPU
pairs), retries, fallbacks, what it reads after a failure, and what it finds after its own
restart. The node is simulated; the driver is the stand-in's."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from memory_cgroups import memory_cgroup

from harness.agent import AgentProcess, wait_for
from jupyter_gpufrac.server.embedded_agent import EmbeddedAgent
from node_agent.client import AgentClient, AgentError
from node_agent.devices.simulated import parse_spec, simulated_uuid

from .fake_cuda import FakeCuda, Target
from .fake_nvml import FakeNode, Gpu
from .fake_nvml import build as build_nvml

KINDS = ("migrate", "shrink", "killed", "park", "unparked", "frozen", "moved")
MiB, GiB = 2**20, 2**30


class Node:
    """An agent whose freezer is the driver's, on the stand-in of one driver generation, and
    the CUDA programs its notebooks run."""

    def __init__(self, agent: AgentProcess, fake: FakeCuda, env: dict[str, str]) -> None:
        self.agent, self.fake, self.env = agent, fake, env
        self.targets: list[Target] = []

    def client(self) -> AgentClient:
        return self.agent.client()

    def target(self, gpu: str, **kwargs: Any) -> Target:
        self.targets.append(Target({**self.env, "CUDA_VISIBLE_DEVICES": gpu}, **kwargs))
        return self.targets[-1]

    def notebook(self, request: str = "512Mi", limit: str = "1Gi", mib: int = 20,
                 **kwargs: Any) -> tuple[dict[str, Any], Target]:
        """A notebook lease whose CUDA process holds ``mib`` MiB on its GPU."""
        c = self.client()
        lease = c.create_lease(client="jupyter", request=request, limit=limit)
        kernel = self.target(lease["physical_gpu"], **kwargs)
        lease = c.register_pid(lease["id"], kernel.pid)
        if mib:
            kernel.hold(mib)
        return lease, kernel

    def proven(self) -> dict[str, Any]:
        """The node's freezing once its canary has answered."""
        return wait_for(self._verdict, what="the canary's verdict")

    def _verdict(self) -> dict[str, Any] | None:
        freezing: dict[str, Any] = self.client().node()["freezing"]
        return None if freezing["why"] and "still checking" in freezing["why"] else freezing


@pytest.fixture
def driver(shared_tmp: Path, libraries: dict[str, Path],
           start_agent: Callable[..., AgentProcess]) -> Iterator[Callable[..., Node]]:
    """An agent whose freezer is the driver's, on the stand-in of driver ``variant`` beside a
    simulated node of ``spec``; ``proven``: wait for its canary to pass."""
    nodes: list[Node] = []

    def start(variant: str, *args: str, spec: str = "2x2GiB", proven: bool = True,
              before: Callable[[FakeCuda], None] | None = None) -> Node:
        fake = FakeCuda(shared_tmp / f"cuda-{variant}-{time.monotonic_ns()}")
        fake.gpus([(simulated_uuid(i), b.total - b.reserved, b.context)
                   for i, b in enumerate(parse_spec(spec))])
        if before is not None:
            before(fake)
        env = fake.env(libraries[variant], resident=True)
        node = Node(start_agent("--freezer", "driver", *args, spec=spec, env=env), fake, env)
        nodes.append(node)
        if proven:
            assert node.proven()["available"], node.client().node()["freezing"]
        return node

    yield start
    for node in nodes:
        for t in node.targets:
            t.stop()


def _calls(fake: FakeCuda, pid: int) -> list[str]:
    return [c.short for c in fake.calls(pid) if c.short != "state"]


def _heard(node: Node, cursor: int) -> list[dict[str, Any]]:
    return node.client().directives(client="jupyter", after=cursor, timeout=0, kinds=KINDS)[0]


def _ignore(call: Callable[[], object]) -> None:
    with contextlib.suppress(Exception):  # the agent it asked was killed under it
        call()


# --- the four calls, and the canary ---------------------------------------------------------

def test_park_and_thaw_make_the_four_calls_with_the_lock_timeout(
    driver: Callable[..., Node]
) -> None:
    node = driver("r570", "--freeze-lock-timeout", "2.5")
    c = node.client()
    assert c.node()["freezing"]["available"] and not c.node()["freezing"]["remap"]
    lease, kernel = node.notebook()
    frozen = c.freeze(lease["id"])
    assert frozen["frozen"] and node.fake.state(kernel.pid) == "checkpointed"
    assert _calls(node.fake, kernel.pid) == ["lock", "checkpoint"]
    assert [c.args for c in node.fake.calls(kernel.pid) if c.short == "lock"] == ["timeoutMs=2500"]
    # Its own CUDA calls wait while it is frozen; it runs on.
    kernel.send("check")
    with pytest.raises(TimeoutError):
        kernel.answer(0.3)
    c.unpark(lease["id"])
    wait_for(lambda: c.lease(lease["id"])["state"] == "active", what="thawed")
    assert kernel.answer(10) == "ok" and node.fake.state(kernel.pid) == "running"
    assert _calls(node.fake, kernel.pid) == ["lock", "checkpoint", "restore", "unlock"]


def test_the_agent_proves_freezing_on_a_process_of_its_own_before_it_offers_it(
    driver: Callable[..., Node]
) -> None:
    node = driver("r580")
    leases = {pid for lease in node.client().leases() for pid in lease["pids"]}
    # The canary: a CUDA process of the agent's, frozen and thawed once, then ended.
    canary = {c.pid for c in node.fake.calls() if c.short == "checkpoint"} - leases
    assert len(canary) == 1
    [pid] = canary
    assert _calls(node.fake, pid) == ["lock", "checkpoint", "restore", "unlock"]
    assert [c.result for c in node.fake.calls(pid)] == ["CUDA_SUCCESS"] * len(node.fake.calls(pid))


def test_where_the_canary_fails_freezing_is_off_and_the_cause_and_fix_are_named(
    driver: Callable[..., Node]
) -> None:
    """cuda-checkpoint#25: as root, without persistence mode, the driver refuses and the
    process dies — here the agent's own test process, never a user's kernel."""
    node = driver("r580", proven=False, before=lambda fake: fake.persistence(False))
    freezing = node.proven()
    assert not freezing["available"]
    assert "CUDA_ERROR_NOT_PERMITTED" in freezing["why"]
    assert "persistence mode" in freezing["why"] and "nvidia-smi -pm 1" in freezing["why"]
    lease, kernel = node.notebook()
    with pytest.raises(AgentError) as err:
        node.client().freeze(lease["id"])
    assert err.value.status == 409 and "persistence mode" in err.value.message
    assert _calls(node.fake, kernel.pid) == [] and kernel.alive()


def test_a_driver_without_the_api_parks_and_reclaims_the_old_way_and_says_why(
    driver: Callable[..., Node]
) -> None:
    node = driver("r550", proven=False)
    c = node.client()
    freezing = c.node()["freezing"]
    assert not freezing["available"] and "r570" in freezing["why"]
    lease, kernel = node.notebook()
    with pytest.raises(AgentError) as err:
        c.freeze(lease["id"])
    assert err.value.status == 409 and "r570" in err.value.message
    assert c.lease(lease["id"])["state"] == "active" and _calls(node.fake, kernel.pid) == []


# --- failures, read and acted on ---------------------------------------------------------

def test_a_lock_that_times_out_is_tried_again_then_given_up_for_the_fallback(
    driver: Callable[..., Node]
) -> None:
    node = driver("r570", "--freeze-attempts", "3")
    c = node.client()
    lease, kernel = node.notebook()
    node.fake.fail("lock", "CUDA_ERROR_TIMEOUT", pid=kernel.pid, once=False)
    with pytest.raises(AgentError) as err:
        c.freeze(lease["id"])
    assert "after 3 tries" in err.value.message
    assert _calls(node.fake, kernel.pid) == ["lock", "lock", "lock"]
    after = c.lease(lease["id"])
    assert after["state"] == "active" and not after["frozen"] and "after 3 tries" in after["fallback"]
    # A lock that times out once, then goes through: frozen at the second try.
    node.fake.clear_script()
    node.fake.clear_calls()
    node.fake.fail("lock", "CUDA_ERROR_TIMEOUT", pid=kernel.pid, once=True)
    assert c.freeze(lease["id"])["frozen"]
    assert _calls(node.fake, kernel.pid) == ["lock", "lock", "checkpoint"]


def test_a_checkpoint_the_driver_refuses_is_read_back_and_the_kernel_unlocked(
    driver: Callable[..., Node]
) -> None:
    node = driver("r570")
    c = node.client()
    lease, kernel = node.notebook()
    node.fake.fail("checkpoint", "CUDA_ERROR_NOT_SUPPORTED", pid=kernel.pid)
    with pytest.raises(AgentError) as err:
        c.freeze(lease["id"])
    assert "CUDA_ERROR_NOT_SUPPORTED" in err.value.message and "let run again" in err.value.message
    # The driver left it locked: the agent read that and unlocked it.
    assert _calls(node.fake, kernel.pid) == ["lock", "checkpoint", "unlock"]
    assert node.fake.state(kernel.pid) == "running" and c.lease(lease["id"])["state"] == "active"
    assert kernel.ask("check") == "ok"


def test_a_checkpoint_that_leaves_the_process_failed_restarts_the_kernel_and_says_so(
    driver: Callable[..., Node]
) -> None:
    node = driver("r570")
    c = node.client()
    lease, kernel = node.notebook()
    _, cursor = c.directives(client="jupyter", after=-1, timeout=0)
    node.fake.fail("checkpoint", "CUDA_ERROR_UNKNOWN", pid=kernel.pid, leaves="failed")
    with pytest.raises(AgentError):
        c.freeze(lease["id"])
    killed = wait_for(lambda: [d for d in _heard(node, cursor) if d["kind"] == "killed"],
                      what="the restart")[0]
    assert killed["cause"] == "freeze_failed" and "FAILED" in killed["reason"]
    assert "last good checkpoint" in killed["reason"]
    wait_for(lambda: not kernel.alive(), what="the failed process ended")


def test_a_thaw_that_fails_restarts_the_kernel_from_its_checkpoint(
    driver: Callable[..., Node]
) -> None:
    node = driver("r570")
    c = node.client()
    lease, kernel = node.notebook()
    c.freeze(lease["id"])
    _, cursor = c.directives(client="jupyter", after=-1, timeout=0)
    node.fake.fail("restore", "CUDA_ERROR_UNKNOWN", pid=kernel.pid, leaves="failed")
    c.unpark(lease["id"])
    wait_for(lambda: c.lease(lease["id"])["state"] == "killed", what="stopped after the thaw")
    killed = next(d for d in _heard(node, cursor) if d["kind"] == "killed")
    assert killed["cause"] == "thaw_failed" and "CUDA_ERROR_UNKNOWN" in killed["reason"]
    assert "variables of its last completed cell come back" in killed["reason"]
    wait_for(lambda: not kernel.alive(), what="the process ended")
    assert not c.lease(lease["id"])["frozen"]


def test_a_mismatch_between_the_driver_s_word_and_its_state_is_a_fallback_and_a_metric(
    driver: Callable[..., Node]
) -> None:
    node = driver("r570")
    c = node.client()
    lease, kernel = node.notebook()
    # The checkpoint answers success without acting: the process is still only locked.
    node.fake.fail("checkpoint", "CUDA_SUCCESS", pid=kernel.pid)
    with pytest.raises(AgentError) as err:
        c.freeze(lease["id"])
    assert "after its checkpoint the driver says process" in err.value.message
    assert node.fake.state(kernel.pid) == "running" and kernel.ask("check") == "ok"
    assert c.lease(lease["id"])["state"] == "active"
    assert 'gpufrac_freeze_mismatches_total{cause="freeze"' in c.metrics()
    assert any(line.startswith('gpufrac_freeze_mismatches_total{cause="freeze"') and
               line.endswith(" 1.0") for line in c.metrics().splitlines())


# --- bounded calls ---------------------------------------------------------------------------

def test_a_call_that_does_not_return_turns_freezing_off_while_the_api_answers(
    driver: Callable[..., Node]
) -> None:
    node = driver("r570", "--freeze-call-timeout", "0.5")
    c = node.client()
    lease, kernel = node.notebook()
    other, _ = node.notebook()
    node.fake.hang("checkpoint", pid=kernel.pid)
    errors: list[str] = []
    thread = threading.Thread(target=lambda: _note(errors, lambda: c.freeze(lease["id"])))
    thread.start()
    freezing = wait_for(lambda: (f := c.node()["freezing"])["why"] and "not answered" in f["why"]
                        and f, what="freezing off")
    assert not freezing["available"] and "cuCheckpointProcessCheckpoint" in freezing["why"]
    assert c.lease(other["id"])["state"] == "active"  # the API answers meanwhile
    status = subprocess.run([sys.executable, "-m", "node_agent", "--socket", node.agent.socket,
                             "status"], capture_output=True, text=True, timeout=30, check=False)
    assert "freezing: off (the CUDA driver has not answered" in status.stdout, status.stdout
    with pytest.raises(AgentError) as err:
        c.freeze(other["id"])
    assert "has not answered" in err.value.message
    node.fake.clear_script()  # the call returns: the freeze goes on, freezing is back
    wait_for(lambda: c.lease(lease["id"])["frozen"], what="the freeze done after all")
    wait_for(lambda: c.node()["freezing"]["available"], what="freezing back")
    thread.join(30)


def _note(errors: list[str], call: Callable[[], object]) -> None:
    try:
        call()
    except Exception as exc:
        errors.append(str(exc))


def test_sigterm_waits_for_a_freeze_under_way_then_the_ledger_and_the_driver_agree(
    driver: Callable[..., Node]
) -> None:
    node = driver("r570")
    c = node.client()
    lease, kernel = node.notebook(mib=64)
    node.fake.rate(64 * MiB)  # a copy of about a second
    thread = threading.Thread(target=lambda: _ignore(lambda: c.freeze(lease["id"])))
    thread.start()
    wait_for(lambda: node.fake.state(kernel.pid) == "checkpointing", what="the copy under way")
    assert c.node()["freezing"]["stop_grace"] > 1  # what a supervisor waits for
    node.agent.stop()
    assert node.agent.process is not None and node.agent.process.returncode == 0
    assert node.fake.state(kernel.pid) == "checkpointed"
    node.agent.start()
    after = node.client().lease(lease["id"])
    assert after["frozen"] and after["state"] == "parked"
    thread.join(30)


def test_sigterm_during_a_call_that_hangs_stops_the_agent_within_its_bound(
    driver: Callable[..., Node]
) -> None:
    node = driver("r570", "--freeze-call-timeout", "1")
    c = node.client()
    lease, kernel = node.notebook()
    node.fake.hang("checkpoint", pid=kernel.pid)
    threading.Thread(target=lambda: _ignore(lambda: c.freeze(lease["id"])), daemon=True).start()
    wait_for(lambda: c.lease(lease["id"])["state"] == "freezing", what="the freeze under way")
    process = node.agent.process
    assert process is not None
    process.terminate()
    assert process.wait(20) == 0, "the agent waited past its bound for a call that hangs"
    node.fake.clear_script()


# --- restarts ------------------------------------------------------------------------------

def test_the_agent_restarted_finds_its_frozen_kernels_by_the_driver_s_state(
    driver: Callable[..., Node]
) -> None:
    node = driver("r570")
    c = node.client()
    kept, kept_proc = node.notebook()
    lost, lost_proc = node.notebook()
    c.freeze(kept["id"])
    c.freeze(lost["id"])
    node.agent.kill()
    node.fake.set_state(lost_proc.pid, "failed")  # the driver lost it while the agent was away
    node.agent.start()
    c = node.client()
    assert c.lease(kept["id"])["state"] == "parked" and c.lease(kept["id"])["frozen"]
    wait_for(lambda: c.lease(lost["id"])["state"] == "killed", what="the lost one restarted")
    c.unpark(kept["id"])
    wait_for(lambda: c.lease(kept["id"])["state"] == "active", what="the kept one thawed")
    assert node.fake.state(kept_proc.pid) == "running" and kept_proc.alive()


def test_a_state_the_driver_will_not_say_after_a_restart_is_asked_again_never_read_as_death(
    driver: Callable[..., Node]
) -> None:
    """cuda-checkpoint#37: GetState answered 304 in a restricted container; a cuInit that
    fails says nothing of the frozen state either."""
    node = driver("r570")
    c = node.client()
    lease, kernel = node.notebook()
    c.freeze(lease["id"])
    node.agent.kill()
    node.fake.fail("state", "CUDA_ERROR_OPERATING_SYSTEM", pid=kernel.pid, once=False)
    node.agent.start()
    c = node.client()
    wait_for(lambda: lease["id"] in c.node()["freezing"]["unknown"], what="its state unknown")
    time.sleep(1.5)  # asked again, and again refused: still frozen, never restarted
    still = c.lease(lease["id"])
    assert (still["state"], still["frozen"]) == ("parked", True) and kernel.alive()
    node.fake.clear_script()
    wait_for(lambda: lease["id"] not in c.node()["freezing"]["unknown"], timeout=15,
             what="its state read at last")
    c.unpark(lease["id"])
    wait_for(lambda: c.lease(lease["id"])["state"] == "active", what="thawed")
    assert kernel.ask("check") == "ok"


def test_a_freeze_cut_short_by_an_agent_restart_is_undone(driver: Callable[..., Node]) -> None:
    node = driver("r570")
    c = node.client()
    lease, kernel = node.notebook()
    node.fake.delay("checkpoint", 5.0, pid=kernel.pid)
    threading.Thread(target=lambda: _ignore(lambda: c.freeze(lease["id"])), daemon=True).start()
    wait_for(lambda: node.fake.state(kernel.pid) == "locked", what="the freeze under way")
    node.agent.kill()  # before its checkpoint call
    node.fake.clear_script()
    node.agent.start()
    c = node.client()
    wait_for(lambda: node.fake.state(kernel.pid) == "running", what="the half-done freeze undone")
    assert c.lease(lease["id"])["state"] == "active" and kernel.ask("check") == "ok"


def test_a_kernel_that_exits_mid_freeze_is_let_go(driver: Callable[..., Node]) -> None:
    node = driver("r570", "--orphan-grace", "60")
    c = node.client()
    lease, kernel = node.notebook()
    node.fake.delay("checkpoint", 1.0, pid=kernel.pid)
    thread = threading.Thread(target=lambda: _ignore(lambda: c.freeze(lease["id"])))
    thread.start()
    wait_for(lambda: c.lease(lease["id"])["state"] == "freezing", what="the freeze under way")
    kernel.stop()
    thread.join(30)
    after = c.lease(lease["id"])
    assert not after["frozen"] and after["state"] == "active"
    wait_for(lambda: c.lease(lease["id"])["pids"] == [], what="its dead process forgotten")


def test_two_thaws_at_once_thaw_once(driver: Callable[..., Node]) -> None:
    node = driver("r570")
    c = node.client()
    lease, kernel = node.notebook()
    c.freeze(lease["id"])
    node.fake.delay("restore", 0.5, pid=kernel.pid)
    results: list[dict[str, Any]] = []
    threads = [threading.Thread(target=lambda: results.append(c.unpark(lease["id"])))
               for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    # Both calls waited for the one thaw and answered it done.
    assert [r["state"] for r in results] == ["active", "active"]
    assert _calls(node.fake, kernel.pid).count("restore") == 1


# --- remapping -----------------------------------------------------------------------------

@pytest.mark.parametrize("variant", ["r580", "r570"])
def test_a_move_thaws_onto_the_other_gpu_with_every_gpu_paired_where_the_driver_remaps(
    driver: Callable[..., Node], variant: str,
) -> None:
    """r580 takes GPU pairs at restore, a permutation of every GPU of the node
    (cuda-checkpoint#35): the notebook moves with nothing restarted. r570 cannot: its client
    is asked to move it the old way."""
    node = driver(variant, "--freeze-remap", spec="4x2GiB")
    c = node.client()
    gpus = [g["uuid"] for g in c.node()["gpus"]]
    a, a_proc = node.notebook("0.25", "1")
    b, b_proc = node.notebook("0.25", "1")
    moving, kernel = (b, b_proc) if b["physical_gpu"] != a["logical_gpus"][0] else (a, a_proc)
    home = moving["logical_gpus"][0]
    assert moving["physical_gpu"] != home, "one of the two was spread onto another GPU"
    _, cursor = c.directives(client="jupyter", after=-1, timeout=0)
    c.create_lease(client="run", kind="job")  # needs a GPU whole: the spread notebook goes home
    if variant == "r570":
        said = wait_for(lambda: [d for d in _heard(node, cursor) if d["kind"] == "migrate"],
                        what="the migrate directive")
        assert _calls(node.fake, kernel.pid) == [] and said
        return
    moved = wait_for(lambda: (x := c.lease(moving["id"]))["state"] == "active"
                     and x["physical_gpu"] == home and x, what="the move by freezing")
    assert moved["pids"] == [kernel.pid] and kernel.ask("check") == "ok"
    restore = next(c for c in node.fake.calls(kernel.pid) if c.short == "restore")
    pairs = dict(p.split(">") for p in restore.args.removeprefix("gpuPairs=").split(","))
    assert sorted(pairs) == sorted(gpus) and sorted(pairs.values()) == sorted(gpus)
    assert pairs[moving["physical_gpu"]] == home
    record = node.fake.record(kernel.pid)
    assert record is not None and record.gpu == home
    said = [d for d in _heard(node, cursor) if d["kind"] in ("moved", "migrate")
            and d["lease_id"] == moving["id"]]
    assert [d["kind"] for d in said] == ["moved"] and "nothing restarted" in said[0]["reason"]


# --- what the driver moves, and where it lands ------------------------------------------------

@pytest.fixture(scope="module")
def nvml_library(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_nvml("r550", tmp_path_factory.mktemp("nvml") / "r550")


@pytest.fixture
def nvml_driver(shared_tmp: Path, libraries: dict[str, Path], nvml_library: Path,
                start_agent: Callable[..., AgentProcess]) -> Iterator[Callable[..., Node]]:
    """A node as a real one is: NVML's stand-in lists the stand-in libcuda's processes with
    what they hold on the GPU now (nothing once checkpointed), and device memory is not host
    memory. ``gpus`` GPUs of ``total`` bytes, a CUDA context of ``context``."""
    nodes: list[Node] = []

    def start(*args: str, gpus: int = 1, total: int = 2 * GiB, context: int = 64 * MiB,
              variant: str = "r580") -> Node:
        stamp = time.monotonic_ns()
        fake = FakeCuda(shared_tmp / f"cuda-{stamp}")
        uuids = [simulated_uuid(i) for i in range(gpus)]
        fake.gpus([(u, total, context) for u in uuids])
        nvml = FakeNode(shared_tmp / f"node-{stamp}.txt", gpus=[Gpu(u, total) for u in uuids])
        nvml.write()
        env = {**fake.env(libraries[variant]), **nvml.env(nvml_library),
               "LD_LIBRARY_PATH": f"{nvml_library}:{libraries[variant]}"}
        agent = start_agent("--context-size", str(context), *args, spec=None, env=env)
        node = Node(agent, fake, env)
        nodes.append(node)
        assert node.proven()["available"], node.client().node()["freezing"]
        return node

    yield start
    for node in nodes:
        for t in node.targets:
            t.stop()


def test_what_a_freeze_takes_is_measured_before_the_lock_not_by_a_poll_during_it(
    nvml_driver: Callable[..., Node]
) -> None:
    """NVML stops listing a checkpointed process: a poll during the freeze of a second process
    saw only what was still on the GPU."""
    node = nvml_driver(gpus=1)
    c = node.client()
    lease, first = node.notebook("1Gi", "2Gi", mib=300)
    second = node.target(lease["physical_gpu"])
    second.hold(300)
    c.register_pid(lease["id"], second.pid)
    held = wait_for(lambda: (u := c.lease(lease["id"])["usage"]) >= 2 * (300 + 64) * MiB and u,
                    what="both processes measured")
    node.fake.rate(256 * MiB)  # about a second per process, against a poll every 50 ms
    frozen = c.freeze(lease["id"])
    assert frozen["frozen_bytes"] >= held
    assert [node.fake.state(p.pid) for p in (first, second)] == ["checkpointed"] * 2


def test_a_thaw_waits_until_the_gpu_has_room_for_what_it_froze_and_a_context(
    nvml_driver: Callable[..., Node]
) -> None:
    node = nvml_driver(gpus=1, context=256 * MiB)
    c = node.client()
    lease, kernel = node.notebook("512Mi", "1Gi", mib=512)
    frozen = c.freeze(lease["id"])
    assert frozen["frozen_bytes"] >= 768 * MiB
    # Another notebook grows while it is frozen: the GPU keeps less free than the frozen
    # memory and a context.
    _, grower = node.notebook("256Mi", "2Gi", mib=900)
    wait_for(lambda: c.node()["gpus"][0]["memory_free"] < frozen["frozen_bytes"] + 256 * MiB,
             what="the GPU filled")
    waiting = c.unpark(lease["id"])
    assert waiting["state"] == "pending" and "with a CUDA context" in waiting["reason"]
    time.sleep(0.3)  # polls: still no restore tried
    assert "restore" not in _calls(node.fake, kernel.pid)
    grower.ask("free")
    wait_for(lambda: c.lease(lease["id"])["state"] == "active", what="thawed once room came")
    assert kernel.ask("check") == "ok"


def test_a_restore_out_of_memory_waits_then_a_wedged_process_restarts_and_says_what_came_back(
    nvml_driver: Callable[..., Node]
) -> None:
    """cuda-checkpoint#44: a restore that runs out of memory leaves the process CHECKPOINTED;
    the agent waits for room and tries again; the driver refuses again (304), so the kernel
    restarts from its durable checkpoint."""
    node = nvml_driver(gpus=1)
    c = node.client()
    lease, kernel = node.notebook("512Mi", "1Gi", mib=256)
    c.freeze(lease["id"])
    _, cursor = c.directives(client="jupyter", after=-1, timeout=0)
    node.fake.fill(lease["physical_gpu"], 2 * GiB - 128 * MiB)  # nothing NVML lists
    waiting = c.unpark(lease["id"])
    waiting = wait_for(lambda: (x := c.lease(lease["id"]))["state"] == "pending" and x,
                       what="the thaw waiting")
    assert "ran out of GPU memory" in waiting["reason"] and waiting["frozen"]
    assert kernel.alive() and node.fake.state(kernel.pid) == "checkpointed"
    node.fake.fill(lease["physical_gpu"], 0)
    killed = wait_for(lambda: [d for d in _heard(node, cursor) if d["kind"] == "killed"],
                      what="the restart")[0]
    assert killed["cause"] == "thaw_failed" and "#44" in killed["reason"]
    assert "variables of its last completed cell come back" in killed["reason"]
    wait_for(lambda: not kernel.alive(), what="the wedged process ended")
    assert [c.short for c in node.fake.calls(kernel.pid) if c.short == "restore"] == [
        "restore", "restore"]


def test_a_kernel_whose_memory_cgroup_cannot_take_its_gpu_memory_is_not_frozen(
    nvml_driver: Callable[..., Node]
) -> None:
    """The driver copies the GPU memory into the process: its cgroup pays, and below its limit
    the OOM killer would end the kernel mid-freeze. Refused instead, named, alive."""
    node = nvml_driver(gpus=1)
    c = node.client()
    lease = c.create_lease(client="jupyter", request="512Mi", limit="1Gi")
    with memory_cgroup(450 * MiB) as cgroup:
        kernel = node.target(lease["physical_gpu"], preexec=cgroup.preexec)
        try:
            c.register_pid(lease["id"], kernel.pid)
            assert kernel.ask("host 150") == "ok"
            kernel.hold(300)
            wait_for(lambda: c.lease(lease["id"])["usage"] >= 300 * MiB, what="measured")
            with pytest.raises(AgentError) as err:
                c.freeze(lease["id"])
            message = err.value.message
            assert "its memory limit of 450.0 MiB leaves" in message
            assert "less than the 364.0 MiB it holds on the GPU" in message
            assert kernel.alive() and _calls(node.fake, kernel.pid) == []
            assert c.lease(lease["id"])["fallback"] == message
        finally:
            kernel.stop()


def test_a_kernel_in_a_pid_namespace_of_its_own_is_not_frozen(driver: Callable[..., Node]) -> None:
    """cuda-checkpoint#41 (NOTES): the driver acts only on processes of the caller's PID
    namespace."""
    node = driver("r580")
    c = node.client()
    lease = c.create_lease(client="jupyter", request="512Mi", limit="1Gi")
    try:
        kernel = node.target(lease["physical_gpu"], prefix=["unshare", "--pid", "--fork"])
    except AssertionError as exc:
        pytest.skip(f"no PID namespace for a test process here: {exc}")
    c.register_pid(lease["id"], kernel.pid)
    with pytest.raises(AgentError) as err:
        c.freeze(lease["id"])
    assert "another PID namespace" in err.value.message
    assert _calls(node.fake, kernel.pid) == []


# --- the process, pinned ------------------------------------------------------------------

def _reuse_pid(pid: int, start: Callable[[], Target]) -> Target:
    """A new process with ``pid``, which another process had (root may choose the next pid)."""
    for _ in range(200):
        with open("/proc/sys/kernel/ns_last_pid", "w") as f:
            f.write(str(pid - 1))
        probe = subprocess.Popen(["sleep", "60"])
        if probe.pid == pid:
            probe.kill()
            probe.wait()
            with open("/proc/sys/kernel/ns_last_pid", "w") as f:
                f.write(str(pid - 1))
            target = start()
            if target.pid == pid:
                return target
            target.stop()
        else:
            probe.kill()
            probe.wait()
    pytest.skip(f"pid {pid} could not be had again (other processes took it)")


def test_a_pid_reused_between_a_poll_and_a_freeze_is_never_frozen(
    driver: Callable[..., Node]
) -> None:
    """#36: freeze and thaw acted on bare pid numbers; a kill pins the process (pidfd and
    start time), and so do they now."""
    if os.geteuid() != 0:
        pytest.skip("choosing the next pid needs root")
    node = driver("r580", "--poll-interval", "60")
    c = node.client()
    lease, kernel = node.notebook()
    pid = kernel.pid
    kernel.stop()  # ended; the agent has not polled since
    stranger = _reuse_pid(pid, lambda: node.target(lease["physical_gpu"]))
    stranger.hold(8)
    with pytest.raises(AgentError) as err:
        c.freeze(lease["id"])
    assert "gone" in err.value.message
    assert node.fake.state(stranger.pid) == "running" and _calls(node.fake, pid) == []
    assert stranger.ask("check") == "ok"


def test_the_embedded_agent_s_supervisor_waits_for_a_freeze_under_way(
    driver: Callable[..., Node]
) -> None:
    """The server SIGKILLed its agent 5 s after SIGTERM, less than a freeze of a few GiB takes:
    it now waits as long as the agent says its freeze may still take."""
    node = driver("r570")
    c = node.client()
    lease, kernel = node.notebook(mib=96)
    node.fake.rate(16 * MiB)  # a copy of six seconds
    threading.Thread(target=lambda: _ignore(lambda: c.freeze(lease["id"])), daemon=True).start()
    wait_for(lambda: node.fake.state(kernel.pid) == "checkpointing", what="the copy under way")
    supervisor = EmbeddedAgent(node.agent.socket, str(node.agent.state_dir), "",
                               logging.getLogger("test"))
    supervisor.process = node.agent.process
    asyncio.run(supervisor.stop())
    assert node.agent.process is not None and node.agent.process.returncode == 0
    assert node.fake.state(kernel.pid) == "checkpointed"


def test_a_driver_that_failed_to_start_is_asked_again_off_the_loop(
    driver: Callable[..., Node]
) -> None:
    """A transient cuInit failure says nothing for good: freezing is off, then on, and the
    node view never waits for the driver."""
    node = driver("r580", proven=False,
                  before=lambda fake: fake.fail("init", "CUDA_ERROR_NO_DEVICE", once=False))
    c = node.client()
    freezing = wait_for(lambda: (f := c.node()["freezing"])["why"]
                        and "cuInit failed" in f["why"] and f, what="the failed cuInit said")
    assert not freezing["available"] and "CUDA_ERROR_NO_DEVICE" in freezing["why"]
    node.fake.clear_script()
    assert wait_for(lambda: c.node()["freezing"]["available"], timeout=30,
                    what="the driver asked again, and the canary passed")
