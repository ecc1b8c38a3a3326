"""REST and events of the extension in a real jupyter_server (pytest-jupyter), real agent."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from tornado.httpclient import HTTPClientError

from harness.agent import AgentProcess
from jupyter_gpufrac.contract import EVENT_SCHEMA_ID as SCHEMA_ID

from .conftest import gpufrac_config


@pytest.fixture
def jp_server_config(agent: AgentProcess) -> dict[str, Any]:
    return gpufrac_config(agent.socket)


async def get_json(jp_fetch: Any, *path: str) -> Any:
    response = await jp_fetch(*path)
    assert response.code == 200
    return json.loads(response.body)


async def test_node_lists_gpus_and_agent(jp_fetch: Any, agent: AgentProcess) -> None:
    node = await get_json(jp_fetch, "api", "gpufrac", "node")
    assert node["simulated"] is True and node["backend"] == "simulated"
    assert node["agent"] == {"socket": agent.socket, "embedded": False, "available": True, "error": None}
    assert node["config_problems"] == []
    assert node["freezing"] == {"available": True, "why": None}
    assert [gpu["index"] for gpu in node["gpus"]] == [0, 1]
    gpu = node["gpus"][0]
    assert gpu["memory_total"] == 2 * 2**30 and gpu["simulated"] is True and gpu["leases"] == []


async def test_node_lists_a_lease_of_the_users_other_server(
        jp_fetch: Any, no_leases: AgentProcess) -> None:
    """Finding 9: a user with two Jupyter servers got a 404 from /api/gpufrac/node: one holds
    a lease for a kernel the other does not know."""
    client = no_leases.client()
    other = client.create_lease(client="jupyter-server-other", kernel_id="not-one-of-ours",
                                request="0.25")
    try:
        node = await get_json(jp_fetch, "api", "gpufrac", "node")
        assert [lease["id"] for lease in node["leases"]] == [other["id"]], node
        assert "account" not in node["leases"][0]  # not this server's kernel
    finally:
        client.release(other["id"])


async def test_kernel_status_and_events(jp_fetch: Any, jp_serverapp: Any, no_leases: AgentProcess) -> None:
    heard: list[dict[str, Any]] = []

    async def listener(logger: Any, schema_id: str, data: dict[str, Any]) -> None:
        heard.append(data)

    jp_serverapp.event_logger.add_listener(schema_id=SCHEMA_ID, listener=listener)
    response = await jp_fetch("api", "kernels", method="POST", body=json.dumps({"name": "python3"}))
    kernel_id = json.loads(response.body)["id"]
    try:
        status = await get_json(jp_fetch, "api", "gpufrac", "kernels", kernel_id)
        assert status["kernel_id"] == kernel_id
        assert status["state"] == "guaranteed" and status["reason"] is None
        lease = status["lease"]
        assert lease["kernel_id"] == kernel_id and lease["state"] == "active"
        assert status["gpu"]["uuid"] == lease["physical_gpu"] and status["gpu"]["simulated"] is True
        assert (status["request"], status["limit"]) == (2**30 // 2, 2 * 2**30)  # 0.25 and 1 of 2GiB
        assert status["share_source"] == {"request": "c.GpuFrac", "limit": "c.GpuFrac"}
        [placed] = status["events"]
        assert placed["event"] == "placed" and placed["gpu_index"] == status["gpu"]["index"]
        assert "guaranteed" in placed["message"]
        for _ in range(50):  # listeners run as tasks on the loop
            if heard:
                break
            await asyncio.sleep(0.02)
        assert heard and heard[0]["event"] == "placed" and heard[0]["kernel_id"] == kernel_id

        node = await get_json(jp_fetch, "api", "gpufrac", "node")
        assert [lease["id"] for lease in node["leases"]] == [lease["id"]]
        on_gpu = next(gpu for gpu in node["gpus"] if gpu["uuid"] == lease["physical_gpu"])
        assert on_gpu["leases"] == [lease["id"]]
        # One account of the kernel: the node's lease carries what the kernel view says.
        assert status["last_event"] == {key: placed[key] for key in ("event", "message", "time")}
        account = node["leases"][0]["account"]
        for key in ("state", "gpu", "request", "limit", "share_source", "last_event"):
            assert account[key] == status[key], key
    finally:
        await jp_fetch("api", "kernels", kernel_id, method="DELETE")


async def test_unknown_kernel_is_404(jp_fetch: Any) -> None:
    with pytest.raises(HTTPClientError) as info:
        await jp_fetch("api", "gpufrac", "kernels", "no-such-kernel")
    assert info.value.code == 404
    assert "no-such-kernel" in json.loads(info.value.response.body)["error"]


async def test_needs_authentication(http_server_client: Any, jp_base_url: str) -> None:
    with pytest.raises(HTTPClientError) as info:
        await http_server_client.fetch(f"{jp_base_url}api/gpufrac/node")
    assert info.value.code == 403
