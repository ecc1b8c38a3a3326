"""/metrics against a real agent: per-GPU shares, moves timed from `migrate` to `migrated`,
shrinks and kills by cause; and the Grafana dashboard that reads them."""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample
from unix_users import as_user

from harness.agent import AgentProcess, wait_for
from node_agent import metrics
from node_agent.client import AgentClient
from node_agent.devices.simulated import SimulatedBackend
from node_agent.ledger import Ledger
from node_agent.quantities import parse_quantity
from node_agent.service import Agent, AgentConfig, Caller, CreateLease
from node_agent.stats import MOVE_BUCKETS, AgentStats, Histogram

from .conftest import Holder

MiB = 2**20
NOBODY = 65534
DASHBOARD = Path(__file__).resolve().parents[2] / "docs" / "grafana" / "gpufrac-dashboard.json"


def _samples(text: str) -> list[Sample]:
    return [s for f in text_string_to_metric_families(text) for s in f.samples]


def _value(samples: list[Sample], name: str, **labels: str) -> float:
    """The one sample of ``name`` whose labels include ``labels``."""
    [found] = [s for s in samples if s.name == name and s.labels.items() >= labels.items()]
    return found.value


def _buckets(samples: list[Sample], outcome: str) -> list[tuple[float, float]]:
    return sorted((float(s.labels["le"]), s.value) for s in samples
                  if s.name == "gpufrac_move_duration_seconds_bucket"
                  and s.labels["outcome"] == outcome)


def _notebook(c: AgentClient, holders: Callable[..., Holder], request: str, limit: str,
              mib: int) -> tuple[dict[str, Any], Holder]:
    lease = c.create_lease(client="jupyter", request=request, limit=limit)
    h = holders(CUDA_VISIBLE_DEVICES=lease["physical_gpu"])
    lease = c.register_pid(lease["id"], h.pid)
    h.hold(mib)
    return lease, h


def test_moves_are_counted_and_timed_by_outcome(
    start_agent: Callable[..., AgentProcess], holders: Callable[..., Holder]
) -> None:
    agent = start_agent("--migrate-grace", "3")
    c = agent.client()
    before = _samples(c.metrics())
    # Every cause is there at 0 before anything happens: rate() then sees the first event.
    for cause in ("compaction", "request_changed"):
        assert _value(before, "gpufrac_moves_started_total", cause=cause) == 0
    for cause in ("reclaim", "limit", "migrate_timeout"):
        assert _value(before, "gpufrac_kills_total", cause=cause) == 0
    assert _value(before, "gpufrac_move_duration_seconds_count", outcome="migrated") == 0
    assert 0 < _value(before, "gpufrac_agent_start_time_seconds") <= time.time()

    # Two notebooks spread over the two GPUs; a job asks for a whole one, so one must move.
    _notebook(c, holders, "0.25", "1", 10)
    b, b_proc = _notebook(c, holders, "0.25", "1", 10)
    _, cursor = c.directives(client="jupyter", after=-1, timeout=0)
    job = c.create_lease(client="t", request="1", kind="job")
    found, cursor = c.directives(client="jupyter", after=cursor, timeout=10)
    [move] = found
    assert (move["kind"], move["lease_id"]) == ("migrate", b["id"])
    moving = _samples(c.metrics())
    assert _value(moving, "gpufrac_moves_started_total", cause="compaction") == 1
    assert _value(moving, "gpufrac_move_duration_seconds_count", outcome="migrated") == 0

    # The client moves it, and says so: one move ends, "migrated", timed from the directive.
    b_proc.stop()
    started = time.monotonic()
    c.register_pid(b["id"], holders(CUDA_VISIBLE_DEVICES=move["to_gpu"]).pid)
    c.migrated(b["id"])
    moved = _samples(c.metrics())
    assert _value(moved, "gpufrac_move_duration_seconds_count", outcome="migrated") == 1
    took = _value(moved, "gpufrac_move_duration_seconds_sum", outcome="migrated")
    assert 0 < took < time.monotonic() - started + 10
    buckets = _buckets(moved, "migrated")
    assert [le for le, _ in buckets] == [*MOVE_BUCKETS, float("inf")]
    assert [n for _, n in buckets] == sorted(n for _, n in buckets), "cumulative"
    assert buckets[-1][1] == 1
    assert _value(moved, "gpufrac_move_duration_seconds_count", outcome="migrate_timeout") == 0
    wait_for(lambda: c.lease(job["id"])["state"] == "active", what="the job placed")
    c.release(job["id"])

    # A third notebook goes to the idle GPU; a second job moves it, and nobody moves it:
    # killed at the deadline, counted as a timed-out move and a kill of that cause.
    third, third_proc = _notebook(c, holders, "0.25", "1", 10)
    job = c.create_lease(client="t", request="1", kind="job")
    wait_for(lambda: not third_proc.alive(), timeout=20, what="the move timed out")
    done = wait_for(lambda: (m := _samples(c.metrics())) and _value(
        m, "gpufrac_kills_total", cause="migrate_timeout") == 1 and m, what="the kill counted")
    assert _value(done, "gpufrac_moves_started_total", cause="compaction") == 2
    assert _value(done, "gpufrac_move_duration_seconds_count", outcome="migrate_timeout") == 1
    assert _value(done, "gpufrac_move_duration_seconds_sum", outcome="migrate_timeout") >= 3
    assert _value(done, "gpufrac_move_duration_seconds_count", outcome="migrated") == 1
    assert _value(done, "gpufrac_kills_total", cause="reclaim") == 0
    assert c.lease(third["id"])["state"] == "killed"
    # The counters carry the node's name, as the GPU series do, for one dashboard variable.
    [gpu_host] = {s.labels["hostname"] for s in done if s.name == "gpufrac_gpu_healthy"}
    assert {s.labels["hostname"] for s in done if s.name.startswith("gpufrac_kills")} == {gpu_host}


def test_reclaim_shows_in_gpu_shares_and_counts_a_shrink_and_a_kill(
    start_agent: Callable[..., AgentProcess], holders: Callable[..., Holder]
) -> None:
    agent = start_agent("--reclaim-grace", "1", "--headroom", "0.25", "--no-freeze",
                        spec="1x1GiB")
    c = agent.client()
    owner, owner_proc = _notebook(c, holders, "512Mi", "512Mi", 100)
    borrower, _ = _notebook(c, holders, "128Mi", "1", 450)
    _notebook(c, holders, "128Mi", "1", 1)
    wait_for(lambda: c.lease(borrower["id"])["bursting"], what="borrower bursting")

    # Per GPU: the sum of the requests, what is lent above them and what is owed under them.
    def shares() -> tuple[float, float, float, list[dict[str, Any]]]:
        leases = c.leases()
        got = _samples(c.metrics())
        return (_value(got, "gpufrac_gpu_requested_bytes"), _value(got, "gpufrac_gpu_loaned_bytes"),
                _value(got, "gpufrac_gpu_owed_bytes"), leases)

    requested, loaned, owed, leases = shares()
    assert requested == (512 + 128 + 128) * MiB
    want_loaned = sum(max(0, x["usage"] - x["request"]) for x in leases)
    want_owed = sum(max(0, x["request"] - x["usage"]) for x in leases)
    # Usage is measured between the two reads: allow a few MiB of drift.
    assert abs(loaned - want_loaned) < 16 * MiB and loaned > 250 * MiB
    assert abs(owed - want_owed) < 16 * MiB and owed > 0

    # Another user sees the GPU figures and the node-wide counters, not root's leases.
    seen = as_user(NOBODY, lambda: agent.client().metrics())["ok"]
    assert owner["id"] not in seen and borrower["id"] not in seen
    assert "gpufrac_gpu_loaned_bytes{" in seen and 'gpufrac_kills_total{cause="reclaim"' in seen

    owner_proc.hold(300)  # the owner grows into what the borrower holds: shrink, then kill
    wait_for(lambda: c.lease(borrower["id"])["state"] == "killed", what="the borrower killed")
    after = _samples(c.metrics())
    assert _value(after, "gpufrac_shrinks_total", cause="reclaim") == 1
    assert _value(after, "gpufrac_shrinks_total", cause="limit") == 0
    assert _value(after, "gpufrac_kills_total", cause="reclaim") == 1
    assert _value(after, "gpufrac_kills_total", cause="migrate_timeout") == 0
    assert _value(after, "gpufrac_actions_total", action="kills") == 1
    # A killed lease holds nothing: it leaves the GPU's requested sum.
    assert _value(after, "gpufrac_gpu_requested_bytes") == (512 + 128) * MiB


def test_histogram_buckets_are_le_and_a_released_move_ends() -> None:
    hist = Histogram((1.0, 2.0))
    for value in (0.5, 1.0, 1.5, 9.0):
        hist.observe(value)
    assert hist.cumulative() == [("1.0", 2), ("2.0", 3), ("+Inf", 4)]
    assert hist.total == 12.0
    stats = AgentStats()
    stats.move_started("l-1", "compaction")
    stats.move_started("l-1", "compaction")  # sent on elsewhere: still one move
    stats.move_ended("l-1", "released")
    stats.move_ended("l-1", "migrated")  # already ended: not counted twice
    stats.move_ended("l-2", "migrated")  # started before a restart: not timed
    assert stats.moves_started["compaction"] == 2
    assert [h.cumulative()[-1][1] for h in stats.move_seconds.values()] == [0, 0, 1]


# --- the Grafana dashboard ------------------------------------------------------------------

def _panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for panel in dashboard["panels"]:
        out.append(panel)
        out.extend(panel.get("panels", []))  # inside a collapsed row
    return out


def test_the_dashboard_is_one_grafana_can_import() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert isinstance(dashboard["title"], str) and dashboard["title"]
    assert re.fullmatch(r"[A-Za-z0-9_-]{1,40}", dashboard["uid"])
    assert dashboard["schemaVersion"] >= 36, "Grafana 10 or later"
    assert dashboard.get("id") is None, "an id would overwrite another dashboard on import"
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    panels = _panels(dashboard)
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "panel ids are unique"
    for panel in panels:
        pos = panel["gridPos"]
        assert {"h", "w", "x", "y"} <= pos.keys() and pos["x"] + pos["w"] <= 24
        if panel["type"] == "row":
            continue
        assert panel["title"] and panel["datasource"]["uid"] == "${datasource}"
        refs = [t["refId"] for t in panel["targets"]]
        assert refs and len(refs) == len(set(refs))
        for target in panel["targets"]:
            assert target["expr"].count("(") == target["expr"].count(")"), target["expr"]
    # Every variable a query names is defined.
    used = {m for p in panels for t in p.get("targets", [])
            for m in re.findall(r"\$(\w+)", t["expr"])} - {"__rate_interval", "__interval"}
    assert used <= variables.keys()
    # The join with DCGM is described where it is made.
    [dcgm] = [p for p in panels
              if any("DCGM_FI_DEV_FB_USED" in t["expr"] for t in p.get("targets", []))]
    assert "UUID" in dcgm["description"] and "Hostname" in dcgm["description"]


def test_the_dashboard_reads_only_what_the_agent_exports(
    start_agent: Callable[..., AgentProcess], holders: Callable[..., Holder]
) -> None:
    """A renamed metric would leave a panel silently empty: every gpufrac_ name the dashboard
    queries is in a live agent's /metrics."""
    agent = start_agent()
    c = agent.client()
    _notebook(c, holders, "0.25", "0.5", 10)
    exported = {s.name for s in _samples(c.metrics())}
    dashboard = json.loads(DASHBOARD.read_text())
    queried = {m for p in _panels(dashboard) for t in p.get("targets", [])
               for m in re.findall(r"\bgpufrac_\w+", t["expr"])}
    queried |= {m for v in dashboard["templating"]["list"]
                for m in re.findall(r"\bgpufrac_\w+", json.dumps(v.get("query", "")))}
    assert queried and queried <= exported, queried - exported


def test_kernels_checkpoints_and_offloads_are_histograms_and_counters(
    start_agent: Callable[..., AgentProcess],
) -> None:
    agent = start_agent()
    c = agent.client()
    lease = c.create_lease(client="jupyter", request="0.25")
    before = _samples(c.metrics())
    # Every trigger and reason is there at 0 before any report.
    for trigger in ("cell", "server", "park", "manual"):
        assert _value(before, "gpufrac_checkpoint_duration_seconds_count", trigger=trigger) == 0
        assert _value(before, "gpufrac_checkpoint_written_bytes_total", trigger=trigger) == 0
    for reason in ("shrink", "park", "manual"):
        assert _value(before, "gpufrac_offloads_total", reason=reason) == 0

    c.observe(lease["id"], {"kind": "checkpoint", "trigger": "cell", "bytes": 3 * MiB,
                            "written_bytes": MiB, "seconds": 0.004})
    c.observe(lease["id"], {"kind": "checkpoint", "trigger": "cell", "bytes": 3 * MiB,
                            "written_bytes": 0, "seconds": 0.2})
    c.observe(lease["id"], {"kind": "offload", "reason": "shrink", "bytes": 600 * MiB})
    after = _samples(c.metrics())
    assert _value(after, "gpufrac_checkpoint_duration_seconds_count", trigger="cell") == 2
    assert _value(after, "gpufrac_checkpoint_duration_seconds_sum", trigger="cell") == pytest.approx(0.204)
    assert _value(after, "gpufrac_checkpoint_duration_seconds_bucket", trigger="cell",
                  le="0.005") == 1
    assert _value(after, "gpufrac_checkpoint_size_bytes_bucket", trigger="cell",
                  le=str(float(2**22))) == 2  # 3 MiB <= 4 MiB
    assert _value(after, "gpufrac_checkpoint_written_bytes_total", trigger="cell") == MiB
    assert _value(after, "gpufrac_checkpoint_duration_seconds_count", trigger="park") == 0
    assert _value(after, "gpufrac_offloads_total", reason="shrink") == 1
    assert _value(after, "gpufrac_offloaded_bytes_total", reason="shrink") == 600 * MiB

    # Another user may not report on this lease: it is not theirs to know of.
    refused = as_user(NOBODY, lambda: agent.client().observe(
        lease["id"], {"kind": "offload", "reason": "park", "bytes": 1}))
    assert refused["status"] == 404 and "no lease" in refused["message"], refused
    assert _value(_samples(c.metrics()), "gpufrac_offloads_total", reason="park") == 0


def test_a_flood_of_scrapes_renders_each_view_once_until_something_it_shows_changes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Finding 4: 256 connections scraping /metrics made the agent render it for each; a
    render is tens of ms, and another user's requests waited 1.3 s (p95). Each view (one
    user's, the admins') is rendered once and served again until the ledger, the stats or a
    poll changes what it shows."""
    renders: list[object] = []
    real = metrics.render_metrics

    def counted(agent: Agent, caller: Caller) -> str:
        renders.append(caller.uid)
        return real(agent, caller)

    monkeypatch.setattr(metrics, "render_metrics", counted)
    ledger = Ledger(tmp_path / "state")
    agent = Agent(SimulatedBackend("2x1GiB"), ledger, AgentConfig())
    asyncio.run(agent.tick())
    alice, mallory, admin = Caller(uid=1001), Caller(uid=1002), Caller(uid=0, admin=True)
    wanted = parse_quantity("0.25", "request")
    lease = agent.create_lease(alice, CreateLease(kind="notebook", client="a", request=wanted,
                                                  limit=wanted))
    rendered = metrics.RenderedMetrics()
    try:
        for _ in range(256):
            assert lease.id not in rendered.get(agent, mallory)
        assert lease.id in rendered.get(agent, alice) and lease.id in rendered.get(agent, admin)
        assert renders == [1002, 1001, 0]
        # A change in the ledger is shown at once, to each view.
        agent.release(alice, lease.id)
        assert lease.id not in rendered.get(agent, alice) and renders[-1] == 1001
        for _ in range(10):
            rendered.get(agent, alice)
        assert len(renders) == 4
        # So are the stats, and the figures of each poll.
        agent.stats.shrink_asked("reclaim")
        rendered.get(agent, admin)
        asyncio.run(agent.tick())
        rendered.get(agent, admin)
        assert renders[4:] == [0, 0]
    finally:
        ledger.close()
