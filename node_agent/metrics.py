"""Prometheus text exposition of the node's GPUs and leases, in bytes."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from node_agent.service import Agent, Caller


def _labels(**labels: object) -> str:
    def esc(v: object) -> str:
        return str(v).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")

    return "{" + ",".join(f'{k}="{esc(v)}"' for k, v in labels.items()) + "}"


def render_metrics(agent: Agent, caller: Caller) -> str:
    """Metrics the caller may see: every GPU; their own leases (all, for admins)."""
    lines: list[str] = []

    def family(name: str, kind: str, help_text: str) -> None:
        lines.append(f"# HELP {name} {help_text}")
        lines.append(f"# TYPE {name} {kind}")

    family("gpufrac_gpu_memory_total_bytes", "gauge", "Device memory of the GPU.")
    for g in agent.gpus:
        lines.append(f"gpufrac_gpu_memory_total_bytes{_labels(gpu=g.uuid, index=g.index)} {g.memory_total}")
    family("gpufrac_gpu_memory_used_bytes", "gauge", "Device memory in use, all processes.")
    for g in agent.gpus:
        lines.append(f"gpufrac_gpu_memory_used_bytes{_labels(gpu=g.uuid, index=g.index)} {g.memory_used}")
    family("gpufrac_gpu_healthy", "gauge", "1 when the GPU answers normally.")
    for g in agent.gpus:
        lines.append(f"gpufrac_gpu_healthy{_labels(gpu=g.uuid, index=g.index)} {int(g.healthy)}")

    leases = agent.visible(caller)
    for metric, attr, help_text in (
        ("gpufrac_lease_request_bytes", "request", "Guaranteed memory of the lease, per device."),
        ("gpufrac_lease_limit_bytes", "limit", "Most memory the lease may use, per device."),
        ("gpufrac_lease_usage_bytes", "usage", "Device memory the lease's processes hold."),
    ):
        family(metric, "gauge", help_text)
        for lease in leases:
            for gpu in lease.physical:
                labels = _labels(lease=lease.id, gpu=gpu, kind=lease.kind, state=lease.state,
                                 owner_uid=lease.owner_uid)
                lines.append(f"{metric}{labels} {getattr(lease, attr)}")
    for metric, attr, help_text in (
        ("gpufrac_lease_compute_request_ratio", "compute_request",
         "Share of the GPU's compute the lease asked for (0-1)."),
        ("gpufrac_lease_compute_limit_ratio", "compute_limit",
         "Most of the GPU's compute the lease may use (0-1; enforced only under CUDA MPS)."),
        ("gpufrac_lease_compute_usage_ratio", "compute_usage",
         "SM utilization of the lease's processes, as sampled by the driver (0-1)."),
    ):
        family(metric, "gauge", help_text)
        for lease in leases:
            value = getattr(lease, attr)
            if value is None:
                continue  # not asked for, or not sampled: no series rather than a false 0
            ratio = value / 100 if attr == "compute_usage" else value
            for gpu in lease.physical:
                lines.append(f"{metric}{_labels(lease=lease.id, gpu=gpu)} {ratio:g}")
    family("gpufrac_actions_total", "counter", "Directives and kills issued by the agent.")
    for action in ("migrations", "shrinks", "kills"):
        lines.append(f"gpufrac_actions_total{_labels(action=action)} {agent.counters[action]}")
    family("gpufrac_poll_seconds", "gauge", "Duration of the last poll of the GPUs.")
    lines.append(f"gpufrac_poll_seconds {agent.tick_seconds:.6f}")
    return "\n".join(lines) + "\n"
