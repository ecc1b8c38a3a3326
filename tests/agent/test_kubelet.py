"""The agent on Kubernetes: a real PodResources server (from the kubelet's .proto) drives job leases."""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from harness.agent import AgentProcess, wait_for
from harness.kubelet import GPU, FakeKubelet, compiled
from node_agent.client import AgentError
from node_agent.kubelet.cgroups import PodContainer, containers_by_id, pod_of_cgroup
from node_agent.kubelet.podresources import KubeletError, PodResourcesClient, container_devices
from tests.agent.conftest import Holder, pods_leases


def test_the_agent_reads_what_protoc_serialises() -> None:
    """The agent's own messages read the published .proto's wire format, skipping what it does
    not use (CPUs, memory, topology)."""
    pb, _ = compiled()
    answer = pb.ListPodResourcesResponse(pod_resources=[
        pb.PodResources(name="train-0", namespace="team-a", containers=[
            pb.ContainerResources(name="main", cpu_ids=[3], devices=[
                pb.ContainerDevices(resource_name=GPU, device_ids=["GPU-a", "GPU-b"],
                                    topology=pb.TopologyInfo(nodes=[pb.NUMANode(ID=1)])),
                pb.ContainerDevices(resource_name="example.com/nic", device_ids=["nic0"])],
                dynamic_resources=[pb.DynamicResource(claim_name="c", claim_resources=[
                    pb.ClaimResource(driver_name="gpu.nvidia.com", device_name="gpu-0")])]),
            pb.ContainerResources(name="sidecar")])])
    listed = container_devices(answer.SerializeToString())
    assert [(d.namespace, d.pod, d.container, d.resource, d.device_ids) for d in listed] == [
        ("team-a", "train-0", "main", GPU, ("GPU-a", "GPU-b")),
        ("team-a", "train-0", "main", "example.com/nic", ("nic0",))]


def test_a_missing_kubelet_is_an_error_that_says_where(tmp_path: Path) -> None:
    async def ask() -> None:
        client = PodResourcesClient(str(tmp_path / "none.sock"), timeout=2)
        try:
            await client.list_devices()
        finally:
            await client.close()

    with pytest.raises(KubeletError, match=str(tmp_path / "none.sock")):
        asyncio.run(ask())


def test_devices_named_by_index_and_mig_devices(
        k8s_agent: AgentProcess, kubelet: FakeKubelet) -> None:
    node = k8s_agent.client().node()
    by_index = {gpu["index"]: gpu["uuid"] for gpu in node["gpus"]}
    kubelet.set_pods([{"namespace": "ns", "name": "two", "containers": [
        {"name": "main", "devices": {GPU: ["1", "2"]}}]},
        {"namespace": "ns", "name": "mig", "containers": [
            {"name": "main", "devices": {GPU: ["MIG-0b9a1c55-0000-4a5e-9d3f-000000000000"]}}]},
        {"namespace": "ns", "name": "nic", "containers": [
            {"name": "main", "devices": {"example.com/nic": ["0"]}}]},
        {"namespace": "ns", "name": "odd", "containers": [
            {"name": "main", "devices": {GPU: ["\u00b2"]}}]}])

    def two() -> list[dict[str, Any]] | None:
        found = [lease for lease in k8s_agent.client().leases() if lease["name"] == "ns/two/main"]
        return found if len(found) == 2 else None

    # One lease per GPU, each as large as its GPU.
    jobs = wait_for(two, 10, "the pod's leases")
    assert sorted(job["logical_gpu"] for job in jobs) == [by_index[1], by_index[2]]
    assert all(job["devices"] == 1 and job["physical_gpus"] == job["logical_gpus"] for job in jobs)
    assert set(pods_leases(k8s_agent)) == {"ns/two/main"}
    wait_for(lambda: "MIG-0b9a1c55" in k8s_agent.log_text(), 10, "the MIG device in the log")


def test_pods_leases_outlive_a_kubelet_restart_and_an_agent_restart(
        k8s_agent: AgentProcess, kubelet: FakeKubelet) -> None:
    gpu = k8s_agent.client().node()["gpus"][3]["uuid"]
    kubelet.hold("ns", "long", [gpu])
    job = wait_for(lambda: pods_leases(k8s_agent).get("ns/long/main"), 10, "the pod's lease")
    kubelet.stop()  # a kubelet restart: nobody can say the pod ended
    wait_for(lambda: "cannot ask the kubelet" in k8s_agent.log_text(), 10, "the warning")
    k8s_agent.stop()
    k8s_agent.start()
    assert pods_leases(k8s_agent)["ns/long/main"]["id"] == job["id"]
    kubelet.start()
    wait_for(lambda: "the kubelet answers again" in k8s_agent.log_text(), 10, "the kubelet back")
    assert pods_leases(k8s_agent)["ns/long/main"]["id"] == job["id"]
    # The pod was gone while nobody could see: released at the first look.
    kubelet.end("long")
    wait_for(lambda: not pods_leases(k8s_agent), 10, "the lease released")


def test_the_clusters_plan_is_taken_where_it_has_room(k8s_agent: AgentProcess) -> None:
    c = k8s_agent.client()
    gpus = [gpu["uuid"] for gpu in c.node()["gpus"]]
    # KAI put the notebook on GPU 2; its container sees GPUs 2 and 3 only.
    lease = c.create_lease(client="jupyter", request="1Gi", limit="3Gi", logical_gpus=[gpus[2]],
                           reachable_gpus=[gpus[2], gpus[3]])
    assert lease["logical_gpus"] == [gpus[2]] and lease["planned_by"] == "cluster"
    assert lease["physical_gpu"] in (gpus[2], gpus[3])
    assert lease["reachable_gpus"] == [gpus[2], gpus[3]]
    pinned = c.create_lease(client="jupyter", request="1Gi", limit="3Gi", logical_gpus=[gpus[1]],
                            reachable_gpus=[gpus[1]])
    assert pinned["physical_gpus"] == [gpus[1]]  # it cannot be spread where it cannot see

    for body, field in (
        ({"logical_gpus": ["GPU-nope"]}, "logical_gpus"),
        ({"logical_gpus": [gpus[0], gpus[1]]}, "logical_gpus"),  # one device asked
        ({"logical_gpus": [gpus[0]], "reachable_gpus": [gpus[1]]}, "reachable_gpus"),
        ({"logical_gpus": []}, "logical_gpus"),
        ({"reachable_gpus": [gpus[0], gpus[0]]}, "reachable_gpus"),
        ({"logical_gpus": gpus[0]}, "logical_gpus"),
    ):
        with pytest.raises(AgentError) as refused:
            c.create_lease(client="jupyter", request="1Gi", **body)
        assert refused.value.status == 400 and refused.value.field == field, refused.value
    # KAI's plan where this node's plan has no room: refused, not over-promised.
    c.create_lease(client="jupyter", request="3Gi", limit="3Gi", logical_gpus=[gpus[0]])
    with pytest.raises(AgentError) as full:
        c.create_lease(client="jupyter", request="2Gi", logical_gpus=[gpus[0]])
    assert full.value.status == 409 and full.value.field == "logical_gpus"
    assert "no room" in str(full.value)


def test_a_pid_is_read_in_the_callers_pid_namespace(k8s_agent: AgentProcess, shared_tmp: Path
                                                    ) -> None:
    """A kernel in a pod is numbered in the pod's PID namespace: the agent finds it there, and
    nothing outside that namespace."""
    lease = k8s_agent.client().create_lease(client="jupyter", request="1Gi")
    script = shared_tmp / "register.py"
    script.write_text(
        "import json, subprocess, sys\n"
        "from node_agent.client import AgentClient, AgentError\n"
        "child = subprocess.Popen(['sleep', '120'])\n"
        "c = AgentClient(sys.argv[1])\n"
        "out = {'child': child.pid, 'registered': c.register_pid(sys.argv[2], child.pid)['pids']}\n"
        "try:\n"
        "    c.register_pid(sys.argv[2], int(sys.argv[3]))\n"
        "except AgentError as e:\n"
        "    out['refused'] = [e.status, e.field, str(e)]\n"
        "print(json.dumps(out), flush=True)\n"
        "sys.stdin.read()\n"
        "child.kill()\n")
    outside = subprocess.Popen(["sleep", "120"])  # a process of this namespace, not the pod's
    inside = subprocess.Popen(
        ["unshare", "--pid", "--fork", "--mount-proc", sys.executable, str(script),
         k8s_agent.socket, lease["id"], str(outside.pid)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        cwd=Path(__file__).resolve().parents[2])
    try:
        assert inside.stdout is not None and inside.stderr is not None
        line = inside.stdout.readline()
        if not line:
            error = inside.stderr.read()
            if "Operation not permitted" in error:
                pytest.skip("no new PID namespace here (not root)")
            raise AssertionError(error)
        out = json.loads(line)
        [registered] = out["registered"]
        # Inside it is a small number; here another, the same process (NSpid lists both).
        assert out["child"] < 10 and registered != out["child"]
        nspid = next(line.split()[1:] for line in
                     Path(f"/proc/{registered}/status").read_text().splitlines()
                     if line.startswith("NSpid:"))
        assert nspid == [str(registered), str(out["child"])]
        assert out["refused"][:2] == [400, "pid"] and "PID namespace" in out["refused"][2]
    finally:
        inside.communicate("", timeout=30)
        outside.kill()
        outside.wait()


UID = "6f1d2c3a-0000-4000-8000-00000000c0de"
CID = "0123456789abcdef" * 4


@pytest.mark.parametrize("cgroup", [
    # cgroup v1, cgroupfs driver
    f"11:pids:/kubepods/burstable/pod{UID}/{CID}\n1:name=systemd:/kubepods/burstable/pod{UID}/{CID}",
    # cgroup v2, systemd driver, containerd
    f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID.replace('-', '_')}"
    f".slice/cri-containerd-{CID}.scope",
    # read from inside the agent's own cgroup namespace: relative, with ..
    f"0::/../../kubepods-besteffort-pod{UID.replace('-', '_')}.slice/crio-{CID}.scope",
    # guaranteed QoS (no class level), docker
    f"0::/kubepods.slice/kubepods-pod{UID.replace('-', '_')}.slice/docker-{CID}.scope",
])
def test_the_pod_and_container_of_a_cgroup(cgroup: str) -> None:
    assert pod_of_cgroup(cgroup) == (UID, CID)


def test_outside_a_pod_there_is_none() -> None:
    assert pod_of_cgroup("0::/user.slice/user-1000.slice/session-3.scope") is None
    assert pod_of_cgroup("0::/\n") is None
    assert pod_of_cgroup(f"0::/kubepods.slice/kubepods-pod{UID.replace('-', '_')}.slice") == (UID, "")


def test_containers_by_the_kubelets_log_links() -> None:
    names = [f"jupyter-ada_team-a_notebook-{CID}.log", f"train-7_team-b_main-{'f' * 64}.log",
             "not-a-log.txt", f"odd_name_with_more_parts-{CID}.log", "short_ns_c-123.log"]
    assert containers_by_id(names) == {
        CID: PodContainer("team-a", "jupyter-ada", "notebook"),
        "f" * 64: PodContainer("team-b", "train-7", "main")}


def _kubepods_cgroup() -> Path | None:
    """A cgroup named as the kubelet names a container's, or None where none can be made."""
    for root in (Path("/sys/fs/cgroup/pids"), Path("/sys/fs/cgroup/unified"), Path("/sys/fs/cgroup")):
        if (root / "cgroup.procs").exists():
            path = root / "kubepods" / "burstable" / f"pod{UID}" / CID
            try:
                path.mkdir(parents=True, exist_ok=True)
            except OSError:
                continue
            return path
    return None


def test_metrics_and_status_name_the_pod_container_of_a_lease(
        start_agent: Callable[..., AgentProcess], shared_tmp: Path,
        holders: Callable[..., Holder]) -> None:
    cgroup = _kubepods_cgroup()
    if cgroup is None:
        pytest.skip("no cgroup can be made here (not root)")
    logs = shared_tmp / "containers"
    logs.mkdir()
    (logs / f"jupyter-ada_team-a_notebook-{CID}.log").write_text("")
    agent = start_agent("--container-logs", str(logs), spec="2x4GiB")
    c = agent.client()
    holder = holders()
    try:
        try:
            (cgroup / "cgroup.procs").write_text(str(holder.pid))
        except OSError as exc:
            pytest.skip(f"cannot move a process into a cgroup here ({exc})")
        lease = c.create_lease(client="jupyter", request="1Gi")
        lease = c.register_pid(lease["id"], holder.pid)
        assert lease["pod"] == {"namespace": "team-a", "name": "jupyter-ada", "container": "notebook"}
        [state] = [line for line in c.metrics().splitlines()
                   if line.startswith("gpufrac_lease_state{") and f'lease="{lease["id"]}"' in line
                   and 'gpufrac_lease_state="active"' in line]
        for label in ('namespace="team-a"', 'pod="jupyter-ada"', 'container="notebook"'):
            assert label in state, state
        status = subprocess.run([sys.executable, "-m", "node_agent", "--socket", agent.socket,
                                 "status"], capture_output=True, text=True, timeout=30)
        assert "team-a/jupyter-ada/notebook" in status.stdout, status.stdout
    finally:
        holder.stop()
        for path in (cgroup, cgroup.parent, cgroup.parent.parent, cgroup.parent.parent.parent):
            with contextlib.suppress(OSError):
                path.rmdir()


def test_a_parked_notebook_keeps_the_clusters_plan(
        k8s_agent: AgentProcess, holders: Callable[..., Holder]) -> None:
    c = k8s_agent.client()
    gpus = [gpu["uuid"] for gpu in c.node()["gpus"]]
    lease = c.create_lease(client="jupyter", request="1Gi", limit="2Gi", logical_gpus=[gpus[3]])
    c.register_pid(lease["id"], holders().pid)
    parked = c.park(lease["id"])
    # KAI still counts it on GPU 3: so does this node's plan, and nobody else is promised it.
    assert parked["state"] == "parked" and parked["physical_gpus"] == []
    assert parked["logical_gpus"] == [gpus[3]]
    c.create_lease(client="jupyter", request="3Gi", limit="3Gi", logical_gpus=[gpus[2]])
    with pytest.raises(AgentError) as full:
        c.create_lease(client="jupyter", request="3.5Gi", logical_gpus=[gpus[3]])
    assert full.value.field == "logical_gpus"
    back = c.unpark(lease["id"])
    assert back["state"] == "active" and back["logical_gpus"] == [gpus[3]]


def test_a_lease_that_sees_some_gpus_is_planned_among_them(k8s_agent: AgentProcess) -> None:
    c = k8s_agent.client()
    gpus = [gpu["uuid"] for gpu in c.node()["gpus"]]
    pinned = c.create_lease(client="jupyter", request="1Gi", reachable_gpus=[gpus[2]])
    burst = c.create_lease(client="jupyter", request="1Gi", limit="3Gi",
                           reachable_gpus=[gpus[1], gpus[3]])
    assert pinned["logical_gpus"] == pinned["physical_gpus"] == [gpus[2]]
    assert {*burst["logical_gpus"], *burst["physical_gpus"]} <= {gpus[1], gpus[3]}
    with pytest.raises(AgentError) as few:
        c.create_lease(client="jupyter", request="1Gi", devices=2, reachable_gpus=[gpus[0]])
    assert few.value.status == 400 and few.value.field == "reachable_gpus"


