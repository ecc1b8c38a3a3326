"""A notebook pod on Kubernetes: KAI's share and plan from the downward API, a whole-GPU pod moves it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from harness.agent import AgentProcess, wait_for
from harness.jupyter import Server, running_server
from harness.kubelet import FakeKubelet
from tests.e2e.test_migration import CHECK, STATE, where

pytestmark = pytest.mark.e2e


def pod_files(folder: Path, annotations: dict[str, str]) -> Path:
    """The downward API's files as the kubelet writes them (values quoted as Go quotes them)."""
    folder.mkdir(parents=True)
    (folder / "annotations").write_text("".join(f'{key}="{value}"\n' for key, value in annotations.items()))
    (folder / "name").write_text("jupyter-ada")
    (folder / "namespace").write_text("team-a")
    (folder / "uid").write_text("6f1d2c3a-0000-4000-8000-000000000001")
    return folder


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[tuple[AgentProcess, FakeKubelet, Server, list[str]]]:
    """An agent following a kubelet on a 2-GPU node, and a notebook pod's server that KAI gave
    a quarter of GPU 1 and that sees both GPUs."""
    tmp = tmp_path_factory.mktemp("kubernetes")
    with FakeKubelet(tmp / "kubelet.sock") as kubelet, AgentProcess(
            tmp / "agent", "2x2GiB", ["--poll-interval", "0.2", "--kubelet-socket",
                                      kubelet.socket_path, "--kubelet-interval", "0.2"]) as agent:
        gpus = [gpu["uuid"] for gpu in agent.client().node()["gpus"]]
        podinfo = pod_files(tmp / "podinfo", {
            "gpu-fraction": "0.25", "kai.scheduler/queue": "team-a",
            "hub.jupyter.org/username": "ada \\\"the first\\\""})
        env = {"GPUFRAC_PODINFO": str(podinfo), "GPUFRAC_CONTAINER": "notebook",
               "NVIDIA_VISIBLE_DEVICES": gpus[1], "GPUFRAC_REACHABLE_GPUS": "all"}
        config = ("c.GpuFrac.migrate_grace_period = 3\nc.GpuFrac.lease_poll_interval = 1\n"
                  "c.GpuFrac.default_limit = '1.0'\n")
        with running_server(tmp / "server", agent.socket, config, env=env) as server:
            yield agent, kubelet, server, gpus


def test_a_pod_takes_the_gpu_a_notebook_was_spread_to_and_the_notebook_keeps_its_state(
        cluster: tuple[AgentProcess, FakeKubelet, Server, list[str]]) -> None:
    agent, kubelet, server, gpus = cluster
    nb = server.open_notebook("pod.ipynb")
    before = where(nb.ok(STATE))
    status = server.kernel_status(nb.kernel_id)
    lease: dict[str, Any] = status["lease"]
    # KAI's share and plan: a quarter of a GPU, planned on GPU 1; spread to the idle GPU 0.
    assert status["share_source"]["request"] == "pod annotation gpu-fraction"
    assert lease["request_spec"] == "0.25" and lease["planned_by"] == "cluster"
    assert lease["logical_gpus"] == [gpus[1]] and lease["reachable_gpus"] == []
    assert before[1] == gpus[0] == lease["physical_gpu"]

    # The scheduler gives GPU 0 to a training pod: the kubelet lists it, the notebook goes home.
    kubelet.hold("team-b", "train-7", [gpus[0]])

    def restored() -> dict[str, Any] | None:
        now = server.kernel_status(nb.kernel_id)
        return now if now["events"][-1]["event"] == "restored" else None

    after = wait_for(restored, 90, "the notebook restored after the move", interval=0.2)
    kinds = [event["event"] for event in after["events"]]
    assert kinds[:4] == ["placed", "migrating", "migrated", "restored"], kinds
    assert after["events"][-1]["lost"] == [] and after["gpu"]["uuid"] == gpus[1]
    assert "train-7" in after["events"][1].get("reason", "") + after["events"][1].get("message", "")
    output = nb.ok(CHECK)
    assert where(output)[1] == gpus[1] and where(output)[0] != before[0]
    job = next(lease for lease in agent.client().leases() if lease["planned_by"] == "kubelet")
    assert job["name"] == "team-b/train-7/main" and job["physical_gpus"] == [gpus[0]]

    kubelet.end("train-7")
    wait_for(lambda: not [lease for lease in agent.client().leases()
                          if lease["planned_by"] == "kubelet"], 10, "the pod's lease released")
    nb.close()


def test_a_pinned_notebook_whose_gpu_a_pod_takes_is_parked_and_its_next_cell_waits_for_it(
        cluster: tuple[AgentProcess, FakeKubelet, Server, list[str]], tmp_path: Path) -> None:
    """A container that sees only KAI's GPU: nowhere else to go when a pod is given that GPU.
    The idle kernel is parked with its variables; its next cell waits until the pod ends."""
    agent, kubelet, _, gpus = cluster
    podinfo = pod_files(tmp_path / "podinfo", {"gpu-fraction": "0.25"})
    env = {"GPUFRAC_PODINFO": str(podinfo), "NVIDIA_VISIBLE_DEVICES": gpus[0]}
    with running_server(tmp_path / "server", agent.socket,
                        "c.GpuFrac.lease_poll_interval = 0.5\n", env=env) as server:
        nb = server.open_notebook("pinned.ipynb")
        before = where(nb.ok(STATE))
        lease = server.kernel_status(nb.kernel_id)["lease"]
        assert lease["reachable_gpus"] == lease["logical_gpus"] == [gpus[0]] == [before[1]]
        assert (f"kernel {nb.kernel_id}: in pod team-a/jupyter-ada, container notebook; the "
                f"cluster planned GPUs {gpus[0]}") in server.log_text()

        kubelet.hold("team-e", "render", [gpus[0]])
        wait_for(lambda: "parked" in server.events(nb.kernel_id), 60, "the kernel parked",
                 interval=0.2)
        status = server.kernel_status(nb.kernel_id)
        # Told why, by the event and by the lease the agent holds.
        [event] = [e for e in status["events"] if e["event"] == "parked"]
        assert "team-e/render/main" in event["message"], event
        assert status["state"] == "parked" and "team-e/render/main" in status["lease"]["reason"]
        cell = nb.send(CHECK)
        nb.printed(cell, "waiting for a GPU")
        kubelet.end("render")
        reply = nb.wait(cell, timeout=90)
        assert reply.status == "ok", reply.error
        assert "gpufrac: back on GPU" in reply.stdout and where(reply.stdout)[1] == gpus[0]
        nb.close()
