"""A kernel's GPU state between launches: restart reasons, the restarter's clock, the share."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest

from jupyter_gpufrac import contract
from jupyter_gpufrac.server.kernels import KernelGpu
from jupyter_gpufrac.server.settings import standalone_settings

LOG = logging.getLogger("test")


@pytest.fixture
def gpu(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> KernelGpu:
    # Nobody answers at this socket: what these tests check never asks the agent.
    monkeypatch.setenv("GPUFRAC_AGENT_SOCKET", str(tmp_path / "agent.sock"))
    settings = standalone_settings(LOG)
    return KernelGpu("k-1", {}, lambda: settings, LOG)


def test_a_death_the_agent_did_not_announce_restores_and_an_announced_one_keeps_its_reason(
    gpu: KernelGpu,
) -> None:
    gpu.lease = {"id": "l-1", "physical_gpu": "GPU-a"}
    gpu.restarter_restarted()
    assert gpu.restore_pending and gpu.restarter_restarts == 1
    gpu.cancel_restore()
    killed = {"cause": contract.CAUSE_OOM_KILLED, "message": "reclaimed"}
    gpu.request_restore(killed)
    gpu.restarter_restarted()  # the restarter came second: the agent's reason stands
    assert gpu.restarter_restarts == 2
    # The next launch takes the reason (without an agent it keeps no lease, so no reason).
    assert asyncio.run(gpu.prepare_launch({})) is False
    assert not gpu.restore_pending and gpu.lease is not None
    assert gpu.last_launch_reason == killed


def test_a_kernel_that_reported_its_restore_is_stable_until_its_next_launch(
    gpu: KernelGpu,
) -> None:
    assert gpu.stable_start_time(10.0) == 3.0  # not yet: a death soon after start is a crash
    asyncio.run(gpu.restored())
    assert gpu.stable_start_time(10.0) == 0.0
    asyncio.run(gpu.launched(None))  # a new process: it has reported nothing yet
    assert gpu.stable_start_time(2.0) == 2.0


def test_only_a_share_unlike_the_one_asked_for_counts_as_the_users_change(
    gpu: KernelGpu,
) -> None:
    assert not gpu.changed_share("0.5", None)  # a lease made by an earlier server process
    gpu.asked_share, gpu.share_source = ("0.25", "1"), {"request": "c.GpuFrac", "limit": None}
    assert not gpu.changed_share("0.25", "1")
    assert gpu.share_source == {"request": "c.GpuFrac", "limit": None}
    assert gpu.changed_share("2GiB", None)
    assert gpu.asked_share == ("2GiB", None)
    assert gpu.share_source == {"request": contract.SOURCE_MAGIC, "limit": contract.SOURCE_MAGIC}
    assert not gpu.changed_share("2GiB", None)  # heard twice: one change


def test_labels_name_gpus_by_index_and_unknown_ones_by_uuid(gpu: KernelGpu) -> None:
    gpu.gpus = {"GPU-a": {"uuid": "GPU-a", "index": 1}}
    gpu.lease = {"id": "l-1", "state": "active", "physical_gpus": ["GPU-a"]}
    assert (gpu.label("GPU-a"), gpu.label("GPU-z"), gpu.label(None)) == ("GPU 1", "GPU-z", "no GPU")
    assert gpu.index("GPU-a") == 1 and gpu.index("GPU-z") is None
    assert gpu.where() == {"gpu_uuid": "GPU-a", "gpu_index": 1}


def test_only_an_idle_kernel_with_our_extension_and_an_active_lease_is_parked(
    gpu: KernelGpu,
) -> None:
    # A kernel of another language never answers the park question: trying would hold its
    # directives back for the whole wait.
    gpu.lease, gpu.launches = {"id": "l-1", "state": "active"}, 1
    assert gpu.parkable(now=100.0, wait=10.0)
    gpu.hooked = False
    assert not gpu.parkable(now=100.0, wait=10.0)
    gpu.hooked = True
    for state in ("parked", "pending", "migrating", "shrinking", "killed"):
        gpu.lease = {"id": "l-1", "state": state}
        assert not gpu.parkable(now=100.0, wait=10.0), state
    gpu.lease, gpu.park_refused = {"id": "l-1", "state": "active"}, 95.0
    assert not gpu.parkable(now=100.0, wait=10.0)  # refused lately: not again so soon
    assert gpu.parkable(now=106.0, wait=10.0)

