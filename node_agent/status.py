"""What `gpufrac-agent status` shows: the stable JSON document and the table for people."""

from __future__ import annotations

from typing import Any

from node_agent.client import AgentClient
from node_agent.quantities import format_bytes
from node_agent.words import (
    CHECKPOINT_ON_DISK,
    lease_name,
    lease_state_words,
    named_for_people,
    user_name,
)

# The stable keys of `status --json`: scripts depend on them.
STATUS_GPU_KEYS = ("uuid", "index", "name", "memory_total", "memory_used")
STATUS_LEASE_KEYS = ("id", "kind", "owner_uid", "request", "limit", "usage", "logical_gpu",
                     "physical_gpu", "physical_gpus", "state", "pod", "protection", "fallback")


def status_document(client: AgentClient) -> dict[str, Any]:
    """The stable `status --json` document: only the documented keys, bytes as integers."""
    node = client.node()
    leases = client.leases()
    return {
        "gpus": [{k: g[k] for k in STATUS_GPU_KEYS} for g in node["gpus"]],
        "leases": [{k: lease[k] for k in STATUS_LEASE_KEYS} for lease in leases],
    }


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
                     for r in rows)


def render_status(node: dict[str, Any], leases: list[dict[str, Any]]) -> str:
    index = {g["uuid"]: g["index"] for g in node["gpus"]}

    def gpu(uuid: str | None) -> str:
        return "-" if uuid is None else str(index.get(uuid, uuid))

    title = "simulated node" if node["simulated"] else "node (NVML)"
    gpu_rows = [["GPU", "NAME", "USED", "TOTAL", "UUID"]] + [
        [str(g["index"]), g["name"], format_bytes(g["memory_used"]),
         format_bytes(g["memory_total"]), g["uuid"] + ("" if g["healthy"] else f"  ({g['error']})")]
        for g in node["gpus"]
    ]
    out = [f"{title}: {len(node['gpus'])} GPU(s)", _table(gpu_rows), ""]
    if not leases:
        out.append("no leases")
        return "\n".join(out)
    # Leases by name and users by name: ids are in `--json`.
    lease_rows = [["LEASE", "USER", "REQUEST", "LIMIT", "USAGE", "COMPUTE", "LOGICAL",
                   "PHYSICAL", "STATE", "KEPT BY"]]
    for lease in leases:
        state = lease_state_words({**lease, "frozen": False})
        if lease["state"] == "parked" or lease.get("parked_at") is not None:
            # It holds no GPU: say what it will need when its kernel runs a cell.
            state += f", needs {format_bytes(lease['request'])}"
            if lease.get("frozen"):
                state += f", {format_bytes(lease['frozen_bytes'])} frozen"
        physical = ",".join(gpu(u) for u in lease["physical_gpus"]) or "-"
        if lease["target_gpus"]:
            physical += " -> " + ",".join(gpu(u) for u in lease["target_gpus"])
        lease_rows.append([
            named_for_people(lease_name(lease)), user_name(int(lease["owner_uid"])),
            format_bytes(lease["request"]),
            format_bytes(lease["limit"]), format_bytes(lease["usage"]), compute_text(lease),
            ",".join(gpu(u) for u in lease["logical_gpus"]) or "-", physical, state,
            protection_text(lease),
        ])
    pods = [lease.get("pod") for lease in leases]
    if any(pods):
        # On Kubernetes: the pod container each lease's processes run in (or that holds it).
        lease_rows[0].append("POD")
        for row, pod in zip(lease_rows[1:], pods, strict=True):
            row.append("/".join((pod["namespace"], pod["name"], pod["container"])) if pod else "-")
    out.append(_table(lease_rows))
    freezing = node.get("freezing") or {}
    if freezing.get("available"):
        out.append(f"freezing: on ({format_bytes(freezing['frozen_bytes'])} of "
                   f"{format_bytes(freezing['budget'])} host memory frozen"
                   + ("; thaws onto other GPUs of the same model" if freezing["remap"] else "")
                   + ")")
    elif freezing:
        out.append(f"freezing: off ({freezing['why']}); kernels are checkpointed and restarted")
    if any(lease.get("compute_request") is not None for lease in leases):
        out.append("compute shares: " + ("held by CUDA MPS (active-thread percentage)"
                                         if node.get("mps") else
                                         "recorded, not enforced (no CUDA MPS on this node)"))
    return "\n".join(out)


def protection_text(lease: dict[str, Any]) -> str:
    """What keeps a notebook's state while it has no GPU; where freezing fell back, why."""
    if lease["kind"] != "notebook":
        return "-"
    text = str(lease.get("protection") or CHECKPOINT_ON_DISK)
    return f"{text} (not frozen: {lease['fallback']})" if lease.get("fallback") else text


def compute_text(lease: dict[str, Any]) -> str:
    """``37% of 0.25-0.5``: sampled SM utilization against the compute share asked for."""
    used = lease.get("compute_usage")
    text = "-" if used is None else f"{used}%"
    request, limit = lease.get("compute_request"), lease.get("compute_limit")
    if request is not None:
        share = f"{request:g}" if limit in (None, request) else f"{request:g}-{limit:g}"
        text += f" of {share}"
    return text
