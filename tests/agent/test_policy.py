"""Placement, compaction and reclaim: properties that must hold for every node and lease set."""

from __future__ import annotations

import itertools
import random
from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from node_agent import policy
from node_agent.policy import JOB, NOTEBOOK, Device, Placement

GB = 1 << 30
MB = 1 << 20
DEFAULT_RULES = policy.Rules()


@st.composite
def nodes(draw: st.DrawFn) -> list[Device]:
    n = draw(st.integers(min_value=1, max_value=6))
    total = draw(st.sampled_from([8 * GB, 16 * GB, 80 * GB]))
    return [Device(f"GPU-{i}", i, total) for i in range(n)]


@st.composite
def placed(draw: st.DrawFn, rules: policy.Rules = DEFAULT_RULES
           ) -> tuple[list[Device], list[Placement]]:
    """A node and a set of leases that the agent could have produced under ``rules``: logical
    plan by binpack, burstable notebooks spread physically."""
    devices = draw(nodes())
    leases: list[Placement] = []
    for i in range(draw(st.integers(min_value=0, max_value=14))):
        kind = draw(st.sampled_from([NOTEBOOK, NOTEBOOK, JOB]))
        request = draw(st.sampled_from([1, 2, 4, 8])) * devices[0].total // 8
        limit = draw(st.sampled_from([request, request, devices[0].total]))
        logical = policy.plan_logical(devices, leases, request, 1, rules)
        if logical is None:
            continue
        physical = policy.plan_physical(devices, leases, kind, request, logical, limit, rules)
        moves = policy.plan_compaction(devices, leases, {u: request for u in physical}, rules)
        assert moves is not None
        moved = {m.lease_id: m for m in moves}
        leases = [replace(p, physical=moved[p.id].to_gpus) if p.id in moved else p
                  for p in leases]
        usage = draw(st.integers(min_value=0, max_value=devices[0].total // 4))
        leases.append(Placement(f"l-{i:02d}", kind, request, logical, physical, usage, float(i),
                                limit))
    return devices, leases


rule_sets = st.builds(policy.Rules, spread=st.booleans(),
                      max_per_gpu=st.sampled_from([None, 1, 2, 3, 4]))


@st.composite
def placed_under_rules(draw: st.DrawFn
                       ) -> tuple[policy.Rules, list[Device], list[Placement]]:
    rules = draw(rule_sets)
    return (rules, *draw(placed(rules)))


@given(placed_under_rules())
def test_only_burstable_notebooks_are_rerouted(
    case: tuple[policy.Rules, list[Device], list[Placement]]
) -> None:
    """Run:ai: a workload is considered for rerouting only when its limit exceeds its
    request; with the node scheduler off, nothing is."""
    rules, _, leases = case
    for p in leases:
        if p.physical != p.logical:
            assert rules.spread and p.kind == NOTEBOOK and p.limit > p.request, p


@given(placed_under_rules())
def test_no_gpu_runs_more_leases_than_the_rules_allow(
    case: tuple[policy.Rules, list[Device], list[Placement]]
) -> None:
    rules, devices, leases = case
    assert _capacity_ok(devices, policy.physical_load(leases))
    if rules.max_per_gpu is not None:
        assert max(policy.physical_count(leases).values(), default=0) <= rules.max_per_gpu
        logical_count: dict[str, int] = {}
        for p in leases:
            for u in p.logical:
                logical_count[u] = logical_count.get(u, 0) + 1
        assert max(logical_count.values(), default=0) <= rules.max_per_gpu


@given(placed_under_rules(), st.integers(min_value=1, max_value=8))
def test_compaction_under_a_workload_bound_makes_room_within_it(
    case: tuple[policy.Rules, list[Device], list[Placement]], eighths: int
) -> None:
    rules, devices, leases = case
    request = eighths * devices[0].total // 8
    logical = policy.plan_logical(devices, leases, request, 1, rules)
    if logical is None:
        return
    moves = policy.plan_compaction(devices, leases, {u: request for u in logical}, rules)
    assert moves is not None, "a lease the logical plan admits can always be made room for"
    moved = {m.lease_id: m.to_gpus for m in moves}
    after = [replace(p, physical=moved.get(p.id, p.physical)) for p in leases]
    after.append(Placement("new", JOB, request, logical, logical))
    assert _capacity_ok(devices, policy.physical_load(after))
    if rules.max_per_gpu is not None:
        assert max(policy.physical_count(after).values()) <= rules.max_per_gpu


def _capacity_ok(devices: list[Device], load: dict[str, int]) -> bool:
    return all(load.get(d.uuid, 0) <= d.total for d in devices)


@given(placed())
def test_requests_never_exceed_capacity(case: tuple[list[Device], list[Placement]]) -> None:
    devices, leases = case
    assert _capacity_ok(devices, policy.logical_load(leases))
    assert _capacity_ok(devices, policy.physical_load(leases))


@given(placed())
def test_jobs_run_on_their_logical_gpus(case: tuple[list[Device], list[Placement]]) -> None:
    _, leases = case
    assert all(p.physical == p.logical for p in leases if p.kind == JOB)


@given(placed(), st.integers(min_value=1, max_value=8), st.integers(min_value=1, max_value=2))
def test_compaction_frees_room_and_every_move_is_needed(
    case: tuple[list[Device], list[Placement]], eighths: int, count: int
) -> None:
    devices, leases = case
    request = eighths * devices[0].total // 8
    logical = policy.plan_logical(devices, leases, request, count)
    if logical is None:
        return
    moves = policy.plan_compaction(devices, leases, {u: request for u in logical})
    assert moves is not None, "a valid logical plan can always be compacted into"
    by_id = {p.id: p for p in leases}
    for m in moves:
        p = by_id[m.lease_id]
        assert p.kind == NOTEBOOK and m.from_gpus == p.physical and m.to_gpus == p.logical
        assert p.physical != p.logical

    def fits(chosen: list[policy.Move]) -> bool:
        load = policy.physical_load(leases)
        for u in logical:
            load[u] = load.get(u, 0) + request
        for m in chosen:
            p = by_id[m.lease_id]
            for u in p.physical:
                load[u] -= p.request
            for u in p.logical:
                load[u] = load.get(u, 0) + p.request
        return _capacity_ok(devices, load)

    assert fits(moves)
    for i in range(len(moves)):
        assert not fits(moves[:i] + moves[i + 1:]), "a move that is not needed"


@given(placed(), st.integers(min_value=1, max_value=8))
def test_compaction_moves_least_memory_among_single_gpu_choices(
    case: tuple[list[Device], list[Placement]], eighths: int
) -> None:
    """Against brute force over every subset of movable leases (small cases)."""
    devices, leases = case
    request = eighths * devices[0].total // 8
    logical = policy.plan_logical(devices, leases, request)
    movable = [p for p in leases if p.kind == NOTEBOOK and p.physical != p.logical]
    if logical is None or len(movable) > 8:
        return
    moves = policy.plan_compaction(devices, leases, {logical[0]: request})
    assert moves is not None
    best = None
    for size in range(len(movable) + 1):
        for combo in itertools.combinations(movable, size):
            load = policy.physical_load(leases)
            load[logical[0]] = load.get(logical[0], 0) + request
            for p in combo:
                load[p.physical[0]] -= p.request
                load[p.logical[0]] = load.get(p.logical[0], 0) + p.request
            if _capacity_ok(devices, load):
                cost = sum(p.usage for p in combo)
                best = cost if best is None else min(best, cost)
    assert best is not None
    # Greedy per GPU with pruning is exact on one overloaded GPU; cascades may cost more,
    # but never less than the optimum.
    assert sum(m.moved_bytes for m in moves) >= best
    if len({p.physical[0] for p in movable}) <= 1:
        assert sum(m.moved_bytes for m in moves) == best


@settings(max_examples=50)
@given(placed(), st.integers(min_value=1, max_value=8), st.randoms())
def test_plans_are_deterministic(
    case: tuple[list[Device], list[Placement]], eighths: int, rnd: random.Random
) -> None:
    devices, leases = case
    request = eighths * devices[0].total // 8
    shuffled = leases[:]
    rnd.shuffle(shuffled)
    assert policy.plan_logical(devices, leases, request) == policy.plan_logical(devices, shuffled, request)
    logical = policy.plan_logical(devices, leases, request)
    if logical is not None:
        incoming = {u: request for u in logical}
        assert policy.plan_compaction(devices, leases, incoming) == policy.plan_compaction(
            devices, shuffled, incoming
        )
    for d in devices:
        used = sum(p.usage for p in leases if d.uuid in p.physical)
        assert policy.plan_reclaim(d, leases, used, d.total // 20) == policy.plan_reclaim(
            d, shuffled, used, d.total // 20
        )


def test_binpack_logical_and_spread_physical() -> None:
    devices = [Device("GPU-0", 0, 16 * GB), Device("GPU-1", 1, 16 * GB)]
    a = Placement("a", NOTEBOOK, 4 * GB, ("GPU-0",), ("GPU-0",))
    assert policy.plan_logical(devices, [a], 4 * GB) == ("GPU-0",)  # fullest that fits
    here = ("GPU-0",)
    assert policy.plan_physical(devices, [a], NOTEBOOK, 4 * GB, here, 8 * GB) == ("GPU-1",)
    # Not burstable, a job, or the node scheduler off: it runs where the plan puts it.
    assert policy.plan_physical(devices, [a], NOTEBOOK, 4 * GB, here, 4 * GB) == here
    assert policy.plan_physical(devices, [a], JOB, 4 * GB, here, 8 * GB) == here
    off = policy.Rules(spread=False)
    assert policy.plan_physical(devices, [a], NOTEBOOK, 4 * GB, here, 8 * GB, off) == here
    # Two per GPU: a third lease goes where there is a free slot, or nowhere.
    two = policy.Rules(max_per_gpu=2)
    b = Placement("b", NOTEBOOK, 4 * GB, ("GPU-0",), ("GPU-0",))
    assert policy.plan_logical(devices, [a, b], 4 * GB, 1, two) == ("GPU-1",)
    c = Placement("c", NOTEBOOK, 4 * GB, ("GPU-1",), ("GPU-1",))
    d = Placement("d", NOTEBOOK, 4 * GB, ("GPU-1",), ("GPU-1",))
    assert policy.plan_logical(devices, [a, b, c, d], 1 * GB, 1, two) is None


def test_whole_gpu_job_moves_the_spread_notebook_home() -> None:
    devices = [Device("GPU-0", 0, 16 * GB), Device("GPU-1", 1, 16 * GB)]
    a = Placement("a", NOTEBOOK, 4 * GB, ("GPU-0",), ("GPU-0",), usage=GB)
    b = Placement("b", NOTEBOOK, 4 * GB, ("GPU-0",), ("GPU-1",), usage=2 * GB)
    logical = policy.plan_logical(devices, [a, b], 16 * GB)
    assert logical == ("GPU-1",)
    moves = policy.plan_compaction(devices, [a, b], {"GPU-1": 16 * GB})
    assert moves == [policy.Move("b", ("GPU-1",), ("GPU-0",), 2 * GB)]


def test_compaction_prefers_less_memory_moved() -> None:
    devices = [Device("GPU-0", 0, 16 * GB), Device("GPU-1", 1, 16 * GB)]
    big = Placement("big", NOTEBOOK, 4 * GB, ("GPU-0",), ("GPU-1",), usage=10 * GB)
    small1 = Placement("s1", NOTEBOOK, 4 * GB, ("GPU-0",), ("GPU-1",), usage=GB)
    small2 = Placement("s2", NOTEBOOK, 4 * GB, ("GPU-0",), ("GPU-1",), usage=GB)
    # A job of 8 GB on GPU-1 needs 4 GB freed there: one small notebook, not the big one.
    moves = policy.plan_compaction(devices, [big, small1, small2], {"GPU-1": 8 * GB})
    assert [m.lease_id for m in moves or []] == ["s1"]


def _exhaustive_subset(candidates: list[Placement], need: int,
                      need_count: int) -> list[Placement] | None:
    """The subset search compaction had before its branch and bound: every combination, the
    first by (usage, size, sorted ids). The oracle the product's search must agree with."""
    if sum(c.request for c in candidates) < need or len(candidates) < need_count:
        return None
    best: tuple[int, int, tuple[str, ...]] | None = None
    best_set: list[Placement] = []
    for size in range(max(1, need_count), len(candidates) + 1):
        for combo in itertools.combinations(candidates, size):
            if sum(c.request for c in combo) < need:
                continue
            key = (sum(c.usage for c in combo), size, tuple(sorted(c.id for c in combo)))
            if best is None or key < best:
                best, best_set = key, list(combo)
    return best_set


# Few distinct values as well as many: ties in usage, size and requests are where an exact
# search most easily parts from the exhaustive one.
_amounts = st.one_of(st.integers(0, 3), st.sampled_from([0, GB, 2 * GB, 4 * GB]),
                     st.integers(0, 80 * GB))


@settings(max_examples=400)
@given(st.lists(st.tuples(_amounts, _amounts), max_size=policy._EXACT_LIMIT), st.data())
def test_the_exact_subset_search_answers_as_the_exhaustive_one(
    amounts: list[tuple[int, int]], data: st.DataObject
) -> None:
    ids = data.draw(st.permutations([f"l-{i:02d}" for i in range(len(amounts))]))
    candidates = [Placement(i, NOTEBOOK, request, ("GPU-1",), ("GPU-0",), usage)
                  for i, (request, usage) in zip(ids, amounts, strict=True)]
    total = sum(request for request, _ in amounts)
    need = data.draw(st.one_of(st.integers(-GB, total + 1), st.sampled_from([total, 0, 1])))
    need_count = data.draw(st.integers(0, len(candidates) + 1))
    expected = _exhaustive_subset(candidates, need, need_count)
    assert policy._cheapest_subset(candidates, need, need_count) == expected


def test_the_exact_subset_search_breaks_ties_by_size_then_ids() -> None:
    same = [Placement(i, NOTEBOOK, GB, ("GPU-1",), ("GPU-0",), 0) for i in "dcba"]
    assert [c.id for c in policy._cheapest_subset(same, 2 * GB) or []] == ["b", "a"]
    mixed = [*same, Placement("e", NOTEBOOK, 2 * GB, ("GPU-1",), ("GPU-0",), 0)]
    assert [c.id for c in policy._cheapest_subset(mixed, 2 * GB) or []] == ["e"]


@st.composite
def one_gpu(draw: st.DrawFn) -> tuple[Device, list[Placement], int]:
    total = 16 * GB
    d = Device("GPU-0", 0, total)
    leases = []
    for i in range(draw(st.integers(min_value=0, max_value=8))):
        request = draw(st.integers(min_value=1, max_value=4)) * GB
        usage = draw(st.integers(min_value=0, max_value=8 * GB))
        leases.append(Placement(f"l{i}", NOTEBOOK, request, ("GPU-0",), ("GPU-0",), usage,
                                float(draw(st.integers(0, 5)))))
    other = draw(st.integers(min_value=0, max_value=2 * GB))
    return d, leases, other


@given(one_gpu())
def test_reclaim_takes_only_from_borrowers_and_covers_the_deficit(
    case: tuple[Device, list[Placement], int]
) -> None:
    d, leases, other = case
    used = min(d.total, sum(p.usage for p in leases) + other)
    headroom = d.total // 20
    chosen = policy.plan_reclaim(d, leases, used, headroom)
    by_id = {p.id: p for p in leases}
    owed = sum(max(0, p.request - p.usage) for p in leases)
    deficit = min(owed, headroom) - (d.total - used)
    if deficit <= 0:
        assert chosen == []
        return
    for r in chosen:
        p = by_id[r.lease_id]
        assert p.usage > p.request, "a lease under its request is never reclaimed"
        assert r.loan == p.usage - p.request
    loans = sum(p.usage - p.request for p in leases if p.usage > p.request)
    if loans >= deficit:
        assert sum(r.loan for r in chosen) >= deficit
        # No borrower more than needed: without the last one the deficit is not covered.
        assert sum(r.loan for r in chosen[:-1]) < deficit


def test_reclaim_order_largest_loan_then_newest() -> None:
    a = Placement("a", NOTEBOOK, GB, ("g",), ("g",), usage=3 * GB, created=1.0)
    b = Placement("b", NOTEBOOK, GB, ("g",), ("g",), usage=3 * GB, created=2.0)
    c = Placement("c", NOTEBOOK, GB, ("g",), ("g",), usage=5 * GB, created=0.0)
    assert [p.id for p in policy.reclaim_order([a, b, c])] == ["c", "b", "a"]


@given(one_gpu(), st.data())
def test_restoring_kernels_are_reclaimed_from_only_when_nothing_else_covers(
    case: tuple[Device, list[Placement], int], data: st.DataObject
) -> None:
    d, leases, other = case
    ids = [p.id for p in leases]
    restoring = frozenset(data.draw(st.sets(st.sampled_from(ids)) if ids else st.just(set())))
    used = min(d.total, sum(p.usage for p in leases) + other)
    headroom = d.total // 20
    chosen = policy.plan_reclaim(d, leases, used, headroom, restoring)
    # The same borrowers' loans are asked for; only who goes first changes.
    plain = policy.plan_reclaim(d, leases, used, headroom)
    assert bool(chosen) == bool(plain)
    deficit = chosen[0].deficit if chosen else 0
    settled = [p for p in leases if p.usage > p.request and p.id not in restoring]
    picked = [r.lease_id for r in chosen]
    if sum(p.usage - p.request for p in settled) >= deficit:
        assert not set(picked) & restoring, "a restoring kernel taken while others could give"
    # Restoring kernels come after every settled borrower.
    flags = [lease_id in restoring for lease_id in picked]
    assert flags == sorted(flags)
    # The guarantee holds through any grace: whatever all loans can cover is covered.
    loans = sum(p.usage - p.request for p in leases if p.usage > p.request)
    if chosen and loans >= deficit:
        assert sum(r.loan for r in chosen) >= deficit


def test_a_restoring_kernel_is_spared_only_while_others_cover() -> None:
    d = Device("g", 0, 10 * GB)
    owner = Placement("owner", NOTEBOOK, 4 * GB, ("g",), ("g",), usage=1 * GB)
    back = Placement("back", NOTEBOOK, 1 * GB, ("g",), ("g",), usage=5 * GB, created=2.0)
    other = Placement("other", NOTEBOOK, 1 * GB, ("g",), ("g",), usage=3 * GB, created=1.0)
    used, headroom = 9 * GB, 2 * GB  # owed 3 GiB, 1 GiB free: 1 GiB to take back
    assert [r.lease_id for r in policy.plan_reclaim(d, [owner, back, other], used, headroom)
            ] == ["back"], "without a grace, the largest loan goes first"
    restoring = frozenset({"back"})
    assert [r.lease_id for r in policy.plan_reclaim(
        d, [owner, back, other], used, headroom, restoring)] == ["other"]
    # Alone, it gives back all the same: the owner's guarantee comes first.
    assert [r.lease_id for r in policy.plan_reclaim(
        d, [owner, back], used, headroom, restoring)] == ["back"]


def test_kills_are_counted_within_the_window() -> None:
    assert policy.kills_in_window([100.0, 500.0, 650.0], now=701.0, window=600.0) == 2
    assert policy.kills_in_window([], now=700.0, window=600.0) == 0


@given(one_gpu(), st.data())
def test_growing_within_its_room_sets_off_no_reclaim_of_it(
    case: tuple[Device, list[Placement], int], data: st.DataObject
) -> None:
    """A restoring kernel loads what fits its room: that alone must never make it a target."""
    d, leases, other = case
    if not leases:
        return
    me = data.draw(st.sampled_from(leases))
    used = sum(p.usage for p in leases) + other
    if used > d.total:
        return
    headroom = d.total // 20
    room = policy.room(d, leases, me.id, used, headroom)
    assert room >= max(0, me.request - me.usage), "its unused request is always its own"
    grown = [replace(p, usage=p.usage + room) if p.id == me.id else p for p in leases]
    before = {r.lease_id for r in policy.plan_reclaim(d, leases, used, headroom)}
    after = {r.lease_id for r in policy.plan_reclaim(d, grown, used + room, headroom)}
    if me.usage + room > me.request:
        assert me.id not in after - before
    # One byte more than the room beyond its request sets off a reclaim.
    if me.usage + room >= me.request and used + room + 1 <= d.total:
        more = [replace(p, usage=p.usage + room + 1) if p.id == me.id else p for p in leases]
        assert policy.plan_reclaim(d, more, used + room + 1, headroom) or not any(
            p.request > p.usage for p in leases if p.id != me.id)


def test_room_is_what_the_others_are_not_owed() -> None:
    d = Device("g", 0, 2048 * MB)
    owner = Placement("owner", JOB, 1331 * MB, ("g",), ("g",), usage=0)
    back = Placement("back", NOTEBOOK, 614 * MB, ("g",), ("g",), usage=100 * MB, limit=2048 * MB)
    headroom = 1843 * MB
    # Free 1948 MiB, of which the owner is owed 1331: the kernel can add 617 MiB.
    assert policy.room(d, [owner, back], "back", 100 * MB, headroom) == 617 * MB
    assert policy.room(d, [back], "back", 100 * MB, headroom) == 1948 * MB
    capped = replace(back, limit=300 * MB)
    assert policy.room(d, [capped], "back", 100 * MB, headroom) == 200 * MB


@given(placed(), st.data())
def test_a_resize_fits_in_place_exactly_when_its_gpus_hold_every_request(
    case: tuple[list[Device], list[Placement]], data: st.DataObject
) -> None:
    devices, leases = case
    if not leases:
        return
    me = data.draw(st.sampled_from(leases))
    others = [p for p in leases if p.id != me.id]
    assert policy.fits_in_place(devices, others, me), "where it is, it fits as it is"
    request = data.draw(st.integers(1, 8)) * devices[0].total // 8
    resized = replace(me, request=request, limit=max(me.limit, request))
    fits = policy.fits_in_place(devices, others, resized)
    after = [*others, resized]
    planned, running = policy.logical_load(after), policy.physical_load(after)
    total = {d.uuid: d.total for d in devices}
    assert fits == (all(planned[u] <= total[u] for u in me.logical)
                    and all(running[u] <= total[u] for u in me.physical))
    if fits:
        smaller = replace(resized, request=data.draw(st.integers(1, resized.request)))
        assert policy.fits_in_place(devices, others, smaller), "a smaller request fits too"
        # What fits in place is its own: room() on its GPU covers all of its unused request.
        d = next(d for d in devices if d.uuid == me.physical[0])
        used = min(d.total, sum(p.usage for p in after if d.uuid in p.physical))
        room = policy.room(d, after, me.id, used, d.total // 20)
        assert room >= max(0, resized.request - resized.usage)


def test_fits_in_place_counts_no_unhealthy_gpu() -> None:
    here = Placement("me", NOTEBOOK, GB, ("GPU-0",), ("GPU-0",))
    assert policy.fits_in_place([Device("GPU-0", 0, 16 * GB)], [], here)
    assert not policy.fits_in_place([Device("GPU-0", 0, 16 * GB, healthy=False)], [], here)
    assert not policy.fits_in_place([], [], here)


@given(placed_under_rules(), st.data())
def test_activation_never_fills_a_gpu_past_its_capacity_or_the_rules(
    case: tuple[policy.Rules, list[Device], list[Placement]], data: st.DataObject
) -> None:
    rules, devices, leases = case
    # Waiting leases, some of which the node cannot run yet; some placed ones wait too.
    waiting = [
        Placement(f"p-{i}", JOB, eighths * devices[0].total // 8, (d.uuid,), (d.uuid,))
        for i, (d, eighths) in enumerate(data.draw(st.lists(
            st.tuples(st.sampled_from(devices), st.integers(1, 8)), max_size=4)))
    ]
    everything = leases + waiting
    pending = {p.id for p in waiting} | data.draw(st.sets(st.sampled_from([p.id for p in leases]))
                                                  if leases else st.just(set()))
    activated = policy.plan_activation(devices, everything, pending, rules)
    assert set(activated) <= pending
    assert activated == [p.id for p in everything if p.id in set(activated)], "in ledger order"
    total = {d.uuid: d.total for d in devices}
    load, count = policy.physical_load(everything), policy.physical_count(everything)
    for p in everything:
        if p.id not in pending:
            continue
        fits = all(load[u] <= total[u] and (rules.max_per_gpu is None or count[u] <= rules.max_per_gpu)
                   for u in p.physical)
        # Exactly those whose GPUs hold everything placed there: never past a bound, and
        # none left waiting that could run.
        assert (p.id in activated) == fits
    shuffled = everything[:]
    data.draw(st.randoms()).shuffle(shuffled)
    assert set(policy.plan_activation(devices, shuffled, pending, rules)) == set(activated)


standings = st.builds(
    policy.Standing,
    usage=st.integers(0, 16 * GB), request=st.integers(MB, 8 * GB),
    limit=st.one_of(st.just(0), st.integers(MB, 16 * GB)),
    shrinking=st.booleans(), deadline=st.none() | st.floats(0, 1000),
)


@given(standings, st.floats(0, 2000), st.booleans(), st.booleans(), st.floats(0, 100))
def test_the_ladder_takes_only_loans_and_kills_only_after_the_grace(
    standing: policy.Standing, now: float, owed: bool, enforce: bool, grace: float
) -> None:
    step = policy.reclaim_step(standing, now, owed=owed, grace=grace, enforce_limit=enforce)
    if standing.usage <= standing.request:
        assert step.action in (policy.NONE, policy.CANCEL), "a request is never taken back"
    if step.action == policy.KILL:
        assert standing.shrinking and standing.deadline is not None and now >= standing.deadline
    if step.action == policy.SHRINK:
        assert not standing.shrinking and step.at == now + grace
    if step.action == policy.CANCEL or step.action == policy.NONE:
        assert step.cause is None and step.action == (
            policy.CANCEL if standing.shrinking else policy.NONE)
    else:
        over_limit = enforce and 0 < standing.limit < standing.usage
        assert step.cause == (policy.RECLAIM if owed else policy.LIMIT)
        assert owed or over_limit


@given(standings, st.floats(0, 2000), st.floats(0, 2000), st.booleans(), st.booleans(),
       st.floats(0, 100))
def test_ladder_steps_are_monotone_in_time(
    standing: policy.Standing, t1: float, t2: float, owed: bool, enforce: bool, grace: float
) -> None:
    early, late = (policy.reclaim_step(standing, t, owed=owed, grace=grace, enforce_limit=enforce)
                   for t in sorted((t1, t2)))
    # Time only ever turns a wait into a kill, never the other way, nor anything else.
    assert early.action == late.action or (early.action, late.action) == (policy.WAIT, policy.KILL)
    assert early.cause == late.cause
    if early.action == policy.SHRINK:
        assert early.at is not None and late.at is not None and early.at <= late.at


@given(st.lists(st.tuples(st.floats(0, 50), st.sampled_from([0, GB, 2 * GB, 3 * GB, 4 * GB]),
                          st.sampled_from([True] * 4 + [False])), max_size=30),
       st.sampled_from([GB // 2, GB, 2 * GB]), st.sampled_from([0, 2 * GB, 3 * GB]), st.booleans(),
       st.floats(0, 60))
def test_a_kill_comes_only_after_a_shrink_asked_at_least_the_grace_before(
    ticks: list[tuple[float, int, bool]], request: int, limit: int, enforce: bool, grace: float
) -> None:
    """A lease climbed tick by tick, its usage and what others are owed changing."""
    now, standing = 0.0, policy.Standing(0, request, limit)
    asked_at: float | None = None
    for gap, usage, owed in ticks:
        now += gap
        standing = replace(standing, usage=usage)
        step = policy.reclaim_step(standing, now, owed=owed, grace=grace, enforce_limit=enforce)
        if step.action == policy.SHRINK:
            asked_at = now
            standing = replace(standing, shrinking=True, deadline=step.at)
        elif step.action == policy.CANCEL:
            asked_at = None
            standing = replace(standing, shrinking=False, deadline=None)
        elif step.action == policy.KILL:
            assert asked_at is not None and now >= asked_at + grace
            assert usage > request and (owed or (enforce and 0 < limit < usage))
            return


def test_a_lease_owed_and_over_its_limit_is_reclaimed_for_the_owner() -> None:
    over = policy.Standing(usage=3 * GB, request=GB, limit=2 * GB)
    step = policy.reclaim_step(over, 10.0, owed=True, grace=30.0, enforce_limit=True)
    assert step == policy.Step(policy.SHRINK, policy.RECLAIM, 40.0)
    asked = replace(over, shrinking=True, deadline=40.0)
    assert policy.reclaim_step(asked, 39.0, owed=False, grace=30.0, enforce_limit=True) == \
        policy.Step(policy.WAIT, policy.LIMIT, 40.0)
    assert policy.reclaim_step(asked, 40.0, owed=False, grace=30.0, enforce_limit=False) == \
        policy.Step(policy.CANCEL)


@given(placed_under_rules(), st.sampled_from([1, 2, 4, 8]), st.integers(1, 3), st.data())
def test_the_gpus_said_to_be_short_are_those_placement_passes_over(
    case: tuple[policy.Rules, list[Device], list[Placement]], eighths: int, count: int,
    data: st.DataObject,
) -> None:
    """A lease waiting for a GPU is told why, GPU by GPU: the GPUs named are exactly those
    plan_logical cannot use, so it is placed whenever fewer than it needs are named."""
    rules, devices, leases = case
    sick = data.draw(st.sets(st.sampled_from([d.uuid for d in devices])))
    devices = [replace(d, healthy=d.uuid not in sick) for d in devices]
    request = eighths * devices[0].total // 8
    short = policy.shortfalls(devices, leases, request, rules)
    chosen = policy.plan_logical(devices, leases, request, count, rules)
    assert (chosen is not None) == (len(devices) - len(short) >= count)
    assert not set(chosen or ()) & {s.uuid for s in short}
    assert [s.index for s in short] == sorted(s.index for s in short)
    load, by_id = policy.logical_load(leases), {p.id: p for p in leases}
    for s in short:
        device = next(d for d in devices if d.uuid == s.uuid)
        assert s.free == max(0, device.total - load.get(s.uuid, 0))
        assert not s.healthy or s.free < request or s.full
        if s.whole is not None:
            job = by_id[s.whole]
            assert job.kind == JOB and s.uuid in job.logical and job.request >= device.total


def test_a_gpu_held_by_a_whole_gpu_job_says_so() -> None:
    devices = [Device("GPU-0", 0, 8 * GB), Device("GPU-1", 1, 8 * GB)]
    leases = [Placement("j", JOB, 8 * GB, ("GPU-0",), ("GPU-0",)),
              Placement("n", NOTEBOOK, 6 * GB, ("GPU-1",), ("GPU-1",))]
    assert policy.shortfalls(devices, leases, 4 * GB) == [
        policy.Shortfall("GPU-0", 0, 0, False, "j"), policy.Shortfall("GPU-1", 1, 2 * GB, False, None)]
    assert policy.shortfalls(devices, leases, 2 * GB, policy.Rules(max_per_gpu=1)) == [
        policy.Shortfall("GPU-0", 0, 0, True, "j"), policy.Shortfall("GPU-1", 1, 2 * GB, True, None)]
    assert policy.shortfalls(devices, leases, 2 * GB) == [policy.Shortfall("GPU-0", 0, 0, False, "j")]


@st.composite
def pods_arrive(draw: st.DrawFn) -> tuple[policy.Rules, list[Device], list[Placement], dict[str, int]]:
    """A node as the agent left it, some leases fixed by the cluster or seeing only some GPUs,
    and a pod the kubelet gave one or more GPUs whole."""
    rules, devices, leases = draw(placed_under_rules())
    uuids = [d.uuid for d in devices]
    leases = [replace(p, fixed=draw(st.booleans()) and p.kind == NOTEBOOK,
                      reach=tuple(draw(st.sets(st.sampled_from(uuids))) | set(p.logical)
                                  | set(p.physical)) if draw(st.booleans()) else ())
              for p in leases]
    pinned = draw(st.sets(st.sampled_from(uuids), min_size=1, max_size=len(uuids)))
    return rules, devices, leases, {u: devices[0].total for u in sorted(pinned)}


@given(pods_arrive())
@settings(max_examples=300)
def test_a_pod_s_gpus_are_emptied_of_every_notebook_that_has_somewhere_to_go(
    case: tuple[policy.Rules, list[Device], list[Placement], dict[str, int]]
) -> None:
    rules, devices, leases, pinned = case
    plan = policy.plan_evacuation(devices, leases, pinned, rules)
    by_id = {p.id: p for p in leases}
    moves = {m.lease_id: m for m in plan.moves}
    for lease_id, logical in plan.relocated.items():
        p = by_id[lease_id]
        # Only notebooks the agent planned on a pinned GPU are re-planned, within their reach.
        assert p.kind == NOTEBOOK and not p.fixed and set(p.logical) & set(pinned)
        assert not set(logical) & set(pinned) and len(logical) == p.devices
        assert not p.reach or set(logical) <= set(p.reach)
    for m in plan.moves:
        p = by_id[m.lease_id]
        # A move leaves a pinned GPU for the notebook's (new) logical GPU, never another.
        assert p.kind == NOTEBOOK and set(m.from_gpus) == set(p.physical)
        assert m.to_gpus == plan.relocated.get(p.id, p.logical)
        assert not set(m.to_gpus) & set(pinned)
    # After the moves, a notebook still on a pinned GPU is stranded, and said to be.
    for p in leases:
        if p.kind == NOTEBOOK and set(p.physical) & set(pinned) and p.id not in moves:
            assert p.id in plan.stranded
    assert set(plan.stranded).isdisjoint(moves)
    # Every move lands within capacity and the rules, beside everything that runs there.
    after_moves = [replace(p, physical=moves[p.id].to_gpus) if p.id in moves else p
                   for p in leases]
    load, count = policy.physical_load(after_moves), policy.physical_count(after_moves)
    before, before_count = policy.physical_load(leases), policy.physical_count(leases)
    capacity = {d.uuid: d.total for d in devices}
    for u in {u for m in plan.moves for u in m.to_gpus}:
        assert load[u] <= max(capacity[u], before.get(u, 0)), (u, load[u], capacity[u])
        if rules.max_per_gpu is not None:
            assert count[u] <= max(rules.max_per_gpu, before_count.get(u, 0)), u
    # Only notebooks are asked to make way; a job is never stranded nor moved.
    assert all(by_id[i].kind == NOTEBOOK for i in plan.stranded)
    # Re-planning never over-promises: the logical plan off the pod's GPUs stays in capacity.
    after = [replace(p, logical=plan.relocated.get(p.id, p.logical)) for p in leases]
    before_load = policy.logical_load(leases)
    load = policy.logical_load(after)
    for d in devices:
        if d.uuid not in pinned and load.get(d.uuid, 0) > before_load.get(d.uuid, 0):
            assert load[d.uuid] <= d.total


def test_a_notebook_whose_logical_gpu_a_pod_takes_is_planned_anew_and_moves() -> None:
    devices = [Device("GPU-0", 0, 16 * GB), Device("GPU-1", 1, 16 * GB)]
    leases = [Placement("nb", NOTEBOOK, 4 * GB, ("GPU-0",), ("GPU-0",), 1 * GB)]
    plan = policy.plan_evacuation(devices, leases, {"GPU-0": 16 * GB})
    assert plan.relocated == {"nb": ("GPU-1",)} and plan.stranded == ()
    assert plan.moves == [policy.Move("nb", ("GPU-0",), ("GPU-1",), 1 * GB)]
    # The cluster planned it there (KAI's plan and the kubelet disagree): it stays, said so.
    fixed = [replace(leases[0], fixed=True)]
    assert policy.plan_evacuation(devices, fixed, {"GPU-0": 16 * GB}) == policy.Evacuation(
        {}, [], ("nb",))
    # It cannot see GPU 1: nowhere to go.
    blind = [replace(leases[0], reach=("GPU-0",))]
    assert policy.plan_evacuation(devices, blind, {"GPU-0": 16 * GB}).stranded == ("nb",)


def test_an_evacuation_never_fills_a_gpu_past_what_stays_there() -> None:
    """S, planned on the pod's GPU A, runs on B and has nowhere else to be planned; N, planned
    on B, runs on A. Moving N home would put 110 on B beside S: N stays, stranded."""
    devices = [Device(u, i, 100) for i, u in enumerate("ABC")]
    leases = [Placement("job", JOB, 100, ("C",), ("C",), 100),
              Placement("S", NOTEBOOK, 60, ("A",), ("B",), 60, limit=100),
              Placement("N", NOTEBOOK, 50, ("B",), ("A",), 50, limit=100)]
    plan = policy.plan_evacuation(devices, leases, {"A": 100})
    assert plan.moves == [] and plan.stranded == ("N",) and plan.relocated == {}
    # Under a bound of one lease per GPU, N cannot join S on B either, whatever the room.
    roomy = [Device(u, i, 1000) for i, u in enumerate("ABC")]
    bound = policy.plan_evacuation(roomy, leases, {"A": 1000}, policy.Rules(max_per_gpu=1))
    assert all("B" not in m.to_gpus for m in bound.moves)
