"""Configuration: every ``c.GpuFrac`` trait is checked and a bad value names itself."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest
from traitlets.config import Config

from jupyter_gpufrac.server.app import GpuFrac
from jupyter_gpufrac.server.embedded_agent import EmbeddedAgent
from jupyter_gpufrac.server.launch import resolve_share
from node_agent.client import AgentClient, AgentError
from node_agent.quantities import Quantity, QuantityError


def make_app(**traits: object) -> GpuFrac:
    return GpuFrac(config=Config({"GpuFrac": traits}))


@pytest.mark.parametrize(
    ("traits", "expected"),
    [
        ({"default_request": "lots"}, "c.GpuFrac.default_request: expected a share of one GPU"),
        ({"default_request": "1.5"}, "c.GpuFrac.default_request: 1.5 GiB or 1.5 GPUs?"),
        ({"default_limit": "-1"}, "c.GpuFrac.default_limit: expected a share of one GPU"),
        ({"migrate_grace_period": -5},
         "c.GpuFrac.migrate_grace_period: expected seconds from 0 to 86400, got -5"),
        ({"embedded_agent_timeout": 0},
         "c.GpuFrac.embedded_agent_timeout: expected seconds from 0.1 to 3600, got 0"),
        # Finding 9: NaN, infinities, values past the calendar, meaningless ones.
        ({"lease_poll_interval": float("nan")},
         "c.GpuFrac.lease_poll_interval: expected seconds from 0.1 to 3600, got nan"),
        ({"park_after": float("inf")}, "c.GpuFrac.park_after: expected seconds from 0 to"),
        ({"checkpoint_keep_seconds": 1e308},
         "c.GpuFrac.checkpoint_keep_seconds: expected seconds from 0 to 315360000, got 1e+308"),
        ({"checkpoint_sweep_interval": 1e-9}, "c.GpuFrac.checkpoint_sweep_interval: expected 0 "
         "(only at server start) or seconds from 0.1 to 86400, got 1e-09"),
        ({"max_workloads_per_gpu": 0},
         "c.GpuFrac.max_workloads_per_gpu: expected a whole number of at least 1 (or None), got 0"),
        ({"max_spare_kernels": -1},
         "c.GpuFrac.max_spare_kernels: expected a whole number from 0 to 64, got -1"),
        ({"spare_kernels": "no"}, "c.GpuFrac.spare_kernels: expected True or False, got 'no'"),
        ({"checkpoint_dir": "relative/dir"}, "c.GpuFrac.checkpoint_dir: expected an absolute path"),
        ({"agent_socket": "./agent.sock"}, "c.GpuFrac.agent_socket: expected an absolute path"),
        ({"embedded_agent_simulate": "two GPUs"}, "c.GpuFrac.embedded_agent_simulate: expected"),
    ],
)
def test_bad_value_names_the_trait_and_what_was_expected(traits: dict[str, object], expected: str) -> None:
    """A bad setting is one sentence, and the default stays: the extension keeps running."""
    app = make_app(**traits)
    [problem] = app.config_problems
    assert expected in problem
    name = next(iter(traits))
    assert getattr(app, name) == GpuFrac.class_traits()[name].default_value


@pytest.mark.parametrize("how", ["constructed", "updated as jupyter_server does"])
def test_a_bad_setting_never_drops_the_others(how: str) -> None:
    """Finding 9: ``c.GpuFrac.max_workloads_per_gpu = 0`` raised in traitlets, which dropped
    every c.GpuFrac setting (checkpoint_dir, spare_kernels ignored) without a word."""
    settings = {"max_workloads_per_gpu": 0, "checkpoint_dir": "/data/ck", "spare_kernels": False,
                "park_after": "soon", "lease_poll_interval": 2.5}
    if how == "constructed":
        app = make_app(**settings)
    else:
        app = GpuFrac()
        app.update_config(Config({"GpuFrac": settings}))
    assert (app.checkpoint_dir, app.spare_kernels, app.lease_poll_interval) == (
        "/data/ck", False, 2.5)
    assert app.max_workloads_per_gpu is None and app.park_after == 900.0
    assert [p.split(":")[0] for p in app.config_problems] == [
        "c.GpuFrac.max_workloads_per_gpu", "c.GpuFrac.park_after"], app.config_problems


def test_limit_below_request_is_a_problem_too() -> None:
    app = make_app(default_request="0.5", default_limit="0.25")
    app.check_limits()
    assert app.config_problems == [
        "c.GpuFrac.default_limit: must be at least default_request (0.5), got 0.25"]


def test_good_values_are_kept() -> None:
    app = make_app(
        default_request="4Gi", default_limit="8Gi", migrate_grace_period=0,
        checkpoint_dir="~/ck", embedded_agent_simulate="4xH100-80GB",
    )
    app.check_limits()
    assert app.default_request == "4Gi"
    assert app.checkpoint_dir.endswith("/ck") and app.checkpoint_dir.startswith("/")
    assert app.migrate_grace_period == 0


def test_agent_socket_defaults_to_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUFRAC_AGENT_SOCKET", "/tmp/somewhere/agent.sock")
    assert GpuFrac().agent_socket == "/tmp/somewhere/agent.sock"
    monkeypatch.delenv("GPUFRAC_AGENT_SOCKET")
    monkeypatch.setenv("XDG_RUNTIME_DIR", "/nonexistent-runtime")
    assert GpuFrac().agent_socket.endswith("/agent.sock")


def test_every_trait_has_help_and_is_configurable() -> None:
    own = GpuFrac.class_own_traits(config=True)
    assert {"agent_socket", "default_request", "default_limit", "migrate_grace_period",
            "checkpoint_dir", "embedded_agent", "embedded_agent_simulate"} <= set(own)
    for name, trait in own.items():
        assert trait.help, name


# -- where a new kernel's request and limit come from -------------------------------------


def spec(quantity: Quantity | None) -> str | None:
    """What goes on the wire: the text the quantity was given as."""
    return None if quantity is None else quantity.spec


def test_kernelspec_wins_and_keeps_its_own_limit() -> None:
    share = resolve_share(
        {"gpufrac": {"request": 0.5, "limit": "12Gi"}}, {"request": "0.1", "limit": "0.2"},
        {"RUNAI_GPU_MEMORY_LIMIT": "0.9"}, "0.25", "1",
    )
    assert (spec(share.request), spec(share.limit), share.request_source) == ("0.5", "12Gi", "kernelspec")


def test_last_gpu_request_beats_config() -> None:
    share = resolve_share({}, {"request": "2Gi", "limit": None}, {}, "0.25", "1")
    assert (spec(share.request), spec(share.limit)) == ("2Gi", "1")
    assert (share.request_source, share.limit_source) == ("your last %gpu request here", "c.GpuFrac")


def test_runai_limit_is_a_limit_and_beats_config() -> None:
    share = resolve_share(None, None, {"RUNAI_GPU_MEMORY_LIMIT": "2500M"}, "0.25", "1")
    assert (spec(share.request), spec(share.limit)) == ("0.25", "2500M")
    assert share.limit_source == "RUNAI_GPU_MEMORY_LIMIT"


def test_limit_never_comes_from_an_earlier_source() -> None:
    share = resolve_share({"gpufrac": {"limit": "0.3"}}, None, {}, "0.25", "")
    # The kernelspec gave only a limit: the request comes from config, the limit is not the
    # kernelspec's (a source before the request's own) -- empty config limit means request.
    assert (spec(share.request), share.limit) == ("0.25", None)


def test_a_default_limit_below_an_explicit_request_gives_way_to_the_request() -> None:
    gpu = 16 * 2**30
    asked = resolve_share({"gpufrac": {"request": "0.5"}}, None, {}, "0.25", "4Gi")
    assert asked.limit_source == "c.GpuFrac" and asked.effective_limit(gpu) is None
    assert spec(asked.effective_limit(None)) == "4Gi"  # no GPU known: the agent decides
    room = resolve_share({"gpufrac": {"request": "0.1"}}, None, {}, "0.25", "4Gi")
    assert spec(room.effective_limit(gpu)) == "4Gi"
    own = resolve_share({"gpufrac": {"request": "0.5", "limit": "4Gi"}}, None, {}, "0.25", "1")
    assert spec(own.effective_limit(gpu)) == "4Gi"  # the request's own source: the agent refuses


@pytest.mark.parametrize(
    ("metadata", "environ", "field"),
    [
        ({"gpufrac": {"request": "a lot"}}, {}, "metadata.gpufrac.request"),
        ({"gpufrac": {"request": "0.2", "limit": "7 bananas"}}, {}, "metadata.gpufrac.limit"),
        ({"gpufrac": "0.5"}, {}, "metadata.gpufrac"),
        ({}, {"RUNAI_GPU_MEMORY_LIMIT": "1.7"}, "RUNAI_GPU_MEMORY_LIMIT"),
    ],
)
def test_bad_share_names_its_source(metadata: dict[str, object], environ: dict[str, str], field: str) -> None:
    with pytest.raises(QuantityError) as info:
        resolve_share(metadata, None, environ, "0.25", "1")
    assert info.value.field == field


def test_runai_and_kai_names_in_the_kernelspec() -> None:
    fraction = resolve_share({"gpufrac": {"gpu-fraction": 0.5, "gpu-fraction-limit": "0.75"}},
                             None, {}, "0.25", "1")
    assert (spec(fraction.request), spec(fraction.limit), fraction.request_source) == (
        "0.5", "0.75", "kernelspec")
    # KAI's gpu-memory is whole MiB; its limit can come from the platform's variable.
    memory = resolve_share({"gpufrac": {"gpu-memory": "4096"}}, None,
                           {"RUNAI_GPU_MEMORY_LIMIT": "8Gi"}, "0.25", "1")
    assert (spec(memory.request), spec(memory.limit)) == ("4096Mi", "8Gi")
    both = resolve_share({"gpufrac": {"gpu-memory": 1024, "gpu-memory-limit": 2048}}, None, {},
                         "0.25", "1")
    assert (spec(both.request), spec(both.limit)) == ("1024Mi", "2048Mi")


@pytest.mark.parametrize(
    ("gpufrac", "environ", "field", "words"),
    [
        ({"gpu-fraction": 0.5, "gpu-memory": 1024}, {}, "metadata.gpufrac",
         "gpu-fraction/gpu-fraction-limit and gpu-memory/gpu-memory-limit may not be mixed"),
        ({"request": "0.5", "gpu-fraction-limit": 0.8}, {}, "metadata.gpufrac",
         "request/limit and gpu-fraction/gpu-fraction-limit may not be mixed"),
        ({"gpu-fraction-limit": 0.8}, {}, "metadata.gpufrac.gpu-fraction-limit",
         "needs gpu-fraction"),
        ({"gpu-fraction": 0.5, "gpu-fraction-limit": 0.8}, {"RUNAI_GPU_MEMORY_LIMIT": "0.9"},
         "metadata.gpufrac.gpu-fraction-limit", "say it once"),
        ({"gpu-fraction": "4Gi"}, {}, "metadata.gpufrac.gpu-fraction", "a fraction"),
        ({"gpu-memory": "4Gi"}, {}, "metadata.gpufrac.gpu-memory", "whole number of MiB"),
    ],
)
def test_mixed_or_wrong_runai_names_are_refused_with_the_reason(
    gpufrac: dict[str, object], environ: dict[str, str], field: str, words: str
) -> None:
    with pytest.raises(QuantityError) as info:
        resolve_share({"gpufrac": gpufrac}, None, environ, "0.25", "1")
    assert info.value.field == field and words in info.value.message


def test_the_embedded_agent_runs_with_the_servers_scheduler_settings(tmp_path: Path) -> None:
    app = make_app(node_scheduler=False, max_workloads_per_gpu=1)
    agent = EmbeddedAgent(str(tmp_path / "agent.sock"), str(tmp_path / "state"), "2x1GiB",
                          logging.getLogger("test"), use_nvml=False,
                          node_scheduler=app.node_scheduler,
                          max_workloads_per_gpu=app.max_workloads_per_gpu)
    asyncio.run(agent.start())
    try:
        c = AgentClient(agent.socket_path)
        first = c.create_lease(client="t", request="0.25", limit="1")
        second = c.create_lease(client="t", request="0.25", limit="1")
        # One lease per GPU, and nothing spread: each runs where it is planned.
        assert first["physical_gpu"] != second["physical_gpu"]
        assert all(x["physical_gpu"] == x["logical_gpu"] for x in (first, second))
        with pytest.raises(AgentError, match="max-workloads-per-gpu"):
            c.create_lease(client="t", request="0.25")
    finally:
        asyncio.run(agent.stop())


def test_a_compute_share_comes_from_the_kernelspec_in_either_name() -> None:
    ours = resolve_share({"gpufrac": {"request": "0.25", "compute_request": 0.3}}, None, {},
                         "0.25", "1")
    assert (spec(ours.compute_request), ours.compute_limit) == ("0.3", None)
    runai = resolve_share({"gpufrac": {"gpu-fraction": 0.5, "gpu-compute-request": "0.2",
                                       "gpu-compute-limit": "0.6"}}, None, {}, "0.25", "1")
    assert [spec(q) for q in (runai.request, runai.compute_request, runai.compute_limit)] == [
        "0.5", "0.2", "0.6"]
    for gpufrac, field in (({"compute_request": 0.3, "gpu-compute-limit": 0.5}, "metadata.gpufrac"),
                           ({"gpu-compute-limit": 0.5}, "metadata.gpufrac.gpu-compute-limit"),
                           ({"compute_request": "2Gi"}, "metadata.gpufrac.compute_request")):
        with pytest.raises(QuantityError) as info:
            resolve_share({"gpufrac": gpufrac}, None, {}, "0.25", "1")
        assert info.value.field == field
