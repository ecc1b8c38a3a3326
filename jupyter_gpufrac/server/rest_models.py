"""The REST models of docs/server-api.md: a kernel's GPU status and the node's."""

from __future__ import annotations

from typing import Any

from jupyter_gpufrac.server.account import kernel_account
from jupyter_gpufrac.server.kernels import KernelGpu
from jupyter_gpufrac.server.notebook_states import EarlierState, how_it_ended


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
        owed = status.get("owed_cell")
        model["owed_cell"] = owed if isinstance(owed, int) else None
        model["error"] = str(status["error"])[:1000] if status.get("error") else None
    return model


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
    resumable: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """``GET /api/gpufrac/kernels/<kernel_id>``: the kernel's account, and what lies behind it."""
    account = kernel_account(kernel, gpu, lease, events, agent_error=agent_error)
    return {
        "kernel_id": kernel_id,
        "state": account["state"],
        "reason": account["reason"],
        "deadline": account["deadline"],
        "notebook": notebook,
        "restore": gpu.last_restore if gpu is not None else None,
        "gpu": account["gpu"],
        "frozen_on": account["frozen_on"],
        "request": account["request"],
        "limit": account["limit"],
        "usage": account["usage"],
        # What keeps its state while it has no GPU, and why freezing could not be used.
        "protection": lease.get("protection") if lease else None,
        "fallback": (lease.get("fallback") or None) if lease else None,
        "lease": lease,
        "share_source": account["share_source"],
        "last_event": account["last_event"],
        # What a restart restores now: the last durable checkpoint's cell and time, the
        # variables it left out to stay within the disk budget, and the write in progress.
        "checkpoint": checkpoint_model(gpu.recovery_point if gpu is not None else None,
                                       checkpoint_status),
        # What this kernel's and all the user's kernels' checkpoints take on disk.
        "checkpoint_disk": checkpoint_disk,
        # Why this kernel takes no checkpoints (a folder another user can write), or None.
        "checkpoints_off": gpu.checkpoints_off if gpu is not None else None,
        # An earlier kernel's state of its notebook waiting for the user's word, or None.
        "resumable": resumable,
        "events": events,
    }


def resumable_model(state: EarlierState | None,
                    events: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The kernel view's ``resumable``: what an earlier kernel of the notebook left, and the
    question put to the user (the ``resumable`` event's message, once asked)."""
    if state is None:
        return None
    asked = next((e["message"] for e in reversed(events) if e["event"] == "resumable"), None)
    return {"cell": state.cell, "time": state.time, "variables": len(state.names),
            "ended": how_it_ended(state), "message": asked}


def node_model(
    node: dict[str, Any] | None,
    leases: list[dict[str, Any]],
    agent: dict[str, Any],
    config_problems: list[str],
    spares: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """``GET /api/gpufrac/node``: the GPUs, which of this user's leases sit on each, the agent,
    what is wrong with this server's c.GpuFrac settings, and its spare kernels (None: off)."""
    if node is None:
        return {"simulated": False, "backend": None, "mps": False, "freezing": None,
                "agent": agent, "gpus": [], "leases": [], "config_problems": config_problems,
                "spares": spares}
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
        # Whether the node freezes kernels, and why not (the driver, a call that hangs, the
        # agent's own test of it): kernels parked or reclaimed are checkpointed otherwise.
        "freezing": {key: freezing.get(key) for key in ("available", "why")}
        if isinstance(freezing := node.get("freezing"), dict) else None,
        "agent": agent,
        "gpus": gpus,
        "leases": leases,
        "config_problems": config_problems,
        "spares": spares,
    }
