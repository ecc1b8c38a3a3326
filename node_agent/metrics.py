"""/metrics: the node's GPUs and the caller's leases as Prometheus metrics, labelled as DCGM's are."""

from __future__ import annotations

import functools
import os
import pwd
import socket
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING

from prometheus_client.exposition import generate_latest
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
    StateSetMetricFamily,
)
from prometheus_client.registry import Collector

from node_agent.ledger import STATES
from node_agent.stats import CHECKPOINT_TRIGGERS, OFFLOAD_REASONS, UNPARKED, AgentStats, clamp

if TYPE_CHECKING:
    from node_agent.ledger import Lease
    from node_agent.service import Agent, Caller

# NVIDIA's DCGM exporter names its GPU labels so; series that share them join its own.
GPU_LABELS = ("gpu", "UUID", "modelName", "hostname")
# Per lease, then the GPU labels of each device it runs on. The state is a metric of its
# own: as a label it would start a new series at every change.
# namespace, pod, container: as the DCGM exporter names them; empty (absent) off Kubernetes.
LEASE_LABELS = ("lease", "kernel_id", "user", "kind", "namespace", "pod", "container")
# Leases that hold memory on their physical GPU: a moving one still runs where it was.
RUNNING = ("active", "shrinking", "migrating")
# Every cause a counter can have, exported at 0 before it first happens: a series that
# appears only at its first event hides that event from rate() and increase().
MOVE_CAUSES = ("compaction", "request_changed")
SHRINK_CAUSES = ("reclaim", "limit")
KILL_CAUSES = ("reclaim", "limit", "migrate_timeout", "thaw_failed", "thaw_elsewhere",
               "freeze_failed")
# Why a lease's processes were frozen.
FREEZE_CAUSES = ("park", "reclaim", "limit", "job", "move")
# The steps after which the agent checks the driver's word (its state, NVML's listing).
FREEZE_STEPS = ("freeze", "thaw")


def hostname() -> str:
    """The node's name as the DCGM exporter gives it: $NODE_NAME (a Kubernetes DaemonSet sets
    it), else the host's name."""
    return os.environ.get("NODE_NAME") or socket.gethostname()


@functools.lru_cache(maxsize=1024)
def user_name(uid: int) -> str:
    """The owner's login name, or the uid where it has none; looked up once per uid (a
    directory service can be slow, and this runs on the agent's loop)."""
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


class AgentCollector(Collector):
    """One scrape: metric families from the agent's state now, as ``caller`` may see it —
    every GPU; the caller's own leases (an admin's: all)."""

    def __init__(self, agent: Agent, caller: Caller) -> None:
        self.agent = agent
        self.caller = caller

    def collect(self) -> Iterator[Metric]:
        agent = self.agent
        host = hostname()
        gpu_labels = {g.uuid: [str(g.index), g.uuid, g.name, host] for g in agent.gpus}

        def on(uuid: str) -> list[str]:
            # A device the backend no longer lists keeps its UUID, the one label it still has.
            return gpu_labels.get(uuid) or ["", uuid, "", host]

        for name, help_text, value in (
            ("gpufrac_gpu_memory_total_bytes", "Device memory of the GPU.",
             lambda g: g.memory_total),
            ("gpufrac_gpu_memory_used_bytes", "Device memory in use, all processes.",
             lambda g: g.memory_used),
            ("gpufrac_gpu_healthy", "1 when the GPU answers normally.",
             lambda g: int(g.healthy)),
        ):
            family = GaugeMetricFamily(name, help_text, labels=GPU_LABELS)
            for gpu in agent.gpus:
                family.add_metric(gpu_labels[gpu.uuid], value(gpu))
            yield family
        yield from _gpu_shares(agent, gpu_labels)

        leases = agent.visible(self.caller)
        lease_labels = {lease.id: _lease_labels(lease) for lease in leases}
        for name, attr, help_text in (
            ("gpufrac_lease_request_bytes", "request", "Guaranteed memory of the lease, per device."),
            ("gpufrac_lease_limit_bytes", "limit", "Most memory the lease may use, per device."),
            ("gpufrac_lease_usage_bytes", "usage", "Device memory the lease's processes hold."),
            ("gpufrac_lease_compute_request_ratio", "compute_request",
             "Share of the GPU's compute the lease asked for (0-1)."),
            ("gpufrac_lease_compute_limit_ratio", "compute_limit",
             "Most of the GPU's compute the lease may use (0-1; enforced only under CUDA MPS)."),
            ("gpufrac_lease_compute_usage_ratio", "compute_usage",
             "SM utilization of the lease's processes, as sampled by the driver (0-1)."),
        ):
            family = GaugeMetricFamily(name, help_text, labels=LEASE_LABELS + GPU_LABELS)
            for lease in leases:
                value = getattr(lease, attr)
                if value is None:
                    continue  # not asked for, or not sampled: no series rather than a false 0
                if attr == "compute_usage":
                    value /= 100  # sampled in percent
                for uuid in lease.physical:
                    family.add_metric(lease_labels[lease.id] + on(uuid), clamp(value))
            yield family

        states = StateSetMetricFamily(
            "gpufrac_lease_state", "The lease's state: pending, active, migrating, shrinking, "
            "killed or parked (1 for the one it is in).", labels=LEASE_LABELS)
        for lease in leases:
            states.add_metric(lease_labels[lease.id],
                              {state: state == lease.state for state in (*STATES, lease.state)})
        yield states

        actions = CounterMetricFamily("gpufrac_actions", "Directives and kills issued by the agent.",
                                      labels=["action"])
        for action in ("migrations", "shrinks", "kills"):
            actions.add_metric([action], clamp(agent.counters[action]))
        yield actions
        yield GaugeMetricFamily("gpufrac_poll_seconds", "Duration of the last poll of the GPUs.",
                                value=agent.tick_seconds)
        yield from _events(agent.stats, host)


def _gpu_shares(agent: Agent, gpu_labels: dict[str, list[str]]) -> Iterator[Metric]:
    """Per GPU, over every lease running on it (whoever owns it: sums carry no user data):
    what is guaranteed, lent above the guarantees, and owed to leases under theirs."""
    requested = dict.fromkeys(gpu_labels, 0)
    loaned = dict.fromkeys(gpu_labels, 0)
    owed = dict.fromkeys(gpu_labels, 0)
    for lease in agent.ledger.leases.values():
        if lease.state not in RUNNING:
            continue
        for uuid in lease.physical:
            if uuid not in requested:
                continue  # a GPU the backend no longer lists has no labels to give
            # Usage is the lease's largest on any of its GPUs, a request is per device.
            requested[uuid] += lease.request
            loaned[uuid] += max(0, lease.usage - lease.request)
            owed[uuid] += max(0, lease.request - lease.usage)
    for name, help_text, values in (
        ("gpufrac_gpu_requested_bytes",
         "Sum of the requests (guaranteed memory) of the leases running on the GPU.", requested),
        ("gpufrac_gpu_loaned_bytes",
         "Memory the leases on the GPU use above their requests: what reclaim may take back.",
         loaned),
        ("gpufrac_gpu_owed_bytes",
         "Memory the leases on the GPU are owed: their requests less what they use.", owed),
    ):
        family = GaugeMetricFamily(name, help_text, labels=GPU_LABELS)
        for uuid, labels in gpu_labels.items():
            # Clamped: a sum over leases is no bound a single lease's figure keeps.
            family.add_metric(labels, clamp(values[uuid]))
        yield family


def _counter(name: str, help_text: str, counts: Mapping[str, int], known: tuple[str, ...],
             host: str) -> CounterMetricFamily:
    family = CounterMetricFamily(name, help_text, labels=["cause", "hostname"])
    for key in dict.fromkeys((*known, *sorted(counts))):
        family.add_metric([key, host], clamp(counts.get(key, 0)))
    return family


def _events(stats: AgentStats, host: str) -> Iterator[Metric]:
    """Node-wide tallies of what the agent did since it started (from zero at a restart).
    ``hostname`` as on the GPU series, so that one dashboard variable selects a node."""
    # One series rather than a `_created` beside every counter's: when the tallies began.
    start = GaugeMetricFamily("gpufrac_agent_start_time_seconds",
                              "When the agent started, in seconds since the epoch: the counters "
                              "below count from then.", labels=["hostname"])
    start.add_metric([host], stats.started)
    yield start
    yield _counter("gpufrac_moves_started",
                   "Moves the agent asked for (migrate directives), by cause: compaction (room "
                   "for a lease) or request_changed (a lease's own request grew).",
                   stats.moves_started, MOVE_CAUSES, host)
    durations = HistogramMetricFamily(
        "gpufrac_move_duration_seconds",
        "From a migrate directive to the end of the move, by outcome: migrated (the client "
        "reported it done), migrate_timeout (killed at the deadline) or released (the lease "
        "ended first). Moves under way when the agent restarted are not counted.",
        labels=["outcome", "hostname"])
    for outcome, hist in stats.move_seconds.items():  # every outcome, from the start
        durations.add_metric([outcome, host], hist.cumulative(), sum_value=hist.total)
    yield durations
    yield _counter("gpufrac_shrinks", "Shrink directives sent, by cause: reclaim (an owner is "
                   "owed the memory) or limit (the lease is above its limit).",
                   stats.shrinks, SHRINK_CAUSES, host)
    yield _counter("gpufrac_kills", "Leases whose processes the agent killed, by cause: reclaim, "
                   "limit or migrate_timeout (a move not reported done by its deadline).",
                   stats.kills, KILL_CAUSES, host)
    yield _counter("gpufrac_freezes", "Leases whose processes the agent froze (their GPU state "
                   "kept in host memory), by cause: park, reclaim, limit or job.",
                   stats.freezes, FREEZE_CAUSES, host)
    yield _counter("gpufrac_freeze_fallbacks", "Freezes that could not be used, so a checkpoint "
                   "and restart (or a stop) stood in, by cause.", stats.freeze_fallbacks,
                   FREEZE_CAUSES, host)
    yield _counter("gpufrac_freeze_mismatches", "Freezes and thaws after which the driver's "
                   "state or NVML's listing did not match what the driver said it did, by step; "
                   "each fell back or restarted its kernel.", stats.freeze_mismatches,
                   FREEZE_STEPS, host)
    for name, help_text, hist in (
        ("gpufrac_freeze_duration_seconds", "How long the driver took to freeze a lease's "
         "processes.", stats.freeze_seconds),
        ("gpufrac_thaw_duration_seconds", "How long the driver took to thaw a lease's "
         "processes.", stats.thaw_seconds),
    ):
        timing = HistogramMetricFamily(name, help_text, labels=["hostname"])
        timing.add_metric([host], hist.cumulative(), sum_value=hist.total)
        yield timing
    for name, help_text, value in (
        ("gpufrac_parks", "Notebook leases parked: their idle kernels gave the GPU back.",
         stats.parks),
        ("gpufrac_unpark_waits", "Unparks that found no GPU with room: the lease waited, "
         "pending, until the agent placed it (or it was parked again).", stats.unpark_waits),
    ):
        family = CounterMetricFamily(name, help_text, labels=["hostname"])
        family.add_metric([host], value)
        yield family
    unparks = CounterMetricFamily(
        "gpufrac_unparks", "Parked leases placed on a GPU again, by how: at_once (a GPU had "
        "room when the kernel asked) or after_wait (the agent placed it once room appeared).",
        labels=["how", "hostname"])
    for how in UNPARKED:
        unparks.add_metric([how, host], stats.unparks[how])
    yield unparks
    waits = HistogramMetricFamily(
        "gpufrac_unpark_duration_seconds",
        "From a parked kernel's ask for a GPU (its next cell) until it had one: what the cell "
        "waited. Waits given up on (parked again) are not counted.", labels=["hostname"])
    waits.add_metric([host], stats.unpark_seconds.cumulative(),
                     sum_value=stats.unpark_seconds.total)
    yield waits
    yield from _reported(stats, host)


def _reported(stats: AgentStats, host: str) -> Iterator[Metric]:
    """What kernels reported doing (``POST /v1/leases/{id}/observations``)."""
    triggers = "by trigger: cell (after each cell, and the empty one of a fresh kernel), " \
               "server (asked before a move or a restart), park, manual (%gpu checkpoint)"
    for name, help_text, hists in (
        ("gpufrac_checkpoint_duration_seconds", f"How long kernels' checkpoints took, {triggers}.",
         stats.checkpoint_seconds),
        ("gpufrac_checkpoint_size_bytes", "What kernels' checkpoints hold (unchanged data "
         f"included: an incremental checkpoint writes less), {triggers}.", stats.checkpoint_bytes),
    ):
        family = HistogramMetricFamily(name, help_text, labels=["trigger", "hostname"])
        for trigger in CHECKPOINT_TRIGGERS:
            family.add_metric([trigger, host], hists[trigger].cumulative(),
                              sum_value=hists[trigger].total)
        yield family
    written = CounterMetricFamily(
        "gpufrac_checkpoint_written_bytes", f"Bytes kernels' checkpoints wrote, {triggers}.",
        labels=["trigger", "hostname"])
    for trigger in CHECKPOINT_TRIGGERS:
        written.add_metric([trigger, host], stats.checkpoint_written[trigger])
    yield written
    for name, help_text, counts in (
        ("gpufrac_offloads", "Times kernels moved their GPU tensors to host memory, by reason: "
         "shrink (a reclaim), park, manual (%gpu offload).", stats.offloads),
        ("gpufrac_offloaded_bytes", "Bytes of GPU tensors kernels moved to host memory, by "
         "reason: shrink, park, manual.", stats.offloaded_bytes),
    ):
        counter = CounterMetricFamily(name, help_text, labels=["reason", "hostname"])
        for reason in OFFLOAD_REASONS:
            counter.add_metric([reason, host], counts[reason])
        yield counter


def _lease_labels(lease: Lease) -> list[str]:
    # An empty label is an absent one to Prometheus: a job has no kernel.
    pod = lease.pod or ("", "", "")
    return [lease.id, lease.kernel_id or "", user_name(lease.owner_uid), lease.kind, *pod]


def render_metrics(agent: Agent, caller: Caller) -> str:
    """The Prometheus text exposition of what ``caller`` may see."""
    return generate_latest(AgentCollector(agent, caller)).decode()


# Views kept rendered at once (one per user who asks, and the admins'); past it the oldest goes.
MAX_VIEWS = 1024


class RenderedMetrics:
    """/metrics as rendered for each view (the admins', or one user's), served again while
    nothing it shows has changed (the ledger, the stats, the GPUs measured at each poll):
    under a flood of scrapes a view is rendered at most once per poll, not once a request."""

    def __init__(self) -> None:
        self._views: dict[object, tuple[tuple[object, ...], str]] = {}

    def get(self, agent: Agent, caller: Caller) -> str:
        view: object = "admin" if caller.admin else caller.uid
        version = (agent.ledger.revision, agent.stats.tally(), agent.counters["ticks"])
        kept = self._views.get(view)
        if kept is not None and kept[0] == version:
            return kept[1]
        text = render_metrics(agent, caller)
        self._views.pop(view, None)
        if len(self._views) >= MAX_VIEWS:
            del self._views[next(iter(self._views))]
        self._views[view] = (version, text)
        return text
