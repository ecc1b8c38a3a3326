"""Checkpointing a running kernel from the server: wait for idle, run ``%gpu checkpoint`` silently."""

from __future__ import annotations

import asyncio
import json
import os
import time
from typing import Any

CHECKPOINT_CODE = "%gpu checkpoint --quiet"
RESTORE_REPORT_FILE = "restore-report.json"


async def wait_until_idle(kernel: Any, deadline: float) -> bool:
    """Whether the kernel is not running a cell before ``deadline`` (monotonic seconds).

    The server tracks each kernel's execution state from its IOPub status messages;
    polling that attribute costs nothing and needs no extra kernel connection. A kernel
    no client has talked to yet stays "starting" although it waits for work: not busy.
    """
    while True:
        if getattr(kernel, "execution_state", None) in ("idle", "starting"):
            return True
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(0.1)


async def execute_silently(kernel: Any, code: str, timeout: float) -> dict[str, Any]:
    """Run ``code`` without history or output on the kernel's shell; return the reply content."""
    client = kernel.client()
    client.start_channels(shell=True, iopub=False, stdin=False, hb=False, control=False)
    try:
        msg_id = client.execute(code, silent=True, store_history=False, allow_stdin=False)
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"no reply to {code!r} within {timeout:g} s")
            reply = await client.get_shell_msg(timeout=remaining)
            if reply.get("parent_header", {}).get("msg_id") == msg_id:
                content: dict[str, Any] = reply["content"]
                return content
    finally:
        client.stop_channels()


async def checkpoint(kernel: Any, timeout: float) -> tuple[bool, str]:
    """Checkpoint the kernel now; returns whether it worked and, if not, why."""
    try:
        content = await execute_silently(kernel, CHECKPOINT_CODE, timeout)
    except Exception as err:  # a checkpoint that fails must not stop the move
        return False, f"{type(err).__name__}: {err}"
    if content.get("status") == "ok":
        return True, ""
    return False, f"{content.get('ename', 'error')}: {content.get('evalue', '')}".strip()


def read_restore_report(checkpoint_dir: str, since: float) -> dict[str, Any] | None:
    """The kernel hook's report of its last restore, if written after ``since`` (unix seconds)."""
    path = os.path.join(checkpoint_dir, RESTORE_REPORT_FILE)
    try:
        if os.stat(path).st_mtime < since - 1.0:
            return None
        with open(path, encoding="utf-8") as f:
            report = json.load(f)
    except (OSError, ValueError):
        return None
    return report if isinstance(report, dict) else None
