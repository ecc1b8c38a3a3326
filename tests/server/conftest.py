"""Fixtures for the server-extension tests: pytest-jupyter's server and a real simulated agent."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

# pytest-jupyter ships its fixtures as a module rather than an entry point; importing them
# here keeps them (and their autouse event loop) to this directory.
from pytest_jupyter.jupyter_server import *  # noqa: F403

from harness.agent import AgentProcess


@pytest.fixture(autouse=True)
def fresh_provisioner_factory() -> Iterator[None]:
    """The provisioner factory is a process-wide singleton: let each server configure its own."""
    from jupyter_client.provisioning.factory import KernelProvisionerFactory

    KernelProvisionerFactory.clear_instance()
    yield
    KernelProvisionerFactory.clear_instance()


@pytest.fixture(scope="module")
def agent(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AgentProcess]:
    """One agent on a simulated 2x2GiB node for the module."""
    with AgentProcess(tmp_path_factory.mktemp("agent"), "2x2GiB") as process:
        yield process


@pytest.fixture
def no_leases(agent: AgentProcess) -> Iterator[AgentProcess]:
    """The agent, checked to hold no lease after the test (leases end with their kernels)."""
    yield agent
    leftover = agent.client().leases()
    for lease in leftover:
        agent.client().release(lease["id"])
    assert leftover == []


def gpufrac_config(socket: str, **gpufrac: object) -> dict[str, object]:
    """Server config enabling the extension and the provisioner for every kernel."""
    return {
        "ServerApp": {"jpserver_extensions": {"jupyter_gpufrac": True}},
        "KernelProvisionerFactory": {"default_provisioner_name": "gpufrac-provisioner"},
        "GpuFrac": {"agent_socket": socket, "embedded_agent": False, **gpufrac},
    }


@pytest.fixture
def isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, agent: AgentProcess) -> Path:
    """Stand-alone provisioner settings: the agent's socket and checkpoints under tmp."""
    monkeypatch.setenv("GPUFRAC_AGENT_SOCKET", agent.socket)
    monkeypatch.setenv("JUPYTER_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(tmp_path / "runtime"))
    monkeypatch.delenv("RUNAI_GPU_MEMORY_LIMIT", raising=False)
    return tmp_path


@pytest.fixture
def missing_socket(tmp_path: Path) -> str:
    """A socket path where nothing answers."""
    return str(tmp_path / "nobody" / "agent.sock")
