"""The simulation's behaviour, shown by properties that only the agent's policy functions give it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from node_agent.policy import Rules
from node_agent.simulator.engine import PENDING, Engine, Observer, Timing, nodes_needed, simulate
from node_agent.simulator.metrics import Result
from node_agent.simulator.node_spec import NodeSpec, parse_node
from node_agent.simulator.policies import Policy, scheduler_settings, site_policies
from node_agent.simulator.traces import GB, JobSpec, Session

from .synth import cell, job, session

NODE = parse_node("2x16GiB")
POLICIES = {p.name: p for p in site_policies(park_after=900.0)}
GPUFRAC = POLICIES["gpufrac"]


def run(name_or_policy: str | Policy, sessions: Sequence[Session], jobs: Sequence[JobSpec] = (),
        spec: NodeSpec = NODE, nodes: int = 1, timing: Timing | None = None,
        observer: Observer | None = None) -> Result:
    policy_ = POLICIES[name_or_policy] if isinstance(name_or_policy, str) else name_or_policy
    return simulate(policy_, spec, nodes, sessions, jobs, timing or Timing(), observer=observer)


def burstable(name: str, start: float = 0, stop: float = 100) -> Session:
    """Request 4 GB (its median cell), limit 6 GB (its largest), idle from tick 4 on."""
    return session(name, start, stop, cell(1, vram_gb=2), cell(3, vram_gb=6))


# -- compaction: moved with state, or killed ------------------------------------------------------


def two_notebooks_and_a_job() -> tuple[list[Session], list[JobSpec]]:
    """a is planned and runs on GPU 0; b is planned on GPU 0 too (binpack) but spread to GPU 1;
    then a job needs all of GPU 1."""
    return [burstable("a"), burstable("b")], [job("j", 30, 600)]


def test_spread_and_kill_loses_the_state_of_the_notebook_on_the_jobs_gpu() -> None:
    sessions, jobs = two_notebooks_and_a_job()
    result = run("spread+kill", sessions, jobs)
    assert result.lost_sessions == {"b"}
    assert result.kills == 1 and result.moves == 0
    assert result.job_waits == [0.0]


def test_gpufrac_moves_it_with_its_state_and_the_job_waits_for_the_move() -> None:
    sessions, jobs = two_notebooks_and_a_job()
    timing = Timing(move=7.5)
    result = run("gpufrac", sessions, jobs, timing=timing)
    assert result.lost_sessions == set() and result.kills == 0
    assert result.moves == 1
    assert result.job_waits == [pytest.approx(7.5)]


def test_binpack_never_spreads_so_nothing_moves_and_nothing_is_lost() -> None:
    sessions, jobs = two_notebooks_and_a_job()
    result = run("binpack", sessions, jobs)
    assert (result.moves, result.kills, result.job_waits) == (0, 0, [0.0])


def test_a_cell_running_when_its_kernel_must_move_gets_the_grace_then_is_cut_off() -> None:
    # b runs a 10-minute cell from tick 29; the job comes at tick 30.
    sessions = [burstable("a"), session("b", 0, 100, cell(1, vram_gb=2), cell(3, vram_gb=6),
                                        cell(29, ticks=10, vram_gb=4))]
    timing = Timing(move=4.0, migrate_grace=20.0)
    result = run("gpufrac", sessions, [job("j", 30, 600)], timing=timing)
    assert result.cells_cut_off == 1 and result.lost_sessions == set()
    assert result.job_waits == [pytest.approx(24.0)]


def test_compaction_moves_the_notebook_holding_less_memory() -> None:
    """Two notebooks spread onto GPU 1, and a job that needs room for one of them to go: the one
    that holds less moves (plan_compaction's least-memory choice)."""
    for small, large in (("b", "c"), ("c", "b")):
        holds = {small: 1.0, large: 3.0}
        sessions = [session("a", 0, 100, cell(1, vram_gb=6))] + [
            session(name, 0, 100, cell(1, vram_gb=4 - holds[name]), cell(3, vram_gb=holds[name]))
            for name in ("b", "c")
        ]
        moved: set[str] = set()

        def watch(engine: Engine, moved: set[str] = moved) -> None:
            for node in engine.nodes:
                for lease in node.leases.values():
                    if lease.move_to is not None:
                        moved.add(lease.owner.session.id)  # type: ignore[union-attr]

        result = run("gpufrac", sessions, [job("j", 10, 600, fraction=0.875)], observer=watch)
        assert result.moves == 1 and moved == {small}, (small, moved)


# -- spreading: burstable only, or all ------------------------------------------------------------


Where = tuple[tuple[str, ...], tuple[str, ...]]


def placements(policy_: Policy, sessions: Sequence[Session]) -> dict[str, Where]:
    """Each session's (logical, physical) GPUs, as last seen."""
    seen: dict[str, Where] = {}

    def watch(engine: Engine) -> None:
        for node in engine.nodes:
            for lease in node.leases.values():
                seen[lease.owner.session.id] = (lease.logical, lease.physical)  # type: ignore[union-attr]

    run(policy_, sessions, observer=watch)
    return seen


def test_only_burstable_notebooks_are_spread_unless_all_are() -> None:
    steady = [session(name, 0, 100, cell(1, vram_gb=3), cell(3, vram_gb=3)) for name in ("a", "b")]
    bursty = [burstable("a"), burstable("b")]
    spread_all = replace(GPUFRAC, all_burstable=True)
    off = replace(GPUFRAC, rules=Rules(spread=False))

    assert placements(GPUFRAC, bursty)["b"] == (("node0-gpu0",), ("node0-gpu1",))
    assert placements(GPUFRAC, steady)["b"] == (("node0-gpu0",), ("node0-gpu0",))
    assert placements(spread_all, steady)["b"] == (("node0-gpu0",), ("node0-gpu1",))
    assert placements(off, bursty)["b"] == (("node0-gpu0",), ("node0-gpu0",))


# -- reclaim ------------------------------------------------------------------------------------------


def borrower_and_owner(borrower_runs: bool) -> list[Session]:
    """One 16 GiB GPU: a holds 6 GB against its request of 4; b asks for its 11 GB at tick 10."""
    cells = [cell(1, vram_gb=2), cell(3, vram_gb=6)]
    if borrower_runs:
        # The same request (the median, 4 GB): a runs a 20-minute cell of 6 GB from tick 8.
        cells += [cell(2, vram_gb=2), cell(8, ticks=20, vram_gb=6)]
    return [session("a", 0, 100, *cells), session("b", 0, 100, cell(10, vram_gb=11))]


ONE_GPU = parse_node("1x16GiB")


def test_an_idle_borrower_is_shrunk_at_once_and_loses_nothing() -> None:
    result = run("gpufrac", borrower_and_owner(False), spec=ONE_GPU)
    assert (result.shrinks, result.reclaim_restarts, result.short_of_memory) == (1, 0, 0)
    assert result.lost_sessions == set() and max(result.cell_delays) == 0.0


def test_a_running_borrower_keeps_its_grace_then_is_restored_from_its_checkpoint() -> None:
    result = run("gpufrac", borrower_and_owner(True), spec=ONE_GPU, timing=Timing(reclaim_grace=25.0))
    assert result.reclaim_restarts == 1 and result.cells_cut_off == 1
    assert result.lost_sessions == set()
    assert max(result.cell_delays) == pytest.approx(25.0)


def test_run_ai_kills_the_borrower_and_binpack_leaves_the_owner_short() -> None:
    killed = run("spread+kill", borrower_and_owner(True), spec=ONE_GPU)
    assert killed.lost_sessions == {"a"} and killed.kills == 1 and max(killed.cell_delays) == 0.0
    short = run("binpack", borrower_and_owner(True), spec=ONE_GPU)
    assert short.short_of_memory >= 1 and short.lost_sessions == set() and short.kills == 0


# -- parking ------------------------------------------------------------------------------------------


def idle_heavy() -> list[Session]:
    """Sessions open for ten hours that run a cell now and then."""
    return [session(f"s{i}", i, 600 + i, cell(10 + i, vram_gb=2), cell(300, vram_gb=3),
                    cell(590, vram_gb=2)) for i in range(3)]


def test_parking_lowers_the_gpu_hours_held_and_each_return_pays_the_reattach_time() -> None:
    timing = Timing(reattach=3.0)
    held = run("gpufrac", idle_heavy(), timing=timing)
    parked = run("gpufrac+park", idle_heavy(), timing=timing)
    assert parked.held_s < held.held_s / 5
    # Each parks after its first and second cells; the second and third re-attach first.
    assert parked.parks == 6
    assert sorted(parked.cell_delays) == [0.0] * 3 + [pytest.approx(3.0)] * 6
    assert held.cell_delays == [0.0] * 9 and held.in_use_s == parked.in_use_s


# -- properties over random workloads ---------------------------------------------------------------

SPEC = parse_node("4x16GiB")


@st.composite
def workloads(draw: st.DrawFn) -> tuple[list[Session], list[JobSpec]]:
    sessions = []
    for i in range(draw(st.integers(1, 6))):
        start = draw(st.integers(0, 120))
        tick = start
        cells = []
        for _ in range(draw(st.integers(0, 6))):
            tick += draw(st.integers(0, 40))
            ticks = draw(st.integers(1, 15))
            cells.append(cell(tick, ticks, draw(st.sampled_from([0, 1, 1, 2, 4])),
                              draw(st.floats(0.1, 14.0))))
            tick += ticks
        sessions.append(session(f"s{i}", start, tick + draw(st.integers(0, 60)), *cells))
    jobs = [
        job(f"j{i}", draw(st.integers(0, 200)), draw(st.integers(60, 20_000)),
            draw(st.sampled_from([1, 1, 2, 4])), draw(st.sampled_from([1.0, 0.25, 0.5, 0.8])))
        for i in range(draw(st.integers(0, 6)))
    ]
    return sessions, [replace(j, fraction=1.0) if j.gpus > 1 else j for j in jobs]


ALL_POLICIES = [*site_policies(park_after=600.0), *scheduler_settings(GPUFRAC)]
SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def check_bounds(engine: Engine) -> None:
    """Where leases run (and, separately, where the plan puts them), no GPU holds more requests than
    it has memory, or more leases than the rules allow; memory in use never exceeds it either."""
    bound = engine.rules.max_per_gpu
    for node in engine.nodes:
        for where in ("running", "planned"):
            requests: dict[str, int] = {}
            counts: dict[str, int] = {}
            used: dict[str, int] = {}
            for lease in node.leases.values():
                if where == "running" and lease.state == PENDING:
                    continue
                place = lease.physical if where == "running" or lease.move_to is None else lease.move_to
                for uuid in place:
                    requests[uuid] = requests.get(uuid, 0) + lease.share.request
                    counts[uuid] = counts.get(uuid, 0) + 1
                    used[uuid] = used.get(uuid, 0) + lease.usage
            for device in node.devices:
                assert requests.get(device.uuid, 0) <= device.total, (where, device)
                assert bound is None or counts.get(device.uuid, 0) <= bound, (where, device, bound)
                if where == "running":
                    assert used.get(device.uuid, 0) <= device.total, device
        if not engine.rules.spread or engine.policy.reserve:
            assert all(lease.physical == lease.logical for lease in node.leases.values())


@SETTINGS
@given(workloads(), st.sampled_from(ALL_POLICIES), st.sampled_from([None, 1, 2, 3]))
def test_no_step_exceeds_memory_or_the_workloads_per_gpu(work: tuple[list[Session], list[JobSpec]],
                                                          policy_: Policy, bound: int | None) -> None:
    sessions, jobs = work
    if not policy_.reserve and bound is not None:
        policy_ = replace(policy_, rules=replace(policy_.rules, max_per_gpu=bound))
    engine = Engine(policy_, SPEC, 2, sessions, jobs, Timing(), observer=check_bounds)
    result = engine.run()
    # Every cell of a GPU session ran, once each, and every session ended.
    assert len(result.cell_delays) == sum(len(s.cells) for s in sessions if s.peak_gpus)
    assert all(s.done for s in engine.sessions if s.share is not None)
    assert min(result.cell_delays, default=0.0) >= 0 and min(result.job_waits, default=0.0) >= 0


@SETTINGS
@given(workloads())
def test_reserving_holds_at_least_what_is_in_use_and_gpufrac_never_loses_state(
        work: tuple[list[Session], list[JobSpec]]) -> None:
    sessions, jobs = work
    nodes = len(sessions) + len(jobs)  # a node each: nothing waits, whatever the fragmentation
    reserve = run("reserve", sessions, jobs, spec=SPEC, nodes=nodes)
    assert reserve.held_s >= reserve.in_use_s - 1e-6
    assert reserve.job_waits == [0.0] * len(jobs) and reserve.sessions_queued == 0
    for name in ("gpufrac", "gpufrac+park"):
        result = run(name, sessions, jobs, spec=SPEC, nodes=nodes)
        assert result.lost_sessions == set() and result.kills == 0
        assert result.in_use_s == reserve.in_use_s


@SETTINGS
@given(workloads())
def test_the_same_workload_gives_the_same_figures(work: tuple[list[Session], list[JobSpec]]) -> None:
    sessions, jobs = work
    first = run("gpufrac+park", sessions, jobs, spec=SPEC, nodes=2)
    again = run("gpufrac+park", sessions, jobs, spec=SPEC, nodes=2)
    assert first.series == again.series
    assert (first.cell_delays, first.job_waits) == (again.cell_delays, again.job_waits)


def test_nodes_needed_covers_the_reserving_peak() -> None:
    sessions = [session("a", 0, 10, cell(1, gpus=8)), session("b", 5, 20, cell(6, gpus=4))]
    jobs = [job("j", 6, 60, gpus=2), job("k", 30, 60, gpus=8)]
    assert nodes_needed(sessions, jobs, SPEC) == 4  # 8 + 4 + 2 GPUs at tick 6, 4 per node
    assert nodes_needed([], [], SPEC) == 1
    assert GB == 2**30
