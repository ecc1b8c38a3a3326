"""The kubelet's sync: a pod given a notebook's GPU moves the notebook off or asks it to park;
on a pod's GPU nothing else is guaranteed; what waited for that GPU is placed anew."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from pathlib import Path

import pytest

from harness.agent import AgentProcess, wait_for
from harness.kubelet import FakeKubelet
from node_agent.devices.simulated import SimulatedBackend
from node_agent.kubelet.claims import WholeGpus
from node_agent.ledger import Ledger
from node_agent.quantities import parse_quantity
from node_agent.service import Agent, AgentConfig, Caller, Conflict, CreateLease
from tests.agent.conftest import Holder, pods_leases


def test_a_pod_on_a_notebooks_gpu_moves_the_notebook_home(
        k8s_agent: AgentProcess, kubelet: FakeKubelet, holders: Callable[..., Holder]) -> None:
    c = k8s_agent.client()
    # A burstable notebook planned (binpack) beside another on GPU 0, spread onto an idle GPU.
    c.register_pid(c.create_lease(client="jupyter", request="1Gi")["id"], holders().pid)
    lease = c.create_lease(client="jupyter", request="1Gi", limit="3Gi")
    c.register_pid(lease["id"], holders().pid)
    assert lease["logical_gpu"] != lease["physical_gpu"]
    _, cursor = c.directives(client="jupyter", after=-1, timeout=0)

    kubelet.hold("team-a", "train-0", [lease["physical_gpu"]])
    job = wait_for(lambda: pods_leases(k8s_agent).get("team-a/train-0/main"), 10, "the pod's lease")
    assert job["kind"] == "job" and job["state"] == "active"
    assert job["physical_gpus"] == job["logical_gpus"] == [lease["physical_gpu"]]
    assert "team-a/train-0/main" in job["reason"]
    found, cursor = c.directives(client="jupyter", after=cursor, timeout=10)
    [move] = [d for d in found if d["kind"] == "migrate"]
    assert move["lease_id"] == lease["id"] and move["to_gpu"] == lease["logical_gpu"]
    assert "train-0" in move["reason"]
    assert c.migrated(lease["id"])["physical_gpu"] == lease["logical_gpu"]

    # Seen again and again while it runs: one lease, nothing asked twice.
    seen = kubelet.lists
    wait_for(lambda: kubelet.lists >= seen + 5, 10, "more looks at the kubelet")
    assert len(pods_leases(k8s_agent)) == 1
    assert [d for d in c.directives(client="jupyter", after=cursor, timeout=0)[0]
            if d["kind"] == "migrate"] == []

    kubelet.end("train-0")
    wait_for(lambda: not pods_leases(k8s_agent), 10, "the pod's lease to be released")


def test_a_notebook_planned_on_the_pods_gpu_is_planned_elsewhere_and_moves(
        k8s_agent: AgentProcess, kubelet: FakeKubelet, holders: Callable[..., Holder]) -> None:
    c = k8s_agent.client()
    # Not burstable: it runs where it is planned, so the pod takes its logical GPU.
    lease = c.create_lease(client="jupyter", request="2Gi", limit="2Gi")
    c.register_pid(lease["id"], holders().pid)
    gpu = lease["physical_gpu"]
    assert lease["logical_gpu"] == gpu
    _, cursor = c.directives(client="jupyter", after=-1, timeout=0)

    kubelet.hold("team-b", "finetune", [gpu])
    found, _ = c.directives(client="jupyter", after=cursor, timeout=10)
    [move] = [d for d in found if d["kind"] == "migrate"]
    assert move["from_gpu"] == gpu and move["to_gpu"] != gpu
    moved = c.lease(lease["id"])
    assert moved["logical_gpu"] == move["to_gpu"] and moved["state"] == "migrating"


def test_a_notebook_with_nowhere_to_go_is_asked_to_park(
        k8s_agent: AgentProcess, kubelet: FakeKubelet, holders: Callable[..., Holder]) -> None:
    c = k8s_agent.client()
    gpus = [gpu["uuid"] for gpu in c.node()["gpus"]]
    # Its container sees one GPU only: the one a whole-GPU pod is then given.
    lease = c.create_lease(client="jupyter", request="1Gi", reachable_gpus=[gpus[2]],
                           logical_gpus=[gpus[2]])
    c.register_pid(lease["id"], holders().pid)
    _, cursor = c.directives(client="jupyter", after=-1, timeout=0)
    kubelet.hold("team-d", "train", [gpus[2]])
    found, _ = c.directives(client="jupyter", after=cursor, timeout=10, kinds=["migrate", "park"])
    [park] = [d for d in found if d["kind"] == "park"]
    assert park["lease_id"] == lease["id"] and "team-d/train/main" in park["reason"]
    assert not [d for d in found if d["kind"] == "migrate"]
    assert "1 notebook(s) asked to park" in k8s_agent.log_text()
    # Asked once, not at every look at the kubelet.
    seen = kubelet.lists
    wait_for(lambda: kubelet.lists >= seen + 3, 10, "more looks at the kubelet")
    assert c.directives(client="jupyter", after=cursor, timeout=0, kinds=["park"])[0] == [park]
    # Parked, it holds nothing; it waits there (the cluster's plan) until the pod ends.
    assert c.park(lease["id"])["physical_gpus"] == []
    assert c.unpark(lease["id"])["state"] == "pending"
    kubelet.end("train")
    wait_for(lambda: c.lease(lease["id"])["state"] == "active", 10, "the notebook placed again")


def test_on_a_pods_gpu_nothing_else_is_guaranteed_and_the_pod_is_never_stopped(
        tmp_path: Path, holders: Callable[..., Holder]) -> None:
    """In process, on a simulated node of two GPU sizes, with real processes holding memory:
    a pod given both GPUs gets each whole; a notebook its container pins to one of them is
    asked to park, and once the pod needs the memory it is shrunk, then stopped and parked,
    while the pod's own process, holding more than the small GPU has, is left alone."""
    me = Caller(uid=os.getuid())
    ledger = Ledger(tmp_path / "state")
    agent = Agent(SimulatedBackend("1x1GiB,1x2GiB"), ledger, AgentConfig(reclaim_grace=0))
    try:
        asyncio.run(agent.tick())
        small, big = (gpu.uuid for gpu in agent.gpus)
        quarter = parse_quantity("256Mi", "request")
        nb = agent.create_lease(me, CreateLease(kind="notebook", client="jupyter", request=quarter,
                                                limit=quarter, logical=(big,), reach=(big,)))
        kernel = holders()
        agent.register_pid(me, nb.id, kernel.pid)
        kernel.hold(100)

        agent.sync_cluster({"ns/train/main": WholeGpus("ns", "train", "main", (small, big))})
        pods = {lease.logical[0]: lease for lease in agent.ledger.leases.values()
                if lease.planned_by == "kubelet"}
        assert {uuid: lease.request for uuid, lease in pods.items()} == {
            small: agent.gpu(small).memory_usable, big: agent.gpu(big).memory_usable}
        [park] = [d for d in agent.ledger.directives_after(0) if d.kind == "park"]
        assert park.lease_id == nb.id and "ns/train/main" in park.body["reason"]
        with pytest.raises(Conflict):  # the pod holds both GPUs whole: no room for anyone
            agent.create_lease(me, CreateLease(kind="notebook", client="jupyter",
                                               request=quarter, limit=quarter))

        trainer = holders()
        agent.backend.track(trainer.pid, big)
        trainer.hold(1900)  # more than the small GPU holds: the pod's, all of it
        for _ in range(3):
            asyncio.run(agent.tick())
        stopped = agent.ledger.leases[nb.id]
        assert stopped.state == "parked" and stopped.physical == ()
        assert kernel.proc.wait(timeout=10) == -9
        assert "ns/train/main" in stopped.reason and "none of it is guaranteed" in stopped.reason
        assert [d.kind for d in agent.ledger.directives_after(0) if d.lease_id == nb.id] == [
            "park", "shrink", "killed"]
        assert trainer.alive() and all(lease.state == "active" for lease in pods.values())
        # Its next cell waits for the pod to end, on the GPU the cluster planned it on.
        assert agent.unpark(me, nb.id).state == "pending"
        agent.sync_cluster({})
        asyncio.run(agent.tick())
        assert agent.ledger.leases[nb.id].state == "active"
    finally:
        ledger.close()


def test_what_waited_for_a_pods_gpu_is_placed_anew_and_a_move_on_its_way_is_left_alone(
        tmp_path: Path, holders: Callable[..., Holder]) -> None:
    me = Caller(uid=os.getuid())
    ledger = Ledger(tmp_path / "state")
    agent = Agent(SimulatedBackend("3x1GiB"), ledger)
    try:
        asyncio.run(agent.tick())
        gpus = [gpu.uuid for gpu in agent.gpus]
        half = parse_quantity("0.5", "request")

        def notebook(limit: str) -> str:
            lease = agent.create_lease(me, CreateLease(kind="notebook", client="jupyter",
                                                       request=half,
                                                       limit=parse_quantity(limit, "limit")))
            agent.register_pid(me, lease.id, holders().pid)
            return lease.id

        notebook("0.5")  # runs where it is planned: GPU 0
        spread = notebook("1")  # planned beside it, spread to GPU 1
        assert agent.ledger.leases[spread].physical == (gpus[1],)
        whole = parse_quantity("1", "request")
        job = agent.create_lease(me, CreateLease(kind="job", client="run", request=whole,
                                                 limit=whole))
        assert (job.state, job.physical) == ("pending", (gpus[1],))
        assert agent.ledger.leases[spread].state == "migrating"

        agent.sync_cluster({"ns/p/main": WholeGpus("ns", "p", "main", (gpus[1],))})
        asyncio.run(agent.tick())
        placed = agent.ledger.leases[job.id]
        assert (placed.state, placed.physical, placed.logical) == ("active", (gpus[2],), (gpus[2],))
        moving = agent.ledger.leases[spread]
        assert (moving.state, moving.target) == ("migrating", (gpus[0],))
        assert [d.kind for d in agent.ledger.directives_after(0)
                if d.lease_id == spread] == ["migrate"]
    finally:
        ledger.close()
