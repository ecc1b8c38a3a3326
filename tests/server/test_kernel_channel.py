"""The server's questions to a real kernel leave every frontend seeing it idle afterwards."""

from __future__ import annotations

import asyncio
import os
import queue
import signal
from pathlib import Path
from typing import Any

from jupyter_client.manager import AsyncKernelManager

from harness.agent import AgentProcess
from jupyter_gpufrac import contract
from jupyter_gpufrac.server.kernel_channel import ask, checkpoint, checkpoint_status

from .test_provisioner import write_kernelspec


async def statuses_after(observer: Any, since: str) -> list[str]:
    """The execution states the observer saw after the status parented by ``since``."""
    seen: list[str] = []
    started = False
    while True:
        try:
            msg = await observer.get_iopub_msg(timeout=0.5)
        except queue.Empty:
            return seen
        if msg["msg_type"] != "status":
            continue
        if msg["parent_header"].get("msg_id") == since:
            started = True
        elif started:
            seen.append(msg["content"]["execution_state"])


async def test_a_kernel_killed_right_after_an_ask_was_last_seen_idle(
    isolated: Path, no_leases: AgentProcess
) -> None:
    ksm = write_kernelspec(isolated, {"gpufrac": {"request": "0.25"}})
    km = AsyncKernelManager(kernel_name="gpu-python", kernel_spec_manager=ksm)
    await km.start_kernel()
    observer = km.client()  # a browser's view of the kernel
    observer.start_channels()
    try:
        await observer.wait_for_ready(timeout=60)
        marker = observer.execute("x = 1")
        assert (await checkpoint(km, timeout=60)) == (True, "")
        # A move restarts the kernel the moment it answered: what a frontend saw last
        # must be "idle", or it shows Busy until the user runs a cell.
        os.kill(km.provisioner.pid, signal.SIGKILL)  # type: ignore[union-attr]
        states = await statuses_after(observer, marker)
        assert states, "the observer saw none of the ask's status messages"
        assert states[-1] == "idle", states
        assert states.count("busy") == states.count("idle"), states
    finally:
        observer.stop_channels()
        await km.shutdown_kernel(now=True)


async def test_a_question_is_answered_while_the_server_asks_for_the_checkpoint_status(
    isolated: Path, no_leases: AgentProcess
) -> None:
    """The kernel view asks for the checkpoint status while a move asks for a checkpoint: the
    status client must not connect the shell channel it does not use (jupyter_client's
    stop_channels does), or it takes the asking client's place at the kernel under their shared
    identity, and the question is lost (a move then waited 109 s for nothing)."""
    ksm = write_kernelspec(isolated, {"gpufrac": {"request": "0.25"}})
    km = AsyncKernelManager(kernel_name="gpu-python", kernel_spec_manager=ksm)
    await km.start_kernel()
    asking = True

    async def status_polls() -> int:
        polls = 0
        while asking:
            await checkpoint_status(km, timeout=1.0)
            polls += 1
        return polls

    try:
        pollers = [asyncio.ensure_future(status_polls()) for _ in range(3)]
        for _ in range(40):
            answer = await ask(km, contract.ASK_RESTORE_REPORT, timeout=5)
            assert answer == {"ok": True, "report": None}
        asking = False
        assert all(await asyncio.gather(*pollers))
    finally:
        asking = False
        await km.shutdown_kernel(now=True)
