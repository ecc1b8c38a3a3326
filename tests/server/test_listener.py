"""The directive listener survives the agent going away and coming back."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support import AgentProcess

from .conftest import gpufrac_config


@pytest.fixture
def own_agent(tmp_path: Path) -> Iterator[AgentProcess]:
    """An agent this test may stop and start again (same socket, same state)."""
    with AgentProcess(tmp_path / "agent", "2x2GiB") as agent:
        yield agent


@pytest.fixture
def jp_server_config(own_agent: AgentProcess) -> dict[str, Any]:
    return gpufrac_config(own_agent.socket)


async def until(check: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


async def test_listener_reconnects_after_agent_restart(
    jp_serverapp: Any, own_agent: AgentProcess
) -> None:
    await jp_serverapp.extension_manager.start_all_extensions()
    app = jp_serverapp.web_app.settings["gpufrac_app"]
    listener = app.listener
    await until(lambda: listener.connected, 10, "the listener to connect")
    own_agent.stop()
    # The long poll fails at once (connection reset) or at the next attempt.
    await until(lambda: not listener.connected, 40, "the listener to notice the agent is gone")
    own_agent.start()
    try:
        await until(lambda: listener.connected, 20, "the listener to reconnect")
    finally:
        await app.stop_extension()
