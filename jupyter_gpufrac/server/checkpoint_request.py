"""Checkpointing a running kernel from the server: wait for idle, run ``%gpu checkpoint`` silently."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

from jupyter_gpufrac import contract
from jupyter_gpufrac.kernel import store
from node_agent.quantities import format_bytes

CHECKPOINT_CODE = "%gpu checkpoint --quiet"


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


def read_restore_report(checkpoint_dir: str, pid: int | None) -> dict[str, Any] | None:
    """The restore report of the kernel process ``pid``; an earlier process's is not its."""
    try:
        # Read as the kernel reads its checkpoint: a report someone else could have written
        # (or swapped in) is not believed.
        report = json.loads(store.read_file(Path(checkpoint_dir), contract.RESTORE_REPORT_FILE))
    except (OSError, ValueError, store.UnsafeCheckpointError):
        return None
    if not isinstance(report, dict) or (pid is not None and report.get("pid") != pid):
        return None
    return report


def restore_summary(report: dict[str, Any] | None, waited_s: float) -> dict[str, Any]:
    """What the server tells people about a restore: verified names only, never assumed success.

    ``ok`` is true only when the kernel reported every variable back and no cell cut off.
    """
    if report is None:
        return {
            "ok": False, "restored": [], "lost": [], "lost_reasons": {}, "interrupted_cell": None,
            "checkpoint_cell": None, "time": time.time(), "deferred": {},
            "error": f"the kernel did not report a restore within {waited_s:.0f} s",
            "message": f"the kernel did not report a restore within {waited_s:.0f} s, so its "
                       "variables may be lost; run `%gpu` in the notebook to see what it holds.",
        }
    restored = [str(name) for name in report.get("restored") or []]
    reasons = report.get("lost_reasons") if isinstance(report.get("lost_reasons"), dict) else {}
    lost = [str(name) for name in report.get("lost") or []]
    # Names defined after the checkpoint did not come back either.
    newer = [str(name) for name in report.get("newer_names") or [] if str(name) not in lost]
    lost_reasons = {str(k): str(v) for k, v in (reasons or {}).items()}
    lost_reasons.update({name: "defined after the last checkpoint" for name in newer})
    lost += newer
    raw_deferred = report.get("deferred") if isinstance(report.get("deferred"), dict) else {}
    deferred = {str(k): int(v) for k, v in (raw_deferred or {}).items()}
    interrupted = report.get("interrupted_cell")
    error = report.get("error")
    parts: list[str] = []
    if error:
        parts.append(f"no variables were restored: {error}")
    else:
        total = len(restored) + len(lost) + len(deferred)
        parts.append(f"{len(restored)} of {total} variables restored")
        if deferred:
            shown = [f"{name} ({format_bytes(size)})" for name, size in sorted(deferred.items())]
            parts.append(f"kept on disk until there is room on the GPU: {', '.join(shown)} "
                         "(`%gpu restore` loads them)")
        if lost:
            shown = [f"{name} ({lost_reasons[name]})" if name in lost_reasons else name
                     for name in lost]
            parts.append(f"lost: {', '.join(shown)}")
    if interrupted:
        parts.append(f"cell {interrupted} was cut off: re-run it")
    ok = (bool(report.get("ok")) and not error and not lost and not interrupted
          and not deferred)
    return {
        "ok": ok, "restored": restored, "lost": lost, "lost_reasons": lost_reasons,
        "deferred": deferred,
        "interrupted_cell": str(interrupted) if interrupted else None,
        "checkpoint_cell": report.get("checkpoint_cell"), "error": str(error) if error else None,
        "time": float(report.get("time") or time.time()),
        "message": "; ".join(parts) + ".",
    }
