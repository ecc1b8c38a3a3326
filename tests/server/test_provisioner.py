"""The provisioner's launch arguments and environment, across restarts, with real kernels."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import pytest
from jupyter_client.ioloop import AsyncIOLoopKernelManager, AsyncIOLoopKernelRestarter
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import AsyncKernelManager

from harness.agent import AgentProcess
from jupyter_gpufrac.server.launch import EXT_ARGUMENT, build_kernel_env, kernel_arguments
from jupyter_gpufrac.server.provisioner import GpuFracProvisioner
from jupyter_gpufrac.server.settings import standalone_settings

LEASE = {
    "id": "l-1", "request": 100, "limit": 200, "state": "active",
    "physical_gpus": ["GPU-b"], "target_gpus": [],
}
GPUS = {"GPU-b": {"uuid": "GPU-b", "index": 1, "name": "Sim", "memory_total": 1000}}


def test_arguments_are_a_new_list_with_the_extension_once() -> None:
    given = ["--foo", EXT_ARGUMENT]
    built = kernel_arguments(given, load_extension=True)
    assert built == ["--foo", EXT_ARGUMENT] and built is not given
    assert kernel_arguments(built, load_extension=True) == ["--foo", EXT_ARGUMENT]
    assert kernel_arguments(["--foo"], load_extension=False) == ["--foo"]
    assert given == ["--foo", EXT_ARGUMENT]


def test_env_is_new_and_drops_what_an_earlier_launch_set() -> None:
    base = {"PATH": "/bin", "GPUFRAC_RESTORE": "1", "GPUFRAC_LEASE_ID": "l-old"}
    env = build_kernel_env(
        base, kernel_id="k", socket_path="/s", checkpoint_dir="/c", lease=LEASE, gpus=GPUS,
        simulated=True, restart_reason=None, hide_gpus=False,
    )
    assert base["GPUFRAC_RESTORE"] == "1"  # the caller's dict is untouched
    assert "GPUFRAC_RESTORE" not in env
    assert env["CUDA_VISIBLE_DEVICES"] == "GPU-b"
    assert [env["GPUFRAC_LEASE_ID"], env["GPUFRAC_REQUEST"], env["GPUFRAC_LIMIT"]] == ["l-1", "100", "200"]
    gpu = [env["GPUFRAC_GPU_INDEX"], env["GPUFRAC_GPU_TOTAL"], env["GPUFRAC_SIMULATED"]]
    assert gpu == ["1", "1000", "1"]


def test_env_while_migrating_points_at_the_target() -> None:
    moving = {**LEASE, "state": "migrating", "target_gpus": ["GPU-c"]}
    reason = {"cause": "migrated", "message": "m", "from_gpu": "GPU-b", "to_gpu": "GPU-c"}
    env = build_kernel_env(
        {}, kernel_id="k", socket_path="/s", checkpoint_dir="/c", lease=moving, gpus=GPUS,
        simulated=False, restart_reason=reason, hide_gpus=False,
    )
    assert env["CUDA_VISIBLE_DEVICES"] == "GPU-c"
    assert env["GPUFRAC_RESTORE"] == "1"
    assert json.loads(env["GPUFRAC_RESTART_REASON"]) == reason
    assert "GPUFRAC_SIMULATED" not in env


@pytest.mark.parametrize(("hide", "expected"), [(True, ""), (False, "GPU-parent")])
def test_env_without_lease(hide: bool, expected: str) -> None:
    env = build_kernel_env(
        {"CUDA_VISIBLE_DEVICES": "GPU-parent"}, kernel_id="k", socket_path="/s",
        checkpoint_dir="/c", lease=None, gpus={}, simulated=False, restart_reason=None,
        hide_gpus=hide,
    )
    assert env["CUDA_VISIBLE_DEVICES"] == expected
    assert "GPUFRAC_LEASE_ID" not in env


# -- real kernels, a real agent -------------------------------------------------------------


def write_kernelspec(root: Path, metadata: dict[str, object]) -> KernelSpecManager:
    """An ipykernel kernelspec that names our provisioner itself (no server config needed)."""
    spec_dir = root / "kernels" / "gpu-python"
    spec_dir.mkdir(parents=True)
    spec = {
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "Python (GPU)",
        "language": "python",
        "metadata": {"kernel_provisioner": {"provisioner_name": "gpufrac-provisioner"}, **metadata},
    }
    (spec_dir / "kernel.json").write_text(json.dumps(spec))
    return KernelSpecManager(kernel_dirs=[str(root / "kernels")])


def process_view(pid: int) -> tuple[list[str], dict[str, str]]:
    """A live process's command line and environment, as the kernel sees them."""
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")[:-1]
    items = Path(f"/proc/{pid}/environ").read_bytes().decode().split("\0")
    env = dict(item.split("=", 1) for item in items if "=" in item)
    return argv, env


async def test_lease_env_and_arguments_across_restarts(isolated: Path, no_leases: AgentProcess) -> None:
    ksm = write_kernelspec(isolated, {"gpufrac": {"request": "0.25", "limit": "0.5",
                                                  "gpu-compute-request": "0.4"}})
    km = AsyncKernelManager(kernel_name="gpu-python", kernel_spec_manager=ksm)
    await km.start_kernel()
    try:
        provisioner = km.provisioner
        assert isinstance(provisioner, GpuFracProvisioner)
        lease = no_leases.client().lease(provisioner.gpu.lease["id"])
        assert lease["kernel_id"] == km.kernel_id and lease["request_spec"] == "0.25"
        assert (lease["compute_request"], lease["compute_limit"]) == (0.4, 0.4)
        assert lease["pids"] == [provisioner.pid]
        gpu = lease["physical_gpu"]
        for launch in range(3):
            argv, env = process_view(provisioner.pid)
            assert argv.count(EXT_ARGUMENT) == 1, argv
            assert env["CUDA_VISIBLE_DEVICES"] == gpu
            assert env["GPUFRAC_LEASE_ID"] == lease["id"]
            assert env["GPUFRAC_REQUEST"] == str(lease["request"])
            assert env["GPUFRAC_KERNEL_ID"] == km.kernel_id
            assert env["GPUFRAC_SIMULATED"] == "1"
            assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "40"
            checkpoint_dir = Path(env["GPUFRAC_CHECKPOINT_DIR"])
            assert checkpoint_dir.is_dir() and checkpoint_dir.stat().st_mode & 0o777 == 0o700
            if launch == 1:
                # The restart asked for by the server restores; the user's next one does not.
                assert env["GPUFRAC_RESTORE"] == "1"
                assert json.loads(env["GPUFRAC_RESTART_REASON"])["cause"] == "oom_killed"
            else:
                assert "GPUFRAC_RESTORE" not in env and "GPUFRAC_RESTART_REASON" not in env
            if launch == 0:
                provisioner.gpu.request_restore({"cause": "oom_killed", "message": "test"})
            await km.restart_kernel(now=True)
            # The lease is kept across restarts: same id, the new pid registered.
            assert provisioner.gpu.lease["id"] == lease["id"]
            assert no_leases.client().lease(lease["id"])["pids"] == [provisioner.pid]
        assert provisioner.gpu.launches == 4
    finally:
        await km.shutdown_kernel(now=True)
    assert provisioner.gpu.lease is None  # released: the no_leases fixture checks the agent


async def test_kernel_starts_without_agent(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    socket = str(tmp_path / "nobody" / "agent.sock")
    monkeypatch.setenv("GPUFRAC_AGENT_SOCKET", socket)
    monkeypatch.setenv("JUPYTER_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(tmp_path / "runtime"))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-untouched")
    ksm = write_kernelspec(tmp_path, {})
    km = AsyncKernelManager(kernel_name="gpu-python", kernel_spec_manager=ksm)
    await km.start_kernel()
    try:
        provisioner = km.provisioner
        assert isinstance(provisioner, GpuFracProvisioner)
        assert provisioner.gpu.lease is None
        assert socket in (provisioner.gpu.no_gpu_reason or "")
        _, env = process_view(provisioner.pid)
        # Nothing is managed on this node: the kernel keeps whatever GPUs it was given.
        assert env["CUDA_VISIBLE_DEVICES"] == "GPU-untouched"
        assert "GPUFRAC_LEASE_ID" not in env
        client = km.client()
        client.start_channels()
        await client.wait_for_ready(timeout=60)
        reply = await client.execute("1 + 1", reply=True, timeout=60)
        assert reply["content"]["status"] == "ok"
        client.stop_channels()
    finally:
        await km.shutdown_kernel(now=True)


async def test_request_the_agent_refuses_fails_clearly(isolated: Path, no_leases: AgentProcess) -> None:
    ksm = write_kernelspec(isolated, {"gpufrac": {"request": "64Gi"}})
    km = AsyncKernelManager(kernel_name="gpu-python", kernel_spec_manager=ksm)
    with pytest.raises(ValueError, match=r"GPU request .* refused by the agent: .*more than one GPU"):
        await km.start_kernel()


async def test_full_node_starts_the_kernel_without_gpus(isolated: Path, no_leases: AgentProcess) -> None:
    client = no_leases.client()
    jobs = [client.create_lease(client="test", kind="job", request="1") for _ in range(2)]
    ksm = write_kernelspec(isolated, {})
    km = AsyncKernelManager(kernel_name="gpu-python", kernel_spec_manager=ksm)
    try:
        await km.start_kernel()
        provisioner = km.provisioner
        assert isinstance(provisioner, GpuFracProvisioner)
        assert provisioner.gpu.lease is None
        reason = provisioner.gpu.no_gpu_reason or ""
        assert ("The agent had no room for this kernel's request of 0.25 (512.0 MiB) (from "
                "the c.GpuFrac default): no GPU has room") in reason, reason
        _, env = process_view(provisioner.pid)
        # The kernel is told why, in the same words (its %gpu says them).
        assert env["GPUFRAC_NO_LEASE_REASON"] == reason
        # The GPUs are leased to others: the kernel must not use them.
        assert env["CUDA_VISIBLE_DEVICES"] == ""
        await km.shutdown_kernel(now=True)
    finally:
        for job in jobs:
            client.release(job["id"])


async def test_a_kernel_shut_down_never_takes_a_lease_again(
    isolated: Path, no_leases: AgentProcess
) -> None:
    """The server's watch gives a GPU to kernels without one; a kernel being shut down looks
    like one (its lease is already given back) and must not get a lease nobody releases."""
    ksm = write_kernelspec(isolated, {"gpufrac": {"request": "0.25"}})
    km = AsyncKernelManager(kernel_name="gpu-python", kernel_spec_manager=ksm)
    await km.start_kernel()
    provisioner = km.provisioner
    assert isinstance(provisioner, GpuFracProvisioner) and provisioner.gpu.lease is not None
    await km.shutdown_kernel(now=True)
    assert provisioner.gpu.lease is None and provisioner.gpu.closed
    assert await provisioner.gpu.acquire_lease() is None
    assert no_leases.client().leases() == []


class CustomRestarter(AsyncIOLoopKernelRestarter):
    """A site's own restarter class, which the provisioner must keep."""


@pytest.mark.parametrize("configured", [None, CustomRestarter])
async def test_the_kernels_restarter_hands_itself_to_the_provisioner(
        isolated: Path, no_leases: AgentProcess, configured: type | None) -> None:
    ksm = write_kernelspec(isolated, {"gpufrac": {"request": "0.25"}})
    km = AsyncIOLoopKernelManager(kernel_name="gpu-python", kernel_spec_manager=ksm,
                                  **({"restarter_class": configured} if configured else {}))
    await km.start_kernel()
    try:
        provisioner = km.provisioner
        assert isinstance(provisioner, GpuFracProvisioner)
        # The manager starts its restarter with the kernel; it made itself known.
        restarter = provisioner.restarter
        assert restarter is not None and restarter.kernel_manager is km
        assert isinstance(restarter, configured or AsyncIOLoopKernelRestarter)
        # A restore lets it look at once: it sees the kernel alive, and restarts nothing.
        await provisioner.gpu.restored()
        await km.restart_kernel(now=True)
        assert provisioner.restarter is restarter and await km.is_alive()
    finally:
        km.stop_restarter()
        await km.shutdown_kernel(now=True)


async def _cell(km: AsyncKernelManager, code: str) -> str:
    """Run one cell in the kernel; what it printed (stdout and stderr)."""
    client = km.client()
    client.start_channels()
    try:
        await client.wait_for_ready(timeout=60)
        printed: list[str] = []

        def keep(msg: dict[str, object]) -> None:
            content = msg["content"]
            if msg["msg_type"] == "stream" and isinstance(content, dict):
                printed.append(str(content["text"]))

        await client.execute_interactive(code, output_hook=keep, timeout=60)
        return "".join(printed)
    finally:
        client.stop_channels()


async def test_no_room_for_a_remembered_request_is_said_as_such(
        isolated: Path, no_leases: AgentProcess) -> None:
    """The remembered request is named as the reason (never the provisioner), and can be
    changed or forgotten from the kernel that got no GPU."""
    client = no_leases.client()
    # One GPU held whole, a third of the other: 0.9 fits nowhere, 0.25 would.
    fillers = [client.create_lease(client="test", kind="job", request="1"),
               client.create_lease(client="test", kind="notebook", request="0.3")]
    settings = standalone_settings(logging.getLogger("test"))
    remembered = Path(settings.remembered_request_path)
    remembered.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    remembered.write_text(json.dumps({"request": "0.9", "limit": None}))
    km = AsyncKernelManager(kernel_name="gpu-python",
                            kernel_spec_manager=write_kernelspec(isolated, {}))
    try:
        await km.start_kernel()
        provisioner = km.provisioner
        assert isinstance(provisioner, GpuFracProvisioner) and provisioner.gpu.lease is None
        said = ("The agent had no room for your remembered request of 0.9 (1.8 GiB): no GPU has "
                "room")
        assert (provisioner.gpu.no_gpu_reason or "").startswith(said), provisioner.gpu.no_gpu_reason
        status = await _cell(km, "%gpu")
        assert status.startswith(f"gpufrac: no GPU lease. {said}"), status
        assert "`%gpu request --reset` or a smaller `%gpu request`" in status
        assert "provisioner" not in status
        smaller = await _cell(km, "%gpu request 0.25")
        assert smaller.startswith("gpufrac: request 0.25 kept for new notebooks in this "
                                  "environment; `%gpu request --reset` forgets it. This kernel "
                                  "has no GPU lease yet"), smaller
        assert json.loads(remembered.read_text()) == {"request": "0.25", "limit": None}
        forgot = await _cell(km, "%gpu request --reset")
        assert forgot == ("gpufrac: forgot your remembered request: new notebooks in this "
                          "environment get the default share (request 0.25, limit 1) unless "
                          "their kernelspec names one; this kernel, which has no GPU lease yet, "
                          "asks for it too.\n"), forgot
        assert not remembered.exists()
    finally:
        await km.shutdown_kernel(now=True)
        for lease in fillers:
            client.release(lease["id"])
