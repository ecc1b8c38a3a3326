"""Property tests of plan_freezes: whom to freeze so that a job fits where notebooks cannot move."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from node_agent import policy
from node_agent.policy import JOB, NOTEBOOK, Device, Placement

from .test_policy import GB, placed_under_rules


def _fits(device: Device, rest: list[Placement], request: int, rules: policy.Rules) -> bool:
    """``request`` more bytes fit on ``device`` beside ``rest`` in the plan and where they run."""
    logical = sum(p.request for p in rest if device.uuid in p.logical)
    running = sum(p.request for p in rest if device.uuid in p.physical)
    count = sum(1 for p in rest if device.uuid in p.physical)
    return (logical + request <= device.total and running + request <= device.total
            and (rules.max_per_gpu is None or count < rules.max_per_gpu))


@settings(max_examples=300, deadline=None)
@given(placed_under_rules(), st.sampled_from([1, 2, 4, 8]), st.integers(1, 2), st.data())
def test_a_freeze_plan_fits_freezes_only_notebooks_it_may_and_none_too_many(
    case: tuple[policy.Rules, list[Device], list[Placement]], eighths: int, count: int,
    data: st.DataObject,
) -> None:
    rules, devices, leases = case
    request = eighths * devices[0].total // 8
    notebooks = [p.id for p in leases if p.kind == NOTEBOOK]
    freezable = set(data.draw(st.lists(st.sampled_from(notebooks), unique=True))
                    if notebooks else [])
    plan = policy.plan_freezes(devices, leases, request, count, freezable, rules)
    if plan is None:
        # Not even freezing every notebook allowed makes room on enough GPUs.
        rest = [p for p in leases if p.id not in freezable]
        assert sum(_fits(d, rest, request, rules) for d in devices) < count
        return
    assert len(plan.gpus) == count == len(set(plan.gpus))
    assert set(plan.frozen) <= freezable
    rest = [p for p in leases if p.id not in plan.frozen]
    by_uuid = {d.uuid: d for d in devices}
    for uuid in plan.gpus:
        assert _fits(by_uuid[uuid], rest, request, rules)
    # Irredundant: each frozen notebook is needed on a chosen GPU it sits on.
    for frozen_id in plan.frozen:
        kept = [p for p in leases if p.id not in plan.frozen or p.id == frozen_id]
        assert not all(_fits(by_uuid[u], kept, request, rules) for u in plan.gpus)


def test_a_whole_gpu_job_on_one_gpu_freezes_both_quarter_notebooks() -> None:
    gpu = Device("GPU-0", 0, 80 * GB)
    a = Placement("a", NOTEBOOK, 20 * GB, ("GPU-0",), ("GPU-0",), usage=5 * GB)
    b = Placement("b", NOTEBOOK, 20 * GB, ("GPU-0",), ("GPU-0",), usage=1 * GB)
    plan = policy.plan_freezes([gpu], [a, b], 80 * GB, 1, {"a", "b"})
    assert plan == policy.FreezePlan(("GPU-0",), ("a", "b"))
    # A job on the GPU already is never frozen: no room.
    job = Placement("j", JOB, 40 * GB, ("GPU-0",), ("GPU-0",))
    assert policy.plan_freezes([gpu], [a, job], 80 * GB, 1, {"a"}) is None


def test_of_two_ways_the_one_that_freezes_less_memory_is_chosen() -> None:
    gpus = [Device("GPU-0", 0, 80 * GB), Device("GPU-1", 1, 80 * GB)]
    big = Placement("big", NOTEBOOK, 50 * GB, ("GPU-0",), ("GPU-0",), usage=30 * GB)
    small = Placement("small", NOTEBOOK, 30 * GB, ("GPU-1",), ("GPU-1",), usage=2 * GB)
    half = Placement("half", NOTEBOOK, 30 * GB, ("GPU-1",), ("GPU-1",), usage=3 * GB)
    plan = policy.plan_freezes(gpus, [big, small, half], 40 * GB, 1, {"big", "small", "half"})
    # GPU 0 needs `big` (30 GB frozen); GPU 1 needs one of two: `small` (2 GB).
    assert plan == policy.FreezePlan(("GPU-1",), ("small",))
