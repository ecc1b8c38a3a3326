"""The REST models of docs/server-api.md: a kernel's GPU status and the node's."""

from __future__ import annotations

import datetime
import time
from typing import Any

from jupyter_gpufrac import contract
from jupyter_gpufrac.server.kernels import KernelGpu
from jupyter_gpufrac.server.launch import lease_gpus

NOT_OURS = (
    "This kernel was not started by the gpufrac provisioner; set "
    "c.KernelProvisionerFactory.default_provisioner_name = 'gpufrac-provisioner' "
    "or name it in the kernelspec's metadata.kernel_provisioner."
)


def _activity_after(kernel: Any, when: float) -> bool:
    last = getattr(kernel, "last_activity", None)
    if not isinstance(last, datetime.datetime):
        return False
    return last.timestamp() > when + 1.0


def kernel_state(
    kernel: Any,
    gpu: KernelGpu | None,
    lease: dict[str, Any] | None,
    events: list[dict[str, Any]],
    *,
    agent_error: str | None = None,
    now: float | None = None,
) -> tuple[str, str | None, float | None]:
    """``(state, reason, deadline)`` as docs/server-api.md defines them.

    Nothing is called guaranteed or restored that was not verified: without the agent the
    share is unverified, and a restore that lost anything is ``restore-incomplete``.
    """
    now = time.time() if now is None else now
    if gpu is None:
        return "no-gpu", NOT_OURS, None
    if lease is None:
        return "no-gpu", gpu.no_gpu_reason or "This kernel has no GPU lease.", None
    if agent_error is not None:
        return "agent-unreachable", agent_error, None
    state = str(lease.get("state") or "active")
    if state == "migrating":
        step = next((e for e in reversed(events) if e["event"] in ("move_pending", "migrating")),
                    None)
        if step is not None and step["event"] == "move_pending" and step.get("deadline", 0) > now:
            return "move-pending", step["message"], float(step["deadline"])
        return "migrating", step["message"] if step else (lease.get("reason") or None), None
    if state in contract.LEASE_STATE_SHOWN:
        wanted = {"shrinking": "shrink_requested", "killed": "oom_killed", "parked": "parked"}
        event = next((e for e in reversed(events) if e["event"] == wanted.get(state)), None)
        reason = event["message"] if event else (lease.get("reason") or None)
        return contract.LEASE_STATE_SHOWN[state], reason, None
    # A bursting notice right after a restore must not hide what the restore lost.
    last = next((e for e in reversed(events) if e["event"] != "bursting"), None)
    if last is not None and last["event"] == "restored" and not _activity_after(kernel, last["time"]):
        # Shown until the user does something in the kernel, so a returning user reads it.
        restored = "restored" if last.get("ok") else "restore-incomplete"
        return restored, str(last["message"]), None
    if lease.get("bursting"):
        return "bursting", None, None
    return "guaranteed", None, None


def checkpoint_model(point: dict[str, Any] | None,
                     status: dict[str, Any] | None) -> dict[str, Any] | None:
    """The kernel view's ``checkpoint``: the recovery point its header on disk gives, and when
    the kernel answered (``status``, Checkpointer.status), the write in progress and the error."""
    if point is None and status is None:
        return None
    model: dict[str, Any] = dict(point or {
        "durable_cell": None, "durable_time": None, "durable_generation": 0,
        "unprotected": {}, "unprotected_why": None})
    if status is not None:
        writing = status.get("writing")
        model["writing"] = ({key: writing.get(key) for key in
                             ("cell", "bytes_done", "bytes_total", "queued")}
                            if isinstance(writing, dict) else None)
        model["error"] = str(status["error"])[:1000] if status.get("error") else None
    return model


def gpu_model(gpu: dict[str, Any] | None, simulated: bool) -> dict[str, Any] | None:
    """The short GPU description of the kernel status."""
    if gpu is None:
        return None
    return {
        "uuid": gpu.get("uuid"),
        "index": gpu.get("index"),
        "name": gpu.get("name"),
        "simulated": simulated,
        "memory_total": gpu.get("memory_total"),
    }


def kernel_model(
    kernel_id: str,
    kernel: Any,
    gpu: KernelGpu | None,
    lease: dict[str, Any] | None,
    events: list[dict[str, Any]],
    *,
    agent_error: str | None = None,
    notebook: str | None = None,
    checkpoint_disk: dict[str, Any] | None = None,
    checkpoint_status: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """``GET /api/gpufrac/kernels/<kernel_id>``."""
    state, reason, deadline = kernel_state(kernel, gpu, lease, events, agent_error=agent_error)
    device = None
    if lease is not None and gpu is not None:
        # Where the kernel runs now: a move shows its target only once the kernel is there.
        uuids = lease_gpus({**lease, "state": "active"})
        if uuids:
            device = gpu_model(gpu.gpus.get(uuids[0], {"uuid": uuids[0]}), gpu.simulated)
    return {
        "kernel_id": kernel_id,
        "state": state,
        "reason": reason,
        "deadline": deadline,
        "notebook": notebook,
        "restore": gpu.last_restore if gpu is not None else None,
        "gpu": device,
        "request": lease.get("request") if lease else None,
        "limit": lease.get("limit") if lease else None,
        "usage": lease.get("usage") if lease else None,
        # What keeps its state while it has no GPU, and why freezing could not be used.
        "protection": lease.get("protection") if lease else None,
        "fallback": (lease.get("fallback") or None) if lease else None,
        "lease": lease,
        # Where request and limit came from (None: the lease predates this server process).
        "share_source": gpu.share_source if gpu is not None else None,
        # What a restart restores now: the last durable checkpoint's cell and time, the
        # variables it left out to stay within the disk budget, and the write in progress.
        "checkpoint": checkpoint_model(gpu.recovery_point if gpu is not None else None,
                                       checkpoint_status),
        # What this kernel's and all the user's kernels' checkpoints take on disk.
        "checkpoint_disk": checkpoint_disk,
        # Why this kernel takes no checkpoints (a folder another user can write), or None.
        "checkpoints_off": gpu.checkpoints_off if gpu is not None else None,
        "events": events,
    }


def node_model(
    node: dict[str, Any] | None,
    leases: list[dict[str, Any]],
    agent: dict[str, Any],
    config_problems: list[str],
) -> dict[str, Any]:
    """``GET /api/gpufrac/node``: the GPUs, which of this user's leases sit on each, the agent,
    and what is wrong with this server's c.GpuFrac settings."""
    if node is None:
        return {"simulated": False, "backend": None, "mps": False, "agent": agent, "gpus": [],
                "leases": [], "config_problems": config_problems}
    simulated = bool(node.get("simulated"))
    gpus = []
    for gpu in node.get("gpus", []):
        model = {
            key: gpu.get(key)
            for key in (
                "uuid", "index", "name", "memory_total", "memory_used", "memory_free",
                "utilization", "healthy",
            )
        }
        model["simulated"] = simulated
        model["leases"] = [
            lease["id"] for lease in leases if gpu.get("uuid") in (lease.get("physical_gpus") or [])
        ]
        gpus.append(model)
    return {
        "simulated": simulated,
        "backend": node.get("backend"),
        "mps": bool(node.get("mps")),
        "agent": agent,
        "gpus": gpus,
        "leases": leases,
        "config_problems": config_problems,
    }
