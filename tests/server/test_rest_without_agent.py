"""Without an agent: REST says so, kernels start without a GPU; the embedded agent fills in."""

from __future__ import annotations

import json
from typing import Any

import pytest

from .conftest import gpufrac_config


@pytest.fixture
def jp_server_config(missing_socket: str, request: pytest.FixtureRequest) -> dict[str, Any]:
    embedded = getattr(request, "param", False)
    return gpufrac_config(missing_socket, embedded_agent=embedded)


async def test_no_agent_is_reported_and_kernels_start(jp_fetch: Any, missing_socket: str) -> None:
    node = json.loads((await jp_fetch("api", "gpufrac", "node")).body)
    assert node["backend"] is None and node["gpus"] == [] and node["leases"] == []
    assert node["agent"]["available"] is False and missing_socket in node["agent"]["error"]

    response = await jp_fetch("api", "kernels", method="POST", body=json.dumps({"name": "python3"}))
    kernel_id = json.loads(response.body)["id"]
    try:
        status = json.loads((await jp_fetch("api", "gpufrac", "kernels", kernel_id)).body)
        assert status["state"] == "no-gpu" and status["gpu"] is None and status["lease"] is None
        assert missing_socket in status["reason"]
        [event] = status["events"]
        assert event["event"] == "no_gpu" and missing_socket in event["message"]
    finally:
        await jp_fetch("api", "kernels", kernel_id, method="DELETE")


@pytest.mark.parametrize("jp_server_config", [True], indirect=True)
async def test_embedded_agent_starts_and_stops(jp_fetch: Any, jp_serverapp: Any) -> None:
    await jp_serverapp.extension_manager.start_all_extensions()
    app = jp_serverapp.web_app.settings["gpufrac_app"]
    try:
        assert app.embedded is not None
        node = json.loads((await jp_fetch("api", "gpufrac", "node")).body)
        assert node["agent"]["embedded"] is True and node["agent"]["available"] is True
        assert node["simulated"] is True and len(node["gpus"]) == 2
        process = app.embedded.process
    finally:
        await app.stop_extension()
    assert process.poll() is not None and app.embedded is None
