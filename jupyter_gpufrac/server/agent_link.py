"""Async access to the node agent for code on the server's event loop (its client blocks)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from node_agent.client import AgentClient, AgentError, AgentUnavailable, default_socket_path

T = TypeVar("T")

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


class AgentLink:
    """The agent's API as coroutines; each blocking call runs in a worker thread."""

    def __init__(self, socket_path: str, timeout: float = 10.0) -> None:
        self.socket_path = socket_path
        self._timeout = timeout

    def _client(self, timeout: float | None = None) -> AgentClient:
        # A client per call: calls run in several threads at once (a long poll and a launch).
        return AgentClient(self.socket_path, timeout=timeout or self._timeout)

    async def _run(self, method: str, *args: Any, timeout: float | None = None, **kwargs: Any) -> Any:
        def call() -> Any:
            return getattr(self._client(timeout), method)(*args, **kwargs)

        return await asyncio.to_thread(call)

    async def node(self) -> dict[str, Any]:
        """``GET /v1/node``."""
        result: dict[str, Any] = await self._run("node")
        return result

    async def leases(self) -> list[dict[str, Any]]:
        """This user's leases."""
        result: list[dict[str, Any]] = await self._run("leases")
        return result

    async def lease(self, lease_id: str) -> dict[str, Any]:
        """One lease."""
        result: dict[str, Any] = await self._run("lease", lease_id)
        return result

    async def create_notebook_lease(
        self, *, request: str, limit: str | None, client: str, kernel_id: str, name: str,
        compute_request: str | None = None, compute_limit: str | None = None,
    ) -> dict[str, Any]:
        """A burstable, movable lease for a kernel."""
        result: dict[str, Any] = await self._run(
            "create_lease",
            kind="notebook",
            request=request,
            limit=limit,
            client=client,
            kernel_id=kernel_id,
            name=name,
            compute_request=compute_request,
            compute_limit=compute_limit,
        )
        return result

    async def release(self, lease_id: str) -> None:
        """Give the lease back."""
        await self._run("release", lease_id)

    async def register_pid(self, lease_id: str, pid: int) -> dict[str, Any]:
        """Tell the agent which process holds the lease's memory."""
        result: dict[str, Any] = await self._run("register_pid", lease_id, pid)
        return result

    async def migrated(self, lease_id: str) -> dict[str, Any]:
        """The move is done: the kernel now runs on the target GPU."""
        result: dict[str, Any] = await self._run("migrated", lease_id)
        return result

    async def directives(
        self, *, client: str, after: int, wait: float
    ) -> tuple[list[dict[str, Any]], int]:
        """Long-poll directives for ``client`` newer than ``after``; returns them and the last seq."""
        def call() -> tuple[list[dict[str, Any]], int]:
            result: tuple[list[dict[str, Any]], int] = self._client().directives(
                client=client, after=after, timeout=wait
            )
            return result

        directives, last = await _in_daemon_thread(call)
        return list(directives), int(last)


async def _in_daemon_thread(function: Callable[[], T]) -> T:
    """Run a long poll in a daemon thread: the default executor's threads are joined at exit,
    so a server stopping mid-poll would hang until the poll times out."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def settle(result: T | None, error: BaseException | None) -> None:
        if future.done():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)  # type: ignore[arg-type]

    def run() -> None:
        try:
            outcome: tuple[T | None, BaseException | None] = (function(), None)
        except BaseException as err:
            outcome = (None, err)
        with contextlib.suppress(RuntimeError):  # the loop closed while we polled
            loop.call_soon_threadsafe(settle, *outcome)

    threading.Thread(target=run, name="gpufrac-directives", daemon=True).start()
    return await future
