"""Sentences for people: why the kernel restarted, what came back, what an OOM means (pure)."""

from __future__ import annotations

import math
import re
import time
from collections.abc import Mapping, Sequence
from typing import Any

from jupyter_gpufrac import contract
from jupyter_gpufrac.kernel.env import RestartReason, Resumable
from node_agent.quantities import format_bytes, format_duration
from node_agent.words import named_for_people

_MAX_NAMES = 12


def fmt_bytes(n: int | None) -> str:
    """``1.5 GiB``; ``?`` for unknown."""
    return "?" if n is None else format_bytes(n)


def fmt_share(nbytes: int | None, total: int | None) -> str:
    """``4.0 GiB (0.25 of the GPU)``."""
    if nbytes is None:
        return "?"
    if total:
        return f"{fmt_bytes(nbytes)} ({nbytes / total:.2g} of the GPU)"
    return fmt_bytes(nbytes)


def share_now(gpu: str, request: int | None, limit: int | None, total: int | None) -> str:
    """``now 0.5 of GPU 0: 8.0 GiB guaranteed, up to 12.0 GiB``: a share just granted."""
    part = f"{request / total:.2g} of {gpu}" if request is not None and total else gpu
    return (f"now {part}: {fmt_bytes(request)} guaranteed, up to {fmt_bytes(limit)}")


def share_spec(share: Mapping[str, str | None]) -> str:
    """``request 0.25, limit 1``: a share as specs (fractions of a GPU or sizes)."""
    text = f"request {share.get('request') or '?'}"
    return text + (f", limit {share['limit']}" if share.get("limit") else "")


REMEMBERED = ("kept for new notebooks in this environment; `%gpu request --reset` forgets it")


def source_words(source: str | None) -> str:
    """`` (from the c.GpuFrac default)``: where a share came from, in the panel's words;
    empty when unknown."""
    if not source:
        return ""
    return f" (from {contract.SOURCE_WORDS.get(source, source)})"


def plural(count: int, noun: str) -> str:
    """``1 variable``, ``2 variables``."""
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def names_list(names: Sequence[str]) -> str:
    """``a, b, c`` with a tail count when long."""
    shown = list(names[:_MAX_NAMES])
    more = len(names) - len(shown)
    text = ", ".join(shown)
    return f"{text} and {more} more" if more > 0 else text


def _gpu(name: str) -> str | None:
    """``GPU 1`` for an index or a label; None for a UUID, which means nothing to people."""
    if name.upper().startswith(("GPU-", "MIG-")):
        return None
    return name if name.upper().startswith("GPU") else f"GPU {name}"


def restart_cause(reason: RestartReason | None) -> str:
    """One clause saying why the kernel was restarted; nothing for a restore its user asked
    for (``%gpu restore``): no cause is named that did not happen."""
    if reason is None:
        return ""
    detail = reason.message.strip().rstrip(".")
    if reason.cause == contract.CAUSE_MIGRATED and detail.lower().startswith("moved "):
        # The server's sentence already says from where to where, by index.
        return f"This kernel was {detail[0].lower()}{detail[1:]}."
    if reason.cause == contract.CAUSE_RESUMED and detail.lower().startswith("resumed "):
        # The server's sentence says from what, where it ran and where it runs now.
        return f"This notebook was {detail[0].lower()}{detail[1:]}."
    src = _gpu(reason.from_gpu) if reason.from_gpu else None
    dst = _gpu(reason.to_gpu) if reason.to_gpu else None
    gpus = f" from {src} to {dst}" if src and dst else f" to {dst}" if dst else ""
    if reason.cause == contract.CAUSE_MIGRATED:
        head = f"This kernel was moved{gpus}"
    elif reason.cause == contract.CAUSE_OOM_KILLED:
        head = ("This kernel was stopped by the GPU memory reclaimer: it held GPU memory "
                "beyond its guaranteed request that another notebook needed back")
    elif reason.cause == contract.CAUSE_REQUEST_CHANGED:
        head = f"This kernel was restarted{gpus} because its GPU request or limit changed"
    elif reason.cause == contract.CAUSE_DIED:
        head = "This kernel's process ended unexpectedly and was restarted"
    elif reason.cause == contract.CAUSE_PLACED:
        head = f"This kernel was restarted{gpus} because a GPU share became free for it"
    elif reason.cause == contract.CAUSE_RESUMED:
        head = "This notebook was resumed from the last checkpoint of its earlier kernel"
    elif reason.cause == contract.CAUSE_PARKED:
        head = ("This kernel was parked: it gave its GPU back and keeps its variables in host "
                "memory; the next cell gets a GPU first, then runs")
    else:
        head = "This kernel was restarted by jupyter-gpufrac"
    return f"{head}: {detail}." if detail else f"{head}."


def _ago(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def account_lines(account: Mapping[str, Any], cell_started: float, now: float) -> list[str]:
    """``%gpu``'s ``state:`` and ``last:`` lines from the server's account of this kernel, in
    the panel's words; ages and countdowns computed now."""
    last = account.get("last_event") if isinstance(account.get("last_event"), dict) else None
    shown: Mapping[str, Any] = account
    once_used = account.get("once_used")
    if (last is not None and isinstance(once_used, dict)
            and cell_started > float(last.get("time") or 0) + 1.0):
        # As the server reads it: a restore is news until the user's next cell after it.
        shown = once_used
    state, reason, deadline = str(shown.get("state")), shown.get("reason"), shown.get("deadline")
    words = contract.KERNEL_STATE_WORDS.get(state, state)
    if state == "move-pending" and deadline:
        left = math.ceil(float(deadline) - now)
        words = (f"moving in {left} s — cell still running" if left > 0
                 else "moving now — cell still running")
    lines = [f"  state:   {words}" + (f" ({str(reason).rstrip('.')})" if reason else "")]
    if last is not None:
        age = _ago(max(now - float(last.get("time") or now), 0.0))
        lines.append(f"  last:    {age} ago: {last.get('message')}")
    return lines


def restore_message(
    reason: RestartReason | None,
    *,
    restored: Sequence[str],
    lost: Mapping[str, str],
    checkpoint_time: float | None,
    checkpoint_cell: int | None = None,
    last_cell: int | None = None,
    newer_names: Sequence[str] = (),
    moved_to_cpu_bytes: int = 0,
    cpu_reason: str = "this kernel has no CUDA device",
    interrupted_cell: str | None = None,
    error: str | None = None,
    deferred: Mapping[str, int] | None = None,
    room: int | None = None,
    now: float | None = None,
) -> str:
    """The notebook message after a restart: why, what came back, what did not and what to do."""
    now = time.time() if now is None else now
    lines = [cause] if (cause := restart_cause(reason)) else []
    if interrupted_cell:
        lines.append(f"Cell {interrupted_cell} was cut off before it finished: the variables are "
                     "as they were before it ran; re-run it to redo its work.")
    if error:
        lines.append(f"No variables were restored: {error}")
    else:
        when = ""
        if checkpoint_time:
            stamp = time.strftime("%H:%M:%S", time.localtime(checkpoint_time))
            when = f" from the checkpoint taken at {stamp} ({_ago(now - checkpoint_time)} ago"
            when += f", after cell [{checkpoint_cell}])" if checkpoint_cell else ")"
        deferred = deferred or {}
        total = len(restored) + len(lost) + len(deferred)
        lines.append(f"Restored {len(restored)} of {plural(total, 'variable')}{when}: "
                     f"{names_list(sorted(restored)) or 'none'}.")
        if deferred:
            parts = [f"{name} ({fmt_bytes(size)})" for name, size in sorted(deferred.items())]
            lines.append(
                f"Kept on disk, not loaded yet: {names_list(parts)}. Loading "
                f"{'it' if len(deferred) == 1 else 'them'} now would take GPU memory that other "
                f"notebooks on this GPU are owed (room now: {fmt_bytes(room)}), and the kernel "
                "would be stopped again. `%gpu restore` loads them once there is room; "
                "`%gpu request` asks for a larger share.")
        if lost:
            parts = [f"{name} ({why})" for name, why in sorted(lost.items())]
            lines.append(f"Not restored (could not be saved): {names_list(parts)}; "
                         "re-run the cells that create them.")
        if newer_names:
            lines.append(f"Defined after the checkpoint, so lost: {names_list(sorted(newer_names))}.")
        if checkpoint_cell and last_cell and last_cell > checkpoint_cell + 1:
            lines.append(f"Cells [{checkpoint_cell + 1}] to [{last_cell}] ran after the "
                         "checkpoint: re-run them if you need their effects.")
        elif checkpoint_cell and last_cell == checkpoint_cell + 1:
            lines.append(f"Cell [{last_cell}] ran after the checkpoint: re-run it if you need "
                         "its effects.")
        if moved_to_cpu_bytes:
            lines.append(f"{fmt_bytes(moved_to_cpu_bytes)} of tensors that were on the GPU are on "
                         f"the CPU now, because {cpu_reason}; move them back with .cuda() "
                         "once there is room.")
    return "\n".join(f"gpufrac: {line}" for line in lines)


# What the agent's reasons may start with that the kernel's own sentence says already.
_SAID = re.compile(r"^(?:frozen in host memory|waiting for a GPU)\s*[:,]?\s*", re.IGNORECASE)


def _agent_words(reason: str | None) -> str:
    """An agent's reason without the words the sentence around it says already ("waiting for
    a GPU:", "frozen in host memory,", however often), nor a final stop."""
    why = named_for_people(reason or "").strip().rstrip(".")
    while (shorter := _SAID.sub("", why, count=1)) != why:
        why = shorter
    return why


def clock(at: float | None) -> str:
    """``14:02:11``: a moment of today, as the notebook reads it."""
    return time.strftime("%H:%M:%S", time.localtime(at if at is not None else time.time()))


def resume_hint(resumable: Resumable) -> str:
    """The first cell of a fresh kernel whose notebook's earlier kernel left its state."""
    point = []
    if resumable.cell:
        point.append(f"after cell [{resumable.cell}]")
    if resumable.time:
        point.append(clock(resumable.time))
    detail = resumable.reason.message.strip().rstrip(".")
    return (f"gpufrac: this notebook's earlier kernel left its state"
            f"{' (' + detail + ')' if detail else ''}: its last checkpoint"
            f"{' (' + ', '.join(point) + ')' if point else ''} holds "
            f"{plural(resumable.variables, 'variable')}. This kernel started fresh; "
            "`%gpu restore` brings that state back into it.")


def waiting_for_gpu(reason: str | None, frozen: bool = False) -> str:
    """What a cell of a parked or frozen kernel says while no GPU has room for it."""
    why = _agent_words(reason) or "no GPU has room for this kernel's request now"
    kept = (" (the kernel waits frozen in host memory; nothing is lost)" if frozen else "")
    return (f"gpufrac: waiting for a GPU{kept}: {why}. This cell runs as soon as one has room; "
            "interrupt the kernel to stop waiting (the cell then does not run).")


def frozen_news(reason: str, cause: str, at: float | None) -> str:
    """The line the next cell starts with after the agent froze this kernel, however late it
    comes: when, and why in the agent's words."""
    why = _agent_words(reason)
    if cause == "park":
        why = re.sub(r"^parked\b\s*[:,]?\s*", "", why, flags=re.IGNORECASE)
        return (f"gpufrac: parked at {clock(at)}" + (f", {why}" if why else "")
                + ": frozen in host memory, it gave its GPU back. Every variable, open file and "
                "thread is kept; this cell thaws it first.")
    because = re.match(r"^frozen\s+because\s+", why, re.IGNORECASE)
    if because:
        return f"gpufrac: frozen in host memory at {clock(at)} because {why[because.end():]}."
    why = re.sub(r"^frozen\b\s*[:,]?\s*", "", why, flags=re.IGNORECASE)
    return f"gpufrac: frozen in host memory at {clock(at)}" + (f": {why}." if why else ".")


def thawed_news(gpu: str, frozen_s: float | None, at: float | None) -> str:
    """The line the next cell starts with after the agent thawed this kernel by itself."""
    spent = f", after being frozen for {format_duration(frozen_s)}" if frozen_s is not None else ""
    return (f"gpufrac: thawed at {clock(at)}{spent}, back on {gpu}. Nothing was restarted: "
            "every variable, open file and thread is as it was.")


def thawed(gpu: str, waited: float, frozen_s: float | None = None) -> str:
    """The line a cell of a frozen kernel starts with once it thawed it."""
    spent = f"{format_duration(frozen_s)} frozen; " if frozen_s is not None else ""
    return (f"gpufrac: back on {gpu}, thawed ({spent}this cell waited "
            f"{format_duration(waited)} for it). Nothing was restarted: every variable, open "
            "file and thread is as it was.")


def unparked(gpu: str, seconds: float, back: Sequence[str], back_bytes: int,
             still_away: Sequence[str]) -> str:
    """What a cell of a parked kernel starts with once the kernel has a GPU again: short
    sentences, the GPU first."""
    text = f"gpufrac: back on {gpu} (this cell waited {format_duration(seconds)} for it)."
    if back:
        text += f" {plural(len(back), 'variable')} ({fmt_bytes(back_bytes)}) moved back onto it."
    if still_away:
        one = len(still_away) == 1
        text += (f" {names_list(sorted(still_away))} {'stays' if one else 'stay'} in host "
                 "memory: there is no room under the cap. `%gpu reload` moves "
                 f"{'it' if one else 'them'} back once there is.")
    return text


# Messages of GPU memory failures that are not PyTorch's OutOfMemoryError, and who failed.
_OOM_MARKS = (
    ("CUBLAS_STATUS_ALLOC_FAILED", "cuBLAS"),
    ("CUDNN_STATUS_ALLOC_FAILED", "cuDNN"),
    ("CUFFT_ALLOC_FAILED", "cuFFT"),
    ("CUSOLVER_STATUS_ALLOC_FAILED", "cuSOLVER"),
    ("CUSPARSE_STATUS_ALLOC_FAILED", "cuSPARSE"),
    ("CUDA error: out of memory", "CUDA"),
    ("CUDA out of memory", "PyTorch"),
)
_WANTED = re.compile(r"Tried to allocate ([\d.]+) (B|KiB|MiB|GiB|TiB)")
_UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}


def oom_source(error: BaseException) -> str | None:
    """Who ran out of GPU memory in ``error`` ("PyTorch", "CUDA", "cuBLAS", …), or None when
    ``error`` is not a GPU memory failure."""
    if type(error).__name__ == "OutOfMemoryError":
        return "PyTorch"
    text = str(error)
    return next((who for mark, who in _OOM_MARKS if mark in text), None)


def oom_wanted(error: BaseException) -> int | None:
    """The size of the allocation that failed, when the message says it."""
    match = _WANTED.search(str(error))
    return int(float(match.group(1)) * _UNITS[match.group(2)]) if match else None


def oom_cause(
    *, wanted: int | None, reserved: int | None, cap: int | None, gpu_free: int | None,
    shares: Sequence[Mapping[str, object]] = (), own_lease: str | None = None,
) -> str:
    """Why the memory ran out: this kernel's own cap, or a GPU full because of others (each
    other share by its figures: whose it is is not ours to know)."""
    need = wanted or 0
    if cap is not None and reserved is not None and reserved + need > cap:
        return (f"This kernel reached its own cap of {fmt_bytes(cap)} "
                f"({fmt_bytes(reserved)} held, {fmt_bytes(need)} more asked for).")
    if gpu_free is None:
        return "The GPU could not give more memory."
    others = [s for s in shares if s.get("lease") is None or s.get("lease") != own_lease]
    text = (f"The GPU itself is full ({fmt_bytes(gpu_free)} free) while this kernel is below "
            "its cap: other processes hold the memory.")
    borrowing = [s for s in others if _int(s.get("usage")) > _int(s.get("request"))]
    if others:
        text += (f" {plural(len(others), 'other share')} on this GPU: "
                 + "; ".join(_share_text(s) for s in others[:4])
                 + (f"; and {len(others) - 4} more" if len(others) > 4 else "") + ".")
    if borrowing:
        text += (" Memory above a request is on loan: the agent takes it back for notebooks "
                 "under their request, so what your request guarantees comes free.")
    return text


def _int(value: object) -> int:
    return value if isinstance(value, int) else 0


def _share_text(share: Mapping[str, object]) -> str:
    usage, request = _int(share.get("usage")), _int(share.get("request"))
    over = f", {fmt_bytes(usage - request)} above it" if usage > request else ""
    return f"a {share.get('kind', 'lease')} using {fmt_bytes(usage)} of a {fmt_bytes(request)} request{over}"


def oom_explanation(
    *,
    request: int | None,
    limit: int | None,
    total: int | None,
    reserved: int | None,
    allocated: int | None,
    cap: int | None,
    shrunk: bool,
    has_lease: bool,
    source: str = "PyTorch",
    cause: str = "",
) -> str:
    """What a GPU out-of-memory error means under a lease, and what to do about it."""
    lines = [f"gpufrac: {source} ran out of the GPU memory this kernel may use."]
    if cause:
        lines.append(f"  why: {cause}")
    if has_lease:
        lines.append(f"  request (guaranteed): {fmt_share(request, total)}")
        lines.append(f"  limit (may burst to): {fmt_share(limit, total)}")
        if cap is not None:
            lines.append(f"  allocator cap now:    {fmt_bytes(cap)}"
                         + ("  (lowered to the request: the memory lent to you was reclaimed)"
                            if shrunk else ""))
    else:
        lines.append("  this kernel has no GPU lease, so the limit is the GPU itself")
    lines.append(f"  in use: {fmt_bytes(allocated)} by tensors, {fmt_bytes(reserved)} reserved "
                 "by PyTorch's allocator")
    lines.append("What you can do:")
    lines.append("  - free tensors you no longer need (`del x`), then `torch.cuda.empty_cache()`;")
    lines.append("  - use a smaller batch, or `torch.autocast` / half precision;")
    if has_lease:
        lines.append("  - ask for more: `%gpu request 0.5 --limit 0.8` (or sizes like 8Gi); the "
                     "kernel moves to a GPU with room if needed and keeps its variables;")
        if shrunk:
            lines.append("  - wait until the other notebook is done, then `%gpu reload`.")
    lines.append("  `%gpu` shows this kernel's share and the node's GPUs.")
    return "\n".join(lines)


def compute_text(lease: Mapping[str, object], mps: bool) -> str:
    """The lease's sampled SM utilization against its compute share, and whether the share
    holds (only CUDA MPS enforces one)."""
    used = lease.get("compute_usage")
    text = "not sampled" if used is None else f"{used}% of the GPU's compute"
    request, limit = lease.get("compute_request"), lease.get("compute_limit")
    if request is None:
        return text
    share = f"{request:g}" if limit in (None, request) else f"{request:g} to {limit:g}"
    held = "held by CUDA MPS" if mps else "not enforced: no CUDA MPS on this node"
    return f"{text}; share {share} of the GPU's compute ({held})"
