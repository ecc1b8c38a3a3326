"""Issue 9: the freeze policy (nothing cut off or killed; waits charged by bytes) and compute contention."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from node_agent.simulator.contention import speeds
from node_agent.simulator.engine import FROZEN, Engine, Timing
from node_agent.simulator.node_spec import parse_node
from node_agent.simulator.policies import site_policies
from node_agent.simulator.traces import GB, JobSpec, Session

from .synth import cell, job, session
from .test_sim_engine import SETTINGS, SPEC, borrower_and_owner, check_bounds, run, workloads

POLICIES = {p.name: p for p in site_policies(park_after=600.0)}
FREEZE = POLICIES["gpufrac+freeze"]
ONE_GPU = parse_node("1x16GiB")
TIMING = Timing()


def parked_session(vram_gb: float, second_at: float = 20) -> Session:
    """One cell of ``vram_gb`` at tick 1 (its kernel parks 600 s after it ends), another later."""
    return session("s", 0, 100, cell(1, vram_gb=vram_gb), cell(second_at, vram_gb=vram_gb))


def test_freeze_and_thaw_times_scale_with_the_bytes_held() -> None:
    assert TIMING.freeze(8 * GB) == pytest.approx(7.2) and TIMING.thaw(8 * GB) == pytest.approx(2.1)
    assert TIMING.freeze(2 * GB) == pytest.approx(7.2 / 4) and TIMING.thaw(16 * GB) == pytest.approx(4.2)
    double = Timing(freeze_per_gib=2.0, thaw_per_gib=1.0)
    assert (double.freeze(3 * GB), double.thaw(3 * GB)) == (pytest.approx(6.0), pytest.approx(3.0))


@pytest.mark.parametrize("vram_gb", [2.0, 8.0, 12.0])
def test_a_cell_due_at_a_frozen_kernel_waits_for_the_thaw_of_what_it_held(vram_gb: float) -> None:
    result = run(FREEZE, [parked_session(vram_gb)], spec=ONE_GPU)
    thaw = TIMING.thaw(int(vram_gb * GB))
    # It parks (frozen) after each cell; the session ends with it frozen the second time.
    assert (result.parks, result.freezes, result.thaws) == (2, 2, 1)
    assert result.cell_delays == [0.0, pytest.approx(thaw)]
    assert result.thaw_waits == [pytest.approx(thaw)]
    assert (result.cells_cut_off, result.kills, result.restarts) == (0, 0, 0)


def test_a_cell_due_while_its_kernel_freezes_waits_for_the_rest_of_the_freeze_and_the_thaw() -> None:
    # The first cell ends at 120 s; the kernel parks at 720 s and freezes 8 GiB for 7.2 s; the
    # next cell is due 3 s into the freeze.
    result = run(FREEZE, [parked_session(8.0, second_at=723 / 60)], spec=ONE_GPU)
    assert result.cell_delays == [0.0, pytest.approx(7.2 - 3 + 2.1)]


def test_a_frozen_kernel_holds_no_gpu_memory_and_gets_all_of_it_back() -> None:
    seen: list[tuple[str, int, int, int]] = []

    def watch(engine: Engine) -> None:
        s = engine.sessions[0]
        if s.done:
            return
        lease = s.lease
        used = sum(lease.usage for node in engine.nodes for lease in node.leases.values())
        state = "parked" if lease is None else lease.state
        seen.append((state, used, s.frozen_host, engine.result.peak_frozen_bytes))

    run(FREEZE, [parked_session(8.0)], spec=ONE_GPU, observer=watch)
    parked = [x for x in seen if x[0] == "parked"]
    assert parked and all(used == 0 and host == 8 * GB for _, used, host, _ in parked)
    thawed = [x for x in seen if x[0] == "thawing"]
    assert thawed and all(used == 8 * GB and host == 0 for _, used, host, _ in thawed)
    assert seen[-1][3] == 8 * GB


def test_a_running_borrower_is_frozen_after_its_grace_instead_of_killed_and_waits_for_room() -> None:
    timing = Timing(reclaim_grace=25.0)
    killed = run("gpufrac", borrower_and_owner(True), spec=ONE_GPU, timing=timing)
    frozen = run(replace(FREEZE, park_after=None), borrower_and_owner(True), spec=ONE_GPU, timing=timing)
    assert killed.cells_cut_off == 1 and killed.restarts == 1
    assert (frozen.cells_cut_off, frozen.kills, frozen.restarts) == (0, 0, 0)
    assert frozen.freezes == 1 and frozen.thaws == 1
    # The owner waits out the grace and the freeze of the borrower's 6 GB, then runs.
    assert max(frozen.cell_delays) == pytest.approx(25.0 + TIMING.freeze(6 * GB))
    # The borrower's cell waited, frozen, until the owner's session ended and gave room back.
    assert len(frozen.thaw_waits) == 1 and frozen.thaw_waits[0] > 80 * 60
    assert len(frozen.cell_delays) == len(killed.cell_delays)


def test_compaction_freezes_and_thaws_a_running_cell_elsewhere_without_a_grace() -> None:
    # b runs a 10-minute cell on GPU 1 from tick 29; a job needs all of GPU 1 at tick 30.
    sessions = [session("a", 0, 100, cell(1, vram_gb=2), cell(3, vram_gb=6)),
                session("b", 0, 100, cell(1, vram_gb=2), cell(3, vram_gb=6), cell(29, ticks=10, vram_gb=4))]
    moved = run(replace(FREEZE, park_after=None), sessions, [job("j", 30, 600)], spec=parse_node("2x16GiB"))
    assert (moved.moves, moved.cells_cut_off, moved.restarts, moved.freezes, moved.thaws) == (1, 0, 0, 1, 1)
    # The job waits for the 4 GB freeze alone; the cell waits for the freeze and the thaw.
    assert moved.job_waits == [pytest.approx(TIMING.freeze(4 * GB))]
    assert moved.thaw_waits == [pytest.approx(TIMING.freeze(4 * GB) + TIMING.thaw(4 * GB))]


def frozen_hold_nothing(engine: Engine) -> None:
    check_bounds(engine)
    for node in engine.nodes:
        for lease in node.leases.values():
            if lease.state == FROZEN:
                assert lease.usage == 0 and lease.frozen_bytes > 0
    assert engine.result.cells_cut_off == 0 and engine.result.kills == 0 and engine.result.restarts == 0


@SETTINGS
@given(workloads(), st.sampled_from([None, 300.0]))
def test_the_freeze_policy_never_cuts_off_kills_or_restarts(work: tuple[list[Session], list[JobSpec]],
                                                          park_after: float | None) -> None:
    sessions, jobs = work
    engine = Engine(replace(FREEZE, park_after=park_after), SPEC, 2, sessions, jobs, Timing(),
                    observer=frozen_hold_nothing)
    result = engine.run()
    assert len(result.cell_delays) == sum(len(s.cells) for s in sessions if s.peak_gpus)
    assert all(s.done and s.frozen_host == 0 for s in engine.sessions if s.share is not None)
    assert result.thaws <= result.freezes and not result.slowdown < 1.0 - 1e-9  # NaN: nothing ran


# -- compute contention -------------------------------------------------------------------------------


def test_two_equal_busy_cells_on_one_gpu_each_run_at_half_speed() -> None:
    sessions = [session(name, 0, 100, cell(1, ticks=10, vram_gb=2)) for name in ("a", "b")]
    shared = run("binpack", sessions, spec=ONE_GPU)
    assert shared.slowdown == pytest.approx(2.0) and shared.cell_slowdown == pytest.approx(2.0)
    alone = run("binpack", sessions[:1], spec=ONE_GPU)
    assert alone.slowdown == pytest.approx(1.0)
    ends: list[float] = []

    def watch(engine: Engine) -> None:
        ends.append(engine.now) if all(s.cell is None and s.finished_cells for s in engine.sessions) else None

    run("binpack", sessions, spec=ONE_GPU, observer=watch)
    assert min(ends) == pytest.approx(60 + 2 * 600)  # ten minutes of work at half speed


def test_without_contention_cells_run_their_traced_durations() -> None:
    sessions = [session(name, 0, 100, cell(1, ticks=10, vram_gb=2)) for name in ("a", "b")]
    engine = Engine(POLICIES["binpack"], ONE_GPU, 1, sessions, [], Timing(), contention=False)
    assert engine.run().slowdown == pytest.approx(1.0)


def test_speeds_split_a_gpu_by_compute_shares_and_follow_the_most_contended_gpu() -> None:
    got = speeds({"cell": (("g0",), 1.0), "job": (("g0",), 0.5), "quiet": (("g1",), 0.3),
                  "half": (("g2",), 0.5), "half2": (("g2",), 0.5), "wide": (("g0", "g2"), 1.0)})
    # g0 is asked for 2.5 GPUs, g2 for 2: each on g0 gets 1/2.5; wide runs at g0's pace.
    assert got == {"cell": pytest.approx(0.4), "job": pytest.approx(0.4), "quiet": 1.0,
                   "half": pytest.approx(0.5), "half2": pytest.approx(0.5), "wide": pytest.approx(0.4)}
    assert speeds({"a": (("g0",), 0.5), "b": (("g0",), 0.5)}) == {"a": 1.0, "b": 1.0}
    assert speeds({"a": (("g0",), 1.0), "b": (("g0",), 1.0)}, shared=False) == {"a": 1.0, "b": 1.0}


def test_a_frozen_cell_leaves_its_gpu_to_the_others() -> None:
    timing = Timing(reclaim_grace=25.0)
    frozen = run(replace(FREEZE, park_after=None), borrower_and_owner(True), spec=ONE_GPU, timing=timing)
    # The owner's one-tick cell ran alone while the borrower was frozen: only the grace was shared.
    assert frozen.cell_slowdown < 1.5
