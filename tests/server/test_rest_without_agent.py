"""Without an agent: REST says so, kernels start without a GPU; the embedded agent fills in."""

from __future__ import annotations

import asyncio
import json
import socket as net
from typing import Any

import pytest
import zmq
from zmq.utils.monitor import parse_monitor_message

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


def closed_port() -> int:
    """A local TCP port nobody listens on (just released)."""
    with net.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


async def test_kernel_sockets_reconnect_within_25_ms(jp_serverapp: Any) -> None:
    # A move restarts a kernel on the same ports while open pages keep their connections:
    # their sockets must find the new process before it has restored and runs a cell.
    sub = jp_serverapp.kernel_manager.context.socket(zmq.SUB)  # as jupyter_client makes them
    monitor = sub.get_monitor_socket(zmq.EVENT_CONNECT_RETRIED)
    try:
        sub.connect(f"tcp://127.0.0.1:{closed_port()}")
        waits = [parse_monitor_message(await asyncio.wait_for(monitor.recv_multipart(), 5))["value"]
                 for _ in range(5)]
    finally:
        sub.disable_monitor()
        monitor.close(0)
        sub.close(0)
    assert waits[0] == 10 and max(waits) == 25, waits  # ms before each retry
