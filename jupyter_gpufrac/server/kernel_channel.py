"""The server's questions to a kernel, over a comm: checkpoint now, what did the restore bring back."""

from __future__ import annotations

import asyncio
import queue
import time
import uuid
from collections.abc import Callable
from typing import Any

from jupyter_gpufrac import contract
from node_agent.quantities import format_bytes, format_duration


async def wait_until_idle(kernel: Any, deadline: float,
                          unless: Callable[[], bool] | None = None) -> bool:
    """Whether the kernel is not running a cell before ``deadline`` (monotonic seconds); False
    at once when ``unless()`` becomes true (the wait is moot).

    The server tracks each kernel's execution state from its IOPub status messages;
    polling that attribute costs nothing and needs no extra kernel connection. A kernel
    no client has talked to yet stays "starting" although it waits for work: not busy.
    """
    while True:
        if getattr(kernel, "execution_state", None) in ("idle", "starting"):
            return True
        if time.monotonic() >= deadline or (unless is not None and unless()):
            return False
        await asyncio.sleep(0.1)


# How long an answered ask waits for the kernel's "idle" after it (it comes within milliseconds).
SETTLE_S = 5.0


class ChannelError(Exception):
    """The kernel did not answer an ask: gone, busy past the deadline, or without the extension."""


def ask_message(session: Any, ask: str) -> tuple[str, dict[str, Any]]:
    """``(comm id, comm_open message)`` asking the kernel ``ask``: one of contract.ASKS."""
    comm_id = uuid.uuid4().hex
    content = {"comm_id": comm_id, "target_name": contract.COMM_TARGET, "data": {"ask": ask}}
    return comm_id, session.msg("comm_open", content)


def close_message(session: Any, comm_id: str) -> dict[str, Any]:
    """The comm_close the asker sends once answered (the kernel never closes it itself)."""
    message: dict[str, Any] = session.msg("comm_close", {"comm_id": comm_id, "data": {}})
    return message


def answer_in(msg: dict[str, Any], comm_id: str) -> dict[str, Any] | None:
    """The kernel's answer if ``msg`` (IOPub) carries it; ChannelError if it closed unanswered."""
    content = msg.get("content") or {}
    if content.get("comm_id") != comm_id:
        return None
    if msg.get("msg_type") == "comm_msg" and isinstance(content.get("data"), dict):
        answer: dict[str, Any] = content["data"]
        return answer
    if msg.get("msg_type") == "comm_close":
        raise ChannelError("the kernel closed the question unanswered: it does not run the "
                           "jupyter_gpufrac.kernel extension")
    return None


async def _subscribed(client: Any, deadline: float) -> None:
    """Return once this client's IOPub receives the kernel's messages (a new subscriber
    misses what is published before its subscription is in place).

    The probe is a comm_info request, not kernel_info (jupyter_client's wait_for_ready):
    IPython picks a random tip for the kernel_info banner from the notebook's own
    ``random`` generator, and a question must not change the draws of the notebook.
    """
    while True:
        msg_id = client.comm_info(target_name=contract.COMM_TARGET)
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise ChannelError("the kernel did not answer in time: it may be gone or busy")
            try:
                msg = await client.get_iopub_msg(timeout=min(remaining, 1.0))
            except queue.Empty:
                break  # published before we subscribed: ask again
            if msg.get("parent_header", {}).get("msg_id") == msg_id:
                return


async def ask(kernel: Any, question: str, timeout: float) -> dict[str, Any]:
    """Ask the kernel over a comm and return its answer; ChannelError past ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    client = kernel.client()
    client.start_channels(shell=True, iopub=True, stdin=False, hb=False, control=False)
    try:
        await _subscribed(client, deadline)
        comm_id, msg = ask_message(client.session, question)
        client.shell_channel.send(msg)
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise ChannelError(f"no answer to {question!r} within {timeout:g} s")
            try:
                reply = await client.get_iopub_msg(timeout=remaining)
            except queue.Empty:
                continue
            found = answer_in(reply, comm_id)
            if found is not None:
                close = close_message(client.session, comm_id)
                client.shell_channel.send(close)
                await _settled(client, close["header"]["msg_id"],
                               min(time.monotonic() + SETTLE_S, deadline))
                return found
    finally:
        # Not stop_channels(): it connects every channel it never started, under the identity
        # all clients of the kernel share, and the kernel's ROUTER hands that identity to the
        # newest connection (a question another client sent meanwhile was lost).
        client.shell_channel.stop()
        client.iopub_channel.stop()


async def _settled(client: Any, msg_id: str, deadline: float) -> None:
    """Wait (until ``deadline`` at most) for the kernel to say it is idle after ``msg_id``.

    Frontends show a kernel's state from its last status message: a kernel restarted right
    after an ask would otherwise leave them its "busy" for that ask, with no "idle" ever
    following (JupyterLab then shows Busy until the next cell).
    """
    while (remaining := deadline - time.monotonic()) > 0:
        try:
            msg = await client.get_iopub_msg(timeout=remaining)
        except queue.Empty:
            return
        if (msg.get("msg_type") == "status"
                and msg.get("parent_header", {}).get("msg_id") == msg_id
                and (msg.get("content") or {}).get("execution_state") == "idle"):
            return


async def checkpoint(kernel: Any, timeout: float, *, park: bool = False) -> tuple[bool, str]:
    """Checkpoint the kernel now (``park``: after moving its GPU tensors to host memory, which
    it undoes when the checkpoint fails); returns whether it worked and, if not, why."""
    try:
        answer = await ask(kernel, contract.ASK_PARK if park else contract.ASK_CHECKPOINT, timeout)
    except ChannelError as err:  # a checkpoint that fails must not stop the move
        return False, str(err)
    if answer.get("ok") is True:
        return True, ""
    return False, str(answer.get("error") or "the kernel gave no reason")


async def checkpoint_status(kernel: Any, timeout: float) -> dict[str, Any] | None:
    """The kernel's checkpoint status (contract.CHECKPOINT_STATUS_REQUEST), asked on the
    control channel; None when it does not answer within ``timeout`` seconds."""
    client = kernel.client()
    client.start_channels(shell=False, iopub=False, stdin=False, hb=False, control=True)
    try:
        request = client.session.msg(contract.CHECKPOINT_STATUS_REQUEST, {})
        client.control_channel.send(request)
        deadline = time.monotonic() + timeout
        while (remaining := deadline - time.monotonic()) > 0:
            try:
                reply = await client.control_channel.get_msg(timeout=remaining)
            except queue.Empty:
                return None
            if (reply.get("parent_header") or {}).get("msg_id") == request["header"]["msg_id"]:
                content = reply.get("content")
                return content if isinstance(content, dict) else None
        return None
    finally:
        client.control_channel.stop()  # not stop_channels(): see ask()


async def restore_report(kernel: Any, timeout: float) -> dict[str, Any] | None:
    """What the kernel's last restore brought back (None: it did not say)."""
    try:
        answer = await ask(kernel, contract.ASK_RESTORE_REPORT, timeout)
    except ChannelError:
        return None
    report = answer.get("report")
    return report if isinstance(report, dict) else None


def cells_after(checkpoint_cell: object, last_cell: object) -> str | None:
    """Which cells ran after the checkpoint a restore came from (their effects are lost,
    whatever names came back), for people; None when none did."""
    if not (isinstance(checkpoint_cell, int) and isinstance(last_cell, int)
            and 0 < checkpoint_cell < last_cell):
        return None
    if last_cell == checkpoint_cell + 1:
        return (f"cell [{last_cell}] ran after the checkpoint (taken after cell "
                f"[{checkpoint_cell}]): re-run it if you need its effects")
    return (f"cells [{checkpoint_cell + 1}] to [{last_cell}] ran after the checkpoint (taken "
            f"after cell [{checkpoint_cell}]): re-run them if you need their effects")


def restore_summary(report: dict[str, Any] | None, waited_s: float) -> dict[str, Any]:
    """What the server tells people about a restore: verified names only, never assumed success.

    ``ok`` is true only when the kernel reported every variable back and no cell cut off.
    """
    if report is None:
        return {
            "ok": False, "restored": [], "lost": [], "lost_reasons": {}, "interrupted_cell": None,
            "checkpoint_cell": None, "time": time.time(), "deferred": {},
            "error": f"the kernel did not report a restore within {format_duration(waited_s)}",
            "message": f"the kernel did not report a restore within {format_duration(waited_s)}, "
                       "so its variables may be lost; run `%gpu` in the notebook to see what it "
                       "holds.",
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
    older = report.get("older")
    parts: list[str] = [str(older)[:1000]] if older else []
    if error:
        parts.append(f"no variables were restored: {error}")
    else:
        total = len(restored) + len(lost) + len(deferred)
        parts.append(f"restored {len(restored)} of {total} variables")
        if deferred:
            shown = [f"{name} ({format_bytes(size)})" for name, size in sorted(deferred.items())]
            parts.append(f"kept on disk until there is room on the GPU: {', '.join(shown)} "
                         "(`%gpu restore` loads them)")
        if lost:
            shown = [f"{name} ({lost_reasons[name]})" if name in lost_reasons else name
                     for name in lost]
            parts.append(f"not restored: {', '.join(shown)}")
    after = None if error else cells_after(report.get("checkpoint_cell"), report.get("last_cell"))
    if after:
        parts.append(after)
    if interrupted:
        parts.append(f"the running cell {interrupted} was cut off: re-run it")
    ok = (bool(report.get("ok")) and not error and not lost and not interrupted
          and not deferred and not older and not after)
    return {
        "ok": ok, "restored": restored, "lost": lost, "lost_reasons": lost_reasons,
        "deferred": deferred,
        "interrupted_cell": str(interrupted) if interrupted else None,
        "checkpoint_cell": report.get("checkpoint_cell"), "error": str(error) if error else None,
        "older": str(older)[:1000] if older else None,
        "time": float(report.get("time") or time.time()),
        # How long the kernel took to load it (None from a kernel that did not say).
        "seconds": _seconds(report.get("seconds")),
        "message": "; ".join(parts) + ".",
    }


def _seconds(value: object) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None
