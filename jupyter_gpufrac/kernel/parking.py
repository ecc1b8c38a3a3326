"""Parking and freezing as the kernel lives them: GPU tensors to host memory for the server, and a
GPU taken back (waiting while none has room) before the next cell runs."""

from __future__ import annotations

import contextlib
import logging
import re
import time
from collections.abc import Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import psutil
from IPython.core.error import UsageError

from jupyter_gpufrac.kernel import messages, offload, torch_adapter
from jupyter_gpufrac.kernel.agent_client import make_client
from jupyter_gpufrac.kernel.checkpoint import CheckpointError

if TYPE_CHECKING:
    from jupyter_gpufrac.kernel.hook import GpuFracHook

log = logging.getLogger(__name__)

# A parked kernel restores into host memory up to this share of what is available; the rest
# stays in the checkpoint (`%gpu restore` loads it).
HOST_ROOM_SHARE = 0.8
# How often a cell waiting for a GPU asks the agent again (seconds, growing to the second).
UNPARK_POLL_FIRST_S = 0.1
UNPARK_POLL_MAX_S = 2.0

# A cell that only parks (as IPython has transformed it by then): run on a kernel that holds
# no GPU, it does not take one first.
ONLY_PARK = re.compile(r"""^\s*(?:%gpu\s+park|get_ipython\(\)\.run_line_magic\(['"]gpu['"],"""
                       r"""\s*['"]park['"]\))\s*$""")


def on_frozen(hook: GpuFracHook) -> None:
    """The agent froze this process: cells ask for the GPU back before they run. A cell
    that runs now waits in its next CUDA call; it asks for the GPU back at once."""
    with hook._lock:
        hook.frozen = True
        if hook._unpark_before_cell not in hook.ip.input_transformers_post:
            hook.ip.input_transformers_post.append(hook._unpark_before_cell)
        running = hook._running is not None
    if running and hook.env.lease_id:
        try:
            make_client(hook.env.agent_socket).unpark(hook.env.lease_id)
        except Exception as exc:  # the next cell asks again
            log.warning("gpufrac: asking to thaw for the running cell failed: %s", exc)


def on_thawed(hook: GpuFracHook, directive: Mapping[str, Any]) -> None:
    """The agent thawed this process (room came back): cells run at once again, where
    the agent put it, and the next cell says so unless a cell asked for the thaw (it
    said so itself)."""
    uuids = [str(u) for u in directive.get("gpus") or [directive.get("gpu")] if u]
    try:
        take_gpu(hook, make_client(hook.env.agent_socket), {}, uuids)
    except Exception:  # the labels only; the process runs there
        with hook._lock:
            hook.frozen = False
            with contextlib.suppress(ValueError):
                hook.ip.input_transformers_post.remove(hook._unpark_before_cell)
    created = directive.get("created")
    at = float(created) if isinstance(created, int | float) else time.time()
    if at <= hook._thawed_by_cell_at:
        return
    frozen_s = directive.get("frozen_s")
    with hook._lock:
        hook.state.notices.append(messages.thawed_news(
            hook.gpu_label(), float(frozen_s) if isinstance(frozen_s, int | float) else None,
            at))


def park_for_server(hook: GpuFracHook) -> dict[str, Any]:
    """The server parks this kernel next: GPU tensors go to host memory, then a checkpoint
    records them and where they were (raises CheckpointError; then nothing stays moved)."""
    allocated = torch_adapter.allocated_bytes() or 0
    available = int(psutil.virtual_memory().available)
    if allocated > available * HOST_ROOM_SHARE:
        raise CheckpointError(
            f"its GPU tensors ({messages.fmt_bytes(allocated)}) do not fit in the host memory "
            f"available ({messages.fmt_bytes(available)}), so it keeps its GPU")
    moved = hook.release(cache_only=False, reason="park")
    try:
        result = hook.checkpoint(trigger="park")
    except BaseException:
        hook.offloaded = [r for r in hook.offloaded if r not in moved]
        offload.reload(hook.ip.user_ns, moved, None)
        raise
    return {"checkpoint": result.to_json(),
            "offloaded_bytes": sum(r.nbytes for r in moved)}


def unpark_before_cell(hook: GpuFracHook, lines: list[str]) -> list[str]:
    """An input transformer: IPython runs it before the cell, and what it raises stops the
    cell from running (the error is the cell's output)."""
    if not hook.parked and not hook.frozen:
        return lines
    if ONLY_PARK.match("".join(lines)):
        return lines  # `%gpu park` of a kernel that holds no GPU: nothing to take back
    parent = getattr(hook.ip, "parent_header", None)
    parent = parent if isinstance(parent, dict) else {}
    if (parent.get("content") or {}).get("silent"):
        return lines
    # ipykernel may transform one cell twice: a wait given up on is not begun again.
    msg_id = str((parent.get("header") or {}).get("msg_id") or "")
    if hook._unpark_refused is not None and hook._unpark_refused[0] == msg_id:
        raise UsageError(hook._unpark_refused[1])
    try:
        unpark(hook)
    except UsageError as exc:
        hook._unpark_refused = (msg_id, str(exc))
        raise
    return lines


def unpark(hook: GpuFracHook) -> None:
    """Get a GPU back (waiting, interruptibly, while none has room), let CUDA see it, and
    move the parked tensors back; raises UsageError when the cell must not run."""
    started = time.monotonic()
    lease_id = hook.env.lease_id
    if not lease_id:
        return
    # Read once: the thaw's notice may reach the directive thread before this returns.
    frozen = hook.frozen and not hook.parked
    frozen_at = hook.state.frozen_at
    # Why it has no GPU comes first (a freeze or park told at this cell, however late).
    hook.tell_news()
    client = make_client(hook.env.agent_socket)
    try:
        lease = client.unpark(lease_id)
        delay, told = UNPARK_POLL_FIRST_S, False
        while lease.get("state") != "active":
            if not told and lease.get("state") != "thawing":
                print(messages.waiting_for_gpu(lease.get("reason"), frozen), flush=True)
                told = True
            time.sleep(delay)
            delay = min(delay * 1.5, UNPARK_POLL_MAX_S)
            lease = client.lease(lease_id)
    except KeyboardInterrupt:
        with contextlib.suppress(Exception):  # parked again, or it would take a GPU unseen
            client.park(lease_id)
        raise UsageError("gpufrac: stopped waiting for a GPU; the cell did not run and the "
                         "kernel stays parked. Run a cell to wait again.") from None
    except Exception as exc:  # the agent refused or went away: nothing changed here
        raise UsageError(f"gpufrac: this kernel is parked and could not get a GPU back: "
                         f"{exc}. The cell did not run; run it again, or see `%gpu`.") from None
    uuids = [str(u) for u in lease.get("physical_gpus") or []]
    if frozen:
        # Thawed: CUDA, its memory and every object were kept; nothing to move back.
        hook._thawed_by_cell_at = time.time()
        take_gpu(hook, client, lease, uuids)
        print(messages.thawed(hook.gpu_label(), time.monotonic() - started,
                              None if frozen_at is None else time.time() - frozen_at),
              flush=True)
        return
    if not torch_adapter.attach_cuda(",".join(uuids)):
        raise UsageError(
            "gpufrac: CUDA was initialised in this kernel while it was parked (by code sent "
            "outside a cell), so it cannot see the GPU it got back. Restart the kernel.")
    take_gpu(hook, client, lease, uuids)
    back, left, _ = hook.reload()
    print(messages.unparked(hook.gpu_label(), time.monotonic() - started,
                            [r.name for r in back], sum(r.nbytes for r in back),
                            [r.name for r in left]), flush=True)


def take_gpu(hook: GpuFracHook, client: Any, lease: Mapping[str, Any], uuids: list[str]) -> None:
    """Where the kernel runs from now on, as the agent placed it."""
    gpu: dict[str, Any] = {}
    with contextlib.suppress(Exception):  # the labels only; the GPU is the lease's
        gpu = next((g for g in client.node().get("gpus", []) if g.get("uuid") in uuids), {})
    hook.env = replace(
        hook.env, parked=False, gpu_uuid=uuids[0] if uuids else None,
        gpu_index=gpu.get("index"), gpu_name=gpu.get("name"),
        gpu_total=gpu.get("memory_total"), context=int(gpu.get("context_size") or 0))
    hook.parked = hook.frozen = False
    with contextlib.suppress(ValueError):
        hook.ip.input_transformers_post.remove(hook._unpark_before_cell)
    hook.apply_cap()
