"""The directive listener survives the agent going away and coming back."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from harness.agent import AgentProcess

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


async def test_a_directive_for_a_lease_the_kernel_does_not_hold_is_ignored(
    jp_serverapp: Any, jp_fetch: Any, own_agent: AgentProcess
) -> None:
    """Kernel ids show in `ps`: anyone may write one on a lease of their own. What the agent
    says about that lease never touches the kernel."""
    await jp_serverapp.extension_manager.start_all_extensions()
    app = jp_serverapp.web_app.settings["gpufrac_app"]
    listener = app.listener
    try:
        reply = await jp_fetch("api", "kernels", method="POST", body=json.dumps({}))
        kernel_id = json.loads(reply.body)["id"]
        provisioner = jp_serverapp.kernel_manager.get_kernel(kernel_id).provisioner
        await until(lambda: provisioner.gpu.lease is not None, 30, "the kernel's lease")
        own = provisioner.gpu.lease["id"]
        # Made here by the server's own uid: the agent hands such a lease's directives to the
        # server's client name, so only the server's own check stands between it and the kernel.
        forged = own_agent.client().create_lease(
            client=listener.client_name, kernel_id=kernel_id, request="0.25")
        seen: list[str] = []
        handler = logging.Handler()
        handler.emit = lambda record: seen.append(record.getMessage())  # type: ignore[method-assign]
        listener.log.addHandler(handler)
        try:
            listener.dispatch({"kind": "migrate", "seq": 1, "kernel_id": kernel_id,
                               "lease_id": forged["id"], "from_gpu": forged["physical_gpu"],
                               "to_gpu": forged["physical_gpu"], "deadline": time.time() + 60})
            await asyncio.gather(*listener._tasks)
        finally:
            listener.log.removeHandler(handler)
        assert any(f"names lease {forged['id']}, not the kernel's ({own})" in m for m in seen), seen
        assert provisioner.gpu.lease["id"] == own
        await jp_fetch("api", "kernels", kernel_id, method="DELETE")
    finally:
        await app.stop_extension()


async def test_a_kill_notice_during_its_users_shutdown_leaves_it_shut_down(
    jp_serverapp: Any, jp_fetch: Any, own_agent: AgentProcess
) -> None:
    """The agent's kill notice and the user's shutdown cross: the notice must not hand the
    kernel back to jupyter_client's restarter, which would launch it again once it is gone.
    The kernel is stopped (SIGSTOP), so it stays alive to the notice and its shutdown runs
    for the whole of jupyter_client's wait before it kills it."""
    await jp_serverapp.extension_manager.start_all_extensions()
    app = jp_serverapp.web_app.settings["gpufrac_app"]
    listener = app.listener
    manager = jp_serverapp.kernel_manager
    try:
        reply = await jp_fetch("api", "kernels", method="POST", body=json.dumps({}))
        kernel_id = json.loads(reply.body)["id"]
        kernel = manager.get_kernel(kernel_id)
        gpu = kernel.provisioner.gpu
        await until(lambda: gpu.lease is not None and gpu.lease["pids"], 30, "the kernel's pid")
        launches = gpu.launches
        os.kill(kernel.provisioner.pid, signal.SIGSTOP)
        notice = asyncio.ensure_future(listener.killed(kernel_id, {
            "kind": "killed", "kernel_id": kernel_id, "created": time.time(),
            "reason": "stopped to return loaned memory"}))
        await asyncio.sleep(0.2)  # the notice is waiting for the process to exit
        shutdown = asyncio.ensure_future(manager.shutdown_kernel(kernel_id))
        await asyncio.wait_for(asyncio.gather(notice, shutdown), 60)
        assert kernel_id not in manager
        # The restarter looks every `time_to_dead` seconds: two looks find nothing to restart.
        await asyncio.sleep(2 * kernel.provisioner.restarter.time_to_dead + 0.5)
        assert gpu.launches == launches and not await kernel.is_alive()
        assert not [x for x in own_agent.client().leases() if x.get("kernel_id") == kernel_id]
    finally:
        await app.stop_extension()
