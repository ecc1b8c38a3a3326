"""The node agent's client as the kernel makes it: a deadline on every call, imported late."""

from __future__ import annotations

from typing import Any

AGENT_CALL_TIMEOUT = 5.0


def make_client(socket_path: str | None, timeout: float = AGENT_CALL_TIMEOUT) -> Any:
    """An ``AgentClient``; imported late so the kernel works where the agent package is absent."""
    from node_agent.client import AgentClient

    return AgentClient(socket_path, timeout=timeout)
