"""The hook's restores: the last good checkpoint into the namespace (at start, `%gpu restore`), its
report and message, and taking over the state an earlier kernel of the notebook left."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import asdict, replace
from typing import TYPE_CHECKING, Any

import psutil

from jupyter_gpufrac import contract
from jupyter_gpufrac.kernel import env as kenv
from jupyter_gpufrac.kernel import history, messages, offload, store, torch_adapter
from jupyter_gpufrac.kernel.checkpoint import CheckpointError
from jupyter_gpufrac.kernel.parking import HOST_ROOM_SHARE
from jupyter_gpufrac.kernel.state_file import header_generation
from jupyter_gpufrac.notebook_record import adopt

if TYPE_CHECKING:
    from jupyter_gpufrac.kernel.hook import GpuFracHook

log = logging.getLogger(__name__)


def restore(hook: GpuFracHook, reason: kenv.RestartReason | None, *, at_start: bool) -> dict[str, Any]:
    """Restore the last good checkpoint into the namespace; returns the report.

    ``ok`` in the report is true only when every variable came back and no cell was cut
    off: the server and the widget claim success on nothing less.
    """
    load_started = time.monotonic()
    previous = hook._previous_cells if at_start else {}
    running = previous.get("running")
    interrupted = str(running.get("cell")) if isinstance(running, dict) else None
    report: dict[str, Any] = {
        "time": time.time(), "kernel_id": hook.env.kernel_id, "pid": os.getpid(),
        "cause": reason.cause if reason else "manual",
        "reason": asdict(reason) if reason else None,
        "restored": [], "lost": [], "lost_reasons": {}, "newer_names": [], "deferred": {},
        "room": None,
        "interrupted_cell": interrupted,
        "checkpoint_time": None, "checkpoint_cell": None, "moved_to_cpu_bytes": 0,
        "ok": False, "error": None,
    }
    room = _room(hook) if at_start else None
    # The simulated node counts a kernel's whole memory; a GPU counts its device memory.
    measure = "bytes" if hook.env.simulated else "gpu_bytes"
    if hook.parked:
        # Everything lands in host memory (the park moved GPU tensors there first).
        room, measure = int(psutil.virtual_memory().available * HOST_ROOM_SHARE), "bytes"
    cpu_fallback = False
    # The newest generation known before loading: the server's, or this process's own.
    newest = max(hook.env.checkpoint_generation, hook.checkpointer.generation)
    try:
        if hook.env.checkpoints_off:
            raise CheckpointError(f"checkpoints are off for this kernel: "
                                  f"{hook.env.checkpoints_off}")
        try:
            loaded = hook.checkpointer.load(hook.ip.user_ns, budget=room, measure=measure)
        except CheckpointError as exc:
            oom = torch_adapter.oom_exception_types()
            if not (oom and isinstance(exc.__cause__, oom)):
                raise
            # The GPU tensors do not fit under the cap (or the GPU is busy): the variables
            # matter more than where they live, so load them into host memory instead.
            torch_adapter.empty_cache()
            loaded = hook.checkpointer.load(hook.ip.user_ns, device="cpu", budget=room,
                                            measure=measure)
            cpu_fallback = True
    except CheckpointError as exc:
        report["error"] = str(exc)
    else:
        known = set(loaded.restored) | set(loaded.lost) | set(loaded.modules) | set(
            loaded.deferred)
        newer = sorted(set(previous.get("names", [])) - known)
        began = running.get("execution_count") if isinstance(running, dict) else None
        # A cut-off cell did not run: the last that ran is the one before it.
        last_cell = began - 1 if isinstance(began, int) else previous.get("execution_count")
        _readopt_offloaded(hook, loaded.header.get("offloaded", []))
        hook._restored_names = [*loaded.restored, *loaded.modules]
        hook._rng_after_restore = loaded.rng_state or None
        report.update(
            restored=loaded.restored + loaded.modules, lost=sorted(loaded.lost),
            lost_reasons=loaded.lost, newer_names=newer,
            checkpoint_time=loaded.checkpoint_time, checkpoint_cell=loaded.execution_count,
            moved_to_cpu_bytes=loaded.moved_to_cpu_bytes, rng=loaded.rng,
            deferred=loaded.deferred, room=room,
            # Cells that ran after the checkpoint (its write failed, or had not ended)
            # lost their effects, whatever names came back.
            ok=(not loaded.lost and not newer and interrupted is None and not loaded.deferred
                and not _ran_after(last_cell, loaded.execution_count)),
            last_cell=last_cell if isinstance(last_cell, int) else None,
            cpu_reason=("they did not fit in this kernel's GPU memory limit"
                        if cpu_fallback else "this kernel has no CUDA device"),
        )
        found = header_generation(loaded.header)
        report["generation"] = found
        if newest and found < newest:
            # Loaded, but never as if it were the latest: its folder was replaced or
            # renamed (by someone who can write above it), or restored from a backup.
            older = (f"this checkpoint is older than the newest one recorded for it "
                     f"(generation {found} < {newest}): its folder was replaced or renamed "
                     f"since, so these variables are as they were then, not as after your "
                     f"last cells")
            log.warning("gpufrac: %s", older)
            report.update(older=older, ok=False)
    hook._restore_reason = reason
    report["seconds"] = time.monotonic() - load_started
    hook.restore_report = report  # the server asks for it (server_channel)
    report["message"] = restore_text(hook, report["time"])
    return report


def restore_text(hook: GpuFracHook, now: float | None = None) -> str:
    """The last restore for people, its ages counted to ``now`` (when it is shown)."""
    r = hook.restore_report
    if r is None:
        return ""
    text = messages.restore_message(
        hook._restore_reason, restored=r["restored"], lost=r["lost_reasons"],
        checkpoint_time=r["checkpoint_time"], checkpoint_cell=r["checkpoint_cell"],
        last_cell=r.get("last_cell"), newer_names=r["newer_names"],
        moved_to_cpu_bytes=r["moved_to_cpu_bytes"], interrupted_cell=r["interrupted_cell"],
        error=r["error"], deferred=r["deferred"], room=r["room"], now=now,
        **({"cpu_reason": r["cpu_reason"]} if r.get("cpu_reason") else {}))
    return f"Warning: {r['older']}.\n{text}" if r.get("older") else text


def _room(hook: GpuFracHook) -> int | None:
    """What this kernel may load without setting off a reclaim (None: no limit known).

    A kernel stopped to give loaned memory back that loads all of it again would only be
    stopped again: what does not fit waits on disk.
    """
    lease = hook.lease_info(timeout=2.0)
    room = lease.get("room") if lease else None
    return int(room) if isinstance(room, int) else None


def restore_deferred(hook: GpuFracHook, names: list[str]) -> tuple[list[str], dict[str, str]]:
    """Load variables a restore kept on disk (``names``, or all); (loaded, lost)."""
    restored, lost = hook.checkpointer.load_deferred(hook.ip.user_ns, names)
    hook._restored_names += restored
    return restored, lost


def resume(hook: GpuFracHook) -> dict[str, Any]:
    """``%gpu restore`` in a fresh kernel: take over the state its notebook's earlier kernel
    left (the server offered it) as a kernel resumed at start does: its folder becomes this
    kernel's, then variables, generators and cell numbers come back. Raises
    CheckpointError when it cannot be taken over (nothing changed then)."""
    offer = hook.env.resumable
    if offer is None:
        raise CheckpointError("no earlier state of this notebook waits to be taken over")
    hook.flush_checkpoints()
    folder = hook.env.checkpoint_dir
    try:
        adopt(folder.parent, offer.folder, folder.name, (contract.WAKE_SOCKET,))
    except (OSError, store.UnsafeCheckpointError) as exc:
        raise CheckpointError(f"the earlier state in {folder.parent / offer.folder} could "
                              f"not be taken over ({exc})") from None
    hook.env = replace(hook.env, resumable=None)
    hook.checkpointer = hook._make_checkpointer(
        max(offer.generation, hook.checkpointer.generation))
    hook._previous_cells = hook._read_previous_cells()
    report = restore(hook, offer.reason, at_start=True)
    last = history.last_number(hook._previous_cells, report.get("checkpoint_cell"))
    if last is not None:
        history.continue_after(hook.ip, hook._previous_cells, last, set(report["restored"]),
                               running=True)
    return report


def restore_at_start(hook: GpuFracHook) -> None:
    """GPUFRAC_RESTORE: bring the variables back and keep the message for the first cell."""
    report = restore(hook, hook.env.restart_reason, at_start=True)
    # The notebook's cell numbers go on from the old process's (its In/Out with them).
    last = history.last_number(hook._previous_cells, report.get("checkpoint_cell"))
    if last is not None:
        history.continue_after(hook.ip, hook._previous_cells, last, set(report["restored"]))
    # Output at load time reaches the kernel's log, not a cell: tell it with the first cell.
    print(report["message"], flush=True)
    hook._restore_untold = True
    # The restored state is the last good one from now on; the cut-off cell is reported once.
    hook._write_cells(running=None)


def _readopt_offloaded(hook: GpuFracHook, records: list[Any]) -> None:
    ns = hook.ip.user_ns
    adopted = []
    for raw in records:
        if isinstance(raw, dict) and raw.get("name") in ns:
            value = ns[raw["name"]]
            adopted.append(offload.Offloaded(raw["name"], raw.get("kind", "tensor"),
                                             raw.get("device", "cuda"),
                                             int(raw.get("nbytes", 0)), id(value)))
    hook.offloaded = adopted


def _ran_after(last_cell: object, checkpoint_cell: object) -> bool:
    """Whether cell ``last_cell`` ran after the checkpoint taken after ``checkpoint_cell``."""
    return (isinstance(last_cell, int) and isinstance(checkpoint_cell, int)
            and 0 < checkpoint_cell < last_cell)
