"""A bad c.GpuFrac setting: one clear line in the log and the widget, the extension still up."""

from __future__ import annotations

import json
from typing import Any

import pytest

from harness.agent import AgentProcess

from .conftest import gpufrac_config

PROBLEM = "c.GpuFrac.default_request: expected a share of one GPU: a fraction 0 < f <= 1"


@pytest.fixture
def jp_server_config(agent: AgentProcess) -> dict[str, Any]:
    return gpufrac_config(agent.socket, default_request="lots")


async def test_a_bad_setting_is_said_once_and_kernels_run_without_a_lease(
    jp_fetch: Any, jp_serverapp: Any, no_leases: AgentProcess
) -> None:
    node = json.loads((await jp_fetch("api", "gpufrac", "node")).body)
    [problem] = node["config_problems"]
    assert problem.startswith(PROBLEM) and "'lots'" in problem
    assert node["agent"]["available"] is True and len(node["gpus"]) == 2  # the rest works
    response = await jp_fetch("api", "kernels", method="POST", body=json.dumps({"name": "python3"}))
    kernel_id = json.loads(response.body)["id"]
    try:
        status = json.loads((await jp_fetch("api", "gpufrac", "kernels", kernel_id)).body)
        assert status["state"] == "no-gpu" and status["lease"] is None
        assert PROBLEM in status["reason"] and "restart the server" in status["reason"]
        assert no_leases.client().leases() == []  # no share from a default nobody chose
    finally:
        await jp_fetch("api", "kernels", kernel_id, method="DELETE")


def test_the_log_says_it_in_one_line(capfd: pytest.CaptureFixture[str]) -> None:
    from traitlets.config import Config

    from jupyter_gpufrac.server.app import GpuFrac

    app = GpuFrac(config=Config({"GpuFrac": {"default_request": "lots", "lease_poll_interval": -1}}))
    err = capfd.readouterr().err
    said = [line for line in err.splitlines() if "c.GpuFrac." in line]
    assert len(said) == 2 and "Traceback" not in err, err  # one line each, no traceback wall
    assert "kernels start without a GPU lease until it is fixed" in said[0]
    assert app.lease_poll_interval == 5.0 and len(app.config_problems) == 2
