"""One account of each kernel (state, GPU, share and its source, last event) that every view reads."""

from __future__ import annotations

import datetime
import time
from typing import Any

from jupyter_gpufrac import contract
from jupyter_gpufrac.server.kernels import KernelGpu
from jupyter_gpufrac.server.launch import lease_gpus
from node_agent.words import named_for_people

NOT_OURS = (
    "This kernel was not started by the gpufrac provisioner; set "
    "c.KernelProvisionerFactory.default_provisioner_name = 'gpufrac-provisioner' "
    "or name it in the kernelspec's metadata.kernel_provisioner."
)


def _agent_reason(lease: dict[str, Any]) -> str | None:
    """The agent's reason for a lease's state, as people read it (leases by name, no ids)."""
    return named_for_people(str(lease.get("reason") or "")) or None


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
    used: bool | None = None,
) -> tuple[str, str | None, float | None]:
    """``(state, reason, deadline)`` as docs/server-api.md defines them (``used``: as if the
    user had, or had not, run something since the last event; None: as the kernel says).

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
        return "migrating", step["message"] if step else _agent_reason(lease), None
    if state in contract.LEASE_STATE_SHOWN:
        # The server's own sentence where it has one: a frozen lease waits for the job or the
        # owner it was frozen for (the agent's reason lists every GPU's shortfall).
        wanted = {"shrinking": "shrink_requested", "killed": "oom_killed", "parked": "parked",
                  "pending": "frozen" if lease.get("frozen") else ""}
        event = next((e for e in reversed(events) if e["event"] == wanted.get(state)), None)
        reason = event["message"] if event else _agent_reason(lease)
        return contract.LEASE_STATE_SHOWN[state], reason, None
    # A bursting notice right after a restore must not hide what the restore lost.
    last = next((e for e in reversed(events) if e["event"] != "bursting"), None)
    if used is None and last is not None:
        used = _activity_after(kernel, last["time"])
    if last is not None and last["event"] == "restored" and not used:
        # Shown until the user does something in the kernel, so a returning user reads it.
        restored = "restored" if last.get("ok") else "restore-incomplete"
        return restored, str(last["message"]), None
    if lease.get("bursting"):
        return "bursting", None, None
    return "guaranteed", None, None


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


def kernel_account(
    kernel: Any,
    gpu: KernelGpu | None,
    lease: dict[str, Any] | None,
    events: list[dict[str, Any]],
    *,
    agent_error: str | None = None,
    now: float | None = None,
) -> dict[str, Any]:
    """What every surface says of a kernel, from its lease as last read and its events.

    The REST kernel view, each lease of the node view, and through them the status item,
    the panel and its node table all show this; an event changes it as it is recorded.
    """
    state, reason, deadline = kernel_state(kernel, gpu, lease, events, agent_error=agent_error,
                                           now=now)
    device = None
    if lease is not None and gpu is not None:
        # Where the kernel runs now: a move shows its target only once the kernel is there.
        uuids = lease_gpus({**lease, "state": "active"})
        if uuids:
            device = gpu_model(gpu.gpus.get(uuids[0], {"uuid": uuids[0]}), gpu.simulated)
    frozen_on = None
    if lease is not None and gpu is not None and lease.get("frozen") and lease.get("frozen_gpus"):
        uuid = str(lease["frozen_gpus"][0])
        frozen_on = gpu_model(gpu.gpus.get(uuid, {"uuid": uuid}), gpu.simulated)
    last = events[-1] if events else None
    return {
        "state": state,
        "reason": reason,
        "deadline": deadline,
        "gpu": device,
        # While frozen, the GPU it was frozen on: the one it thaws onto where it can.
        "frozen_on": frozen_on,
        "request": lease.get("request") if lease else None,
        "limit": lease.get("limit") if lease else None,
        "usage": lease.get("usage") if lease else None,
        # Where request and limit came from (None: the lease predates this server process).
        "share_source": gpu.share_source if gpu is not None else None,
        "last_event": (
            {"event": last["event"], "message": last["message"], "time": last["time"]}
            if last is not None else None
        ),
    }


def kernel_push(
    kernel: Any,
    gpu: KernelGpu,
    lease: dict[str, Any] | None,
    events: list[dict[str, Any]],
    *,
    agent_error: str | None = None,
) -> dict[str, Any]:
    """The account the server leaves the kernel (contract.ACCOUNT_FILE) for `%gpu`, with
    ``once_used``: the state once its user runs a cell after the last event (a restore is news
    only until then), which the kernel shows from such a cell on."""
    account = kernel_account(kernel, gpu, lease, events, agent_error=agent_error)
    state, reason, deadline = kernel_state(kernel, gpu, lease, events, agent_error=agent_error,
                                           used=True)
    return {**account, "once_used": {"state": state, "reason": reason, "deadline": deadline}}
