"""The node agent's async client as the server's event loop uses it, and the server's name at it."""

from __future__ import annotations

import os
import socket
from collections.abc import Sequence
from typing import Any

from node_agent.client import AgentError, AgentUnavailable, AsyncAgentClient, default_socket_path

__all__ = [
    "AgentError",
    "AgentLink",
    "AgentUnavailable",
    "default_socket_path",
    "server_client_name",
    "server_client_prefix",
]


def server_client_prefix() -> str:
    """What every Jupyter server on this host puts before its pid in its client name."""
    return f"jupyter-server-{socket.gethostname()}-"


def server_client_name() -> str:
    """This server's name at the agent: directives for its kernels are addressed to it."""
    return f"{server_client_prefix()}{os.getpid()}"


class AgentLink(AsyncAgentClient):
    """``AsyncAgentClient`` plus the two calls in the words the server's modules use."""

    async def create_notebook_lease(
        self, *, request: str, limit: str | None, client: str, kernel_id: str, name: str,
        compute_request: str | None = None, compute_limit: str | None = None, devices: int = 1,
        logical_gpus: Sequence[str] | None = None, reachable_gpus: Sequence[str] | None = None,
    ) -> dict[str, Any]:
        """A burstable, movable lease for a kernel (on Kubernetes: where the cluster planned it,
        on the GPUs its container sees)."""
        return await self.create_lease(
            kind="notebook", request=request, limit=limit, client=client, kernel_id=kernel_id,
            name=name, compute_request=compute_request, compute_limit=compute_limit,
            devices=devices, logical_gpus=logical_gpus, reachable_gpus=reachable_gpus,
        )

    async def directives(
        self, *, client: str | None = None, lease: str | None = None, after: int = 0,
        timeout: float = 25.0, wait: float | None = None, kinds: Sequence[str] | None = None,
    ) -> tuple[list[dict[str, Any]], int]:
        """Long-poll directives newer than ``after`` for ``client`` (or ``lease``), waiting up
        to ``wait`` (or ``timeout``) s; returns them and the last seq. Cancelling it closes
        its connection."""
        return await super().directives(
            client=client, lease=lease, after=after, timeout=timeout if wait is None else wait,
            kinds=kinds,
        )
