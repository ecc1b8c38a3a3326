"""Observations for the agent's metrics: sent off the cell's path, dropped (counted) when the
agent is away, never raised into the kernel."""

from __future__ import annotations

import time
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from harness.agent import AgentProcess, wait_for
from jupyter_gpufrac.kernel.observations import MAX_WAITING, ObservationSender
from node_agent.client import AgentClient


def test_an_absent_agent_costs_the_kernel_nothing(tmp_path: Path) -> None:
    sender = ObservationSender(lambda: AgentClient(str(tmp_path / "no-agent.sock")), "l-1")
    started = time.monotonic()
    for _ in range(MAX_WAITING * 3):
        sender.checkpoint("cell", 10, 10, 0.001)
    assert time.monotonic() - started < 0.5, "a report waited for the agent"
    wait_for(lambda: sender.dropped == MAX_WAITING * 3, 30, "every report dropped")
    assert sender.sent == 0


def test_reports_arrive_in_order_on_a_live_agent(tmp_path: Path) -> None:
    with AgentProcess(tmp_path / "agent", "1x1GiB") as agent:
        lease = agent.client().create_lease(client="t", request="0.25")
        sender = ObservationSender(agent.client, lease["id"])
        sender.offload("shrink", 5)
        sender.offload("manual", 7)
        sender.checkpoint("park", 3, 1, 0.5)
        wait_for(lambda: sender.sent == 3, 15, "three reports sent")
        assert sender.dropped == 0
        values = {(s.name, s.labels.get("reason") or s.labels.get("trigger")): s.value
                  for f in text_string_to_metric_families(agent.client().metrics())
                  for s in f.samples}
        assert values[("gpufrac_offloaded_bytes_total", "shrink")] == 5
        assert values[("gpufrac_offloaded_bytes_total", "manual")] == 7
        assert values[("gpufrac_checkpoint_duration_seconds_sum", "park")] == 0.5
