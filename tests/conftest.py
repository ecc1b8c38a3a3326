"""What every test shares: the machine's own GPU agent is none of the tests' business."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from node_agent import client
from node_agent.cli import command


@pytest.fixture(autouse=True)
def no_system_agent(monkeypatch: pytest.MonkeyPatch,
                    tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Root's system agent (the README's set-up for shared machines) answers at
    /run/gpufrac/agent.sock on some test machines; every default then would name it. The
    tests see a system socket of their own instead, where nothing answers until a test
    puts something there; the path is yielded."""
    path = str(tmp_path_factory.getbasetemp() / "system-agent" / "agent.sock")
    for module in (client, command):
        monkeypatch.setattr(module, "SYSTEM_SOCKET", path)
    yield path
