"""Pure placement, compaction, activation and reclaim decisions: no I/O, nothing else of the agent.

Every function here is deterministic: the same node and leases give the same answer,
whatever order they come in.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from fractions import Fraction
from itertools import accumulate

NOTEBOOK = "notebook"
JOB = "job"
KINDS = (NOTEBOOK, JOB)

# Exact subset search up to this many movable leases on one GPU; greedy beyond.
_EXACT_LIMIT = 12


@dataclass(frozen=True)
class Device:
    """A GPU as policy sees it: capacity only."""

    uuid: str
    index: int
    total: int
    healthy: bool = True


@dataclass(frozen=True)
class Placement:
    """A lease as policy sees it. ``request`` and ``usage`` are bytes per device."""

    id: str
    kind: str
    request: int
    logical: tuple[str, ...]
    physical: tuple[str, ...]
    usage: int = 0
    created: float = 0.0
    limit: int = 0
    # The GPUs it can run on (empty: any), and whether the cluster fixed its logical GPUs.
    reach: tuple[str, ...] = ()
    fixed: bool = False

    @property
    def devices(self) -> int:
        return len(self.logical)


@dataclass(frozen=True)
class Rules:
    """The node scheduler's settings, as Run:ai names them.

    ``spread``: burstable notebooks run spread over the emptiest GPUs and move back when room
    is needed (off: every lease runs where the logical plan puts it, and nothing moves to
    make room). ``max_per_gpu``: how many leases one GPU may run at once (None: not enforced).
    """

    spread: bool = True
    max_per_gpu: int | None = None


def burstable(request: int, limit: int) -> bool:
    """Only a lease that may grow past its request is rerouted by the node scheduler."""
    return limit > request


@dataclass(frozen=True)
class Move:
    """Compaction: send lease ``lease_id`` from its physical GPUs back to its logical ones."""

    lease_id: str
    from_gpus: tuple[str, ...]
    to_gpus: tuple[str, ...]
    moved_bytes: int


@dataclass(frozen=True)
class Reclaim:
    """Take ``loan`` bytes back from borrower ``lease_id`` on ``gpu``."""

    lease_id: str
    gpu: str
    loan: int
    deficit: int


def _tally(leases: Iterable[Placement], physical: bool) -> tuple[dict[str, int], dict[str, int]]:
    """Requested bytes and lease counts per GPU, where leases run or where the plan has them:
    one pass, since placement asks for both on every call."""
    load: dict[str, int] = {}
    count: dict[str, int] = {}
    for lease in leases:
        for uuid in lease.physical if physical else lease.logical:
            load[uuid] = load.get(uuid, 0) + lease.request
            count[uuid] = count.get(uuid, 0) + 1
    return load, count


def physical_count(leases: Iterable[Placement]) -> dict[str, int]:
    """How many leases run on each GPU."""
    return _tally(leases, physical=True)[1]


def logical_load(leases: Iterable[Placement]) -> dict[str, int]:
    """Sum of requests per GPU in the logical (bin-packed) plan."""
    return _tally(leases, physical=False)[0]


def physical_load(leases: Iterable[Placement]) -> dict[str, int]:
    """Sum of requests per GPU where leases really run."""
    return _tally(leases, physical=True)[0]


def _pick(
    devices: Sequence[Device], load: Mapping[str, int], request: int, count: int, *, spread: bool,
    counts: Mapping[str, int], max_per_gpu: int | None,
) -> tuple[str, ...] | None:
    fitting = [
        d for d in devices if d.healthy and d.total - load.get(d.uuid, 0) >= request
        and (max_per_gpu is None or counts.get(d.uuid, 0) < max_per_gpu)
    ]
    if len(fitting) < count:
        return None

    def portion(d: Device) -> float:
        return load.get(d.uuid, 0) / d.total if d.total else 1.0

    # binpack: the fullest GPU that fits (KAI's default); spread: the emptiest.
    sign = 1 if spread else -1
    fitting.sort(key=lambda d: (sign * portion(d), d.index))
    return tuple(d.uuid for d in fitting[:count])


def plan_logical(
    devices: Sequence[Device], leases: Iterable[Placement], request: int, count: int = 1,
    rules: Rules = Rules(),
) -> tuple[str, ...] | None:
    """Where a new lease goes in the logical plan (binpack), or None when no GPU has room
    (or every GPU already holds ``rules.max_per_gpu`` leases)."""
    load, counts = _tally(leases, physical=False)
    return _pick(devices, load, request, count, spread=False, counts=counts,
                 max_per_gpu=rules.max_per_gpu)


@dataclass(frozen=True)
class Shortfall:
    """Why one GPU cannot take a lease in the logical plan: what the plan leaves free on it,
    whether it already runs ``max_per_gpu`` leases, the job that holds all of it (None: none
    does), and whether it is healthy."""

    uuid: str
    index: int
    free: int
    full: bool
    whole: str | None
    healthy: bool = True


def shortfalls(devices: Sequence[Device], leases: Iterable[Placement], request: int,
               rules: Rules = Rules()) -> list[Shortfall]:
    """The GPUs that cannot take a lease of ``request`` bytes in the logical plan, and why, in
    index order: a lease for ``count`` GPUs is placed by :func:`plan_logical` exactly when at
    least ``count`` GPUs are not among them."""
    leases = list(leases)
    load, counts = _tally(leases, physical=False)
    out = []
    for d in sorted(devices, key=lambda d: d.index):
        free = d.total - load.get(d.uuid, 0)
        full = rules.max_per_gpu is not None and counts.get(d.uuid, 0) >= rules.max_per_gpu
        if d.healthy and free >= request and not full:
            continue
        whole = min((p.id for p in leases if p.kind == JOB and d.uuid in p.logical
                     and p.request >= d.total), default=None)
        out.append(Shortfall(d.uuid, d.index, max(0, free), full, whole, d.healthy))
    return out


def plan_physical(
    devices: Sequence[Device],
    leases: Iterable[Placement],
    kind: str,
    request: int,
    logical: tuple[str, ...],
    limit: int = 0,
    rules: Rules = Rules(),
) -> tuple[str, ...]:
    """Where a new lease runs: burstable notebooks spread over the emptiest GPUs (while the
    node scheduler is on); everything else on its logical GPUs.

    A notebook falls back to its logical GPUs when no GPU has physical room (compaction then
    makes room there).
    """
    if kind == JOB or not rules.spread or not burstable(request, limit):
        return logical
    load, counts = _tally(leases, physical=True)
    chosen = _pick(devices, load, request, len(logical), spread=True, counts=counts,
                   max_per_gpu=rules.max_per_gpu)
    return chosen if chosen is not None else logical


@dataclass
class _Load:
    """Requested bytes and lease counts per GPU, where leases run."""

    bytes: dict[str, int]
    count: dict[str, int]

    def copy(self) -> _Load:
        return _Load(dict(self.bytes), dict(self.count))

    def apply(self, lease: Placement) -> None:
        """``lease`` goes home: from its physical GPUs to its logical ones."""
        for uuid in lease.physical:
            self.bytes[uuid] = self.bytes.get(uuid, 0) - lease.request
            self.count[uuid] = self.count.get(uuid, 0) - 1
        for uuid in lease.logical:
            self.bytes[uuid] = self.bytes.get(uuid, 0) + lease.request
            self.count[uuid] = self.count.get(uuid, 0) + 1

    def excess(self, device: Device, max_per_gpu: int | None) -> tuple[int, int]:
        """(bytes, leases) over what ``device`` may hold."""
        extra = 0 if max_per_gpu is None else self.count.get(device.uuid, 0) - max_per_gpu
        return self.bytes.get(device.uuid, 0) - device.total, extra

    def overloaded(self, devices: Sequence[Device], max_per_gpu: int | None) -> list[Device]:
        return [d for d in devices if max(self.excess(d, max_per_gpu)) > 0]


def _feasible(devices: Sequence[Device], base: _Load, leases: Iterable[Placement],
              max_per_gpu: int | None) -> bool:
    load = base.copy()
    for lease in leases:
        load.apply(lease)
    return not load.overloaded(devices, max_per_gpu)


def _cheapest_subset(candidates: Sequence[Placement], need: int,
                     need_count: int = 0) -> list[Placement] | None:
    """The candidates whose requests free ``need`` bytes (and that number at least
    ``need_count`` leases) with the least memory moved."""
    if sum(c.request for c in candidates) < need or len(candidates) < need_count:
        return None
    if len(candidates) <= _EXACT_LIMIT:
        return _exact_subset(candidates, need, max(1, need_count))
    # Greedy: least memory moved per byte freed.
    chosen: list[Placement] = []
    freed = 0
    for c in sorted(candidates, key=lambda c: (c.usage / max(c.request, 1), c.id)):
        chosen.append(c)
        freed += c.request
        if freed >= need and len(chosen) >= need_count:
            return chosen
    return None


def _exact_subset(candidates: Sequence[Placement], need: int, least: int) -> list[Placement]:
    """Of the subsets of ``candidates`` (unique ids, usage >= 0) with requests of at least
    ``need`` and at least ``least`` members, the first by (usage, size, sorted ids), in the
    candidates' order; found by branch and bound.

    Each candidate costs one integer that orders subsets as that key does: its usage weighs
    most, then one unit per member, less a bit that is the higher the smaller its id (of two
    sets of one size and usage, the smaller sorted ids are the ones holding the smallest id of
    those in only one). Costs are positive and no two subsets cost the same, so a cover is
    never extended, and a branch goes only while its bound is below the best cover's cost.
    """
    n = len(candidates)
    rank = {c.id: r for r, c in enumerate(sorted(candidates, key=lambda c: c.id))}
    unit = 1 << n  # one member more outweighs any sum of id bits
    per_byte = (n + 1) * unit  # one byte more outweighs any count and bits
    costs = [c.usage * per_byte + unit - (1 << (n - 1 - rank[c.id])) for c in candidates]
    # Cheapest per byte freed first: good covers come early, and any tail of this order gives
    # the fractional bound in one pass.
    order = sorted(range(n), key=lambda i: (candidates[i].request <= 0, Fraction(
        costs[i], candidates[i].request) if candidates[i].request > 0 else 0))
    cost = [costs[i] for i in order]
    freed = [candidates[i].request for i in order]
    tail_freed = [sum(freed[k:]) for k in range(n + 1)]
    # From each position on: what the largest 1, 2, ... requests free, and what the cheapest
    # 1, 2, ... members cost.
    reach = [list(accumulate(sorted(freed[k:], reverse=True))) for k in range(n + 1)]
    cheapest = [[0, *accumulate(sorted(cost[k:]))] for k in range(n + 1)]
    best_cost = -1
    best_mask = 0

    def bound(k: int, short: int, members: int) -> int:
        """Least cost still to add from position k on, to free ``short`` more bytes and add
        ``members`` more members: the fractional knapsack (rounded up), or the cheapest of as
        many members as it takes, whichever says more."""
        fractional = 0
        fewest = 0
        if short > 0:
            fewest = bisect_left(reach[k], short) + 1
            for j in range(k, n):
                if freed[j] >= short:
                    fractional += -(-cost[j] * short // freed[j])
                    break
                fractional += cost[j]
                short -= freed[j]
        return max(fractional, cheapest[k][max(fewest, members)])

    def search(k: int, spent: int, got: int, size: int, mask: int) -> None:
        nonlocal best_cost, best_mask
        if got >= need and size >= least:
            if best_cost < 0 or spent < best_cost:
                best_cost, best_mask = spent, mask
            return
        if k == n or got + tail_freed[k] < need or size + n - k < least:
            return
        if best_cost >= 0 and spent + bound(k, need - got, least - size) >= best_cost:
            return
        search(k + 1, spent + cost[k], got + freed[k], size + 1, mask | 1 << order[k])
        search(k + 1, spent, got, size, mask)

    search(0, 0, 0, 0, 0)
    return [c for i, c in enumerate(candidates) if best_mask >> i & 1]


def plan_compaction(
    devices: Sequence[Device], leases: Sequence[Placement], incoming: Mapping[str, int],
    rules: Rules = Rules(),
) -> list[Move] | None:
    """The moves that make room for a lease of ``incoming`` request bytes per GPU, moving the
    least memory.

    Only notebooks away from their logical GPUs move, and only back to them. A GPU is full
    past its capacity or past ``rules.max_per_gpu`` leases. Returns [] when everything
    already fits, None when no set of moves makes it fit. The result is irredundant: dropping
    any single move leaves some GPU full past its bounds.
    """
    base = _Load(*_tally(leases, physical=True))
    for uuid, extra in incoming.items():
        base.bytes[uuid] = base.bytes.get(uuid, 0) + extra
        base.count[uuid] = base.count.get(uuid, 0) + 1
    if not base.overloaded(devices, rules.max_per_gpu):
        return []  # the common case, answered before any sorting
    leases = sorted(leases, key=lambda p: p.id)
    load = base.copy()
    movable = {
        p.id: p for p in leases if p.kind == NOTEBOOK and set(p.physical) != set(p.logical)
    }
    moved: dict[str, Placement] = {}
    while over := load.overloaded(devices, rules.max_per_gpu):
        gpu = over[0]
        candidates = [
            p for p in movable.values()
            if p.id not in moved and gpu.uuid in p.physical and gpu.uuid not in p.logical
        ]
        need, need_count = load.excess(gpu, rules.max_per_gpu)
        subset = _cheapest_subset(candidates, need, need_count)
        if subset is None:
            return None
        for p in subset:
            moved[p.id] = p
            load.apply(p)
    # Drop moves that later moves made unnecessary, largest first.
    for p in sorted(moved.values(), key=lambda p: (-p.usage, p.id)):
        rest = [q for q in moved.values() if q.id != p.id]
        if _feasible(devices, base, rest, rules.max_per_gpu):
            del moved[p.id]
    return [
        Move(p.id, p.physical, p.logical, p.usage * p.devices)
        for p in sorted(moved.values(), key=lambda p: p.id)
    ]


@dataclass(frozen=True)
class Evacuation:
    """Room on GPUs the cluster gave a pod whole: the notebooks whose logical GPU was there and
    where the plan puts them now (id -> logical GPUs), the moves that empty those GPUs, and the
    notebooks that still run there afterwards (no room elsewhere, or planned there by the
    cluster)."""

    relocated: Mapping[str, tuple[str, ...]]
    moves: list[Move]
    stranded: tuple[str, ...]


def plan_evacuation(devices: Sequence[Device], leases: Sequence[Placement],
                    pinned: Mapping[str, int], rules: Rules = Rules()) -> Evacuation:
    """Empty the ``pinned`` GPUs (uuid -> bytes the pod takes) of notebooks, moving the least.

    The cluster has already started the pod there: nothing can refuse it. Notebooks the agent
    planned on a pinned GPU get a new logical GPU among those they can reach (largest request
    first, binpack, as a new lease would); then every notebook running on a pinned GPU goes
    home. A notebook the cluster planned there, one with no room elsewhere, or one whose move
    cannot be planned is stranded where it is.
    """
    others = [d for d in devices if d.uuid not in pinned]
    placed: dict[str, Placement] = {p.id: p for p in leases}
    relocated: dict[str, tuple[str, ...]] = {}
    unplaced: list[str] = []  # displaced, with no room to be planned anywhere else
    displaced = sorted((p for p in leases if p.kind == NOTEBOOK and set(p.logical) & set(pinned)),
                       key=lambda p: (-p.request, p.id))
    for p in displaced:
        rest = [q for q in placed.values() if q.id != p.id and q.id not in unplaced]
        reachable = [d for d in others if not p.reach or d.uuid in p.reach]
        # A plan the cluster made is not ours to change.
        logical = None if p.fixed else plan_logical(reachable, rest, p.request, p.devices, rules)
        if logical is None:
            unplaced.append(p.id)
            continue
        relocated[p.id] = logical
        placed[p.id] = replace(p, logical=logical)
    # Only what runs on a pinned GPU need move; one that could not be planned stays where it runs.
    planned = [p for p in placed.values() if p.id not in unplaced]
    held = [replace(placed[i], logical=placed[i].physical) for i in unplaced]
    moves = plan_compaction(devices, [*planned, *held], pinned, rules)
    if moves is None:
        # Not all of it fits: move, one by one, those that have room at home beside everything
        # that runs (the stranded included) within the rules.
        moves = []
        running = {p.id: p for p in [*planned, *held]}
        for p in sorted(planned, key=lambda p: p.id):
            if (set(p.physical) & set(pinned) and not set(p.logical) & set(pinned)
                    and _room_at_home(devices, list(running.values()), p, rules)):
                moves.append(Move(p.id, p.physical, p.logical, p.usage * p.devices))
                running[p.id] = replace(p, physical=p.logical)
    moving = {m.lease_id for m in moves}
    stranded = [p.id for p in [*planned, *held] if p.kind == NOTEBOOK and p.id not in moving
                and set(p.physical) & set(pinned)]
    return Evacuation(relocated, moves, tuple(sorted(stranded)))


@dataclass(frozen=True)
class FreezePlan:
    """Room for a lease made by freezing notebooks: the GPUs it goes on, and the notebooks
    (ids) whose processes are frozen so that it fits there."""

    gpus: tuple[str, ...]
    frozen: tuple[str, ...]


def _freeze_subset(device: str, candidates: Sequence[Placement], need_logical: int,
                   need_physical: int, need_count: int) -> tuple[int, list[Placement]] | None:
    """The candidates to freeze on ``device`` that free the bytes needed in the plan and where
    leases run (and the count), holding the least memory; (cost, chosen) or None."""
    def frees(chosen: Iterable[Placement]) -> tuple[int, int, int]:
        chosen = list(chosen)
        return (sum(c.request for c in chosen if device in c.logical),
                sum(c.request for c in chosen if device in c.physical),
                sum(1 for c in chosen if device in c.physical))

    def enough(chosen: Sequence[Placement]) -> bool:
        logical, physical, count = frees(chosen)
        return logical >= need_logical and physical >= need_physical and count >= need_count

    ordered = sorted(candidates, key=lambda c: (c.usage, c.id))
    if not enough(ordered):
        return None
    if len(ordered) <= _EXACT_LIMIT:
        best: tuple[int, list[Placement]] | None = None
        for mask in range(1 << len(ordered)):
            chosen = [c for i, c in enumerate(ordered) if mask >> i & 1]
            cost = sum(c.usage for c in chosen)
            if (best is None or (cost, len(chosen)) < (best[0], len(best[1]))) and enough(chosen):
                best = (cost, chosen)
        return best
    # Greedy beyond: the most bytes freed per byte frozen first, then drop what is not needed.
    chosen = []
    for c in sorted(ordered, key=lambda c: (c.usage / max(c.request, 1), c.id)):
        chosen.append(c)
        if enough(chosen):
            break
    for c in sorted(chosen, key=lambda c: (-c.usage, c.id)):
        rest = [q for q in chosen if q.id != c.id]
        if enough(rest):
            chosen = rest
    return sum(c.usage for c in chosen), chosen


def plan_freezes(devices: Sequence[Device], leases: Sequence[Placement], request: int,
                 count: int, freezable: Collection[str], rules: Rules = Rules()
                 ) -> FreezePlan | None:
    """Where a lease of ``request`` bytes on ``count`` GPUs fits once some notebooks are
    frozen (their memory goes to host memory; they leave the plan and the GPU until they
    thaw), freezing the least memory; None when freezing every ``freezable`` notebook (ids)
    still leaves too few GPUs with room.

    A frozen notebook frees its request where the plan has it and where it runs. GPUs are
    chosen by the memory frozen on them, then by index.
    """
    logical, _ = _tally(leases, physical=False)
    running, counts = _tally(leases, physical=True)
    options: list[tuple[int, int, str, list[Placement]]] = []
    for d in devices:
        if not d.healthy:
            continue
        candidates = [p for p in leases if p.kind == NOTEBOOK and p.id in freezable
                      and (d.uuid in p.logical or d.uuid in p.physical)]
        need_count = (0 if rules.max_per_gpu is None
                      else counts.get(d.uuid, 0) + 1 - rules.max_per_gpu)
        found = _freeze_subset(d.uuid, candidates, logical.get(d.uuid, 0) + request - d.total,
                               running.get(d.uuid, 0) + request - d.total, need_count)
        if found is not None:
            options.append((found[0], d.index, d.uuid, found[1]))
    if len(options) < count:
        return None
    options.sort(key=lambda o: (o[0], o[1]))
    chosen = options[:count]
    frozen = sorted({p.id for *_, subset in chosen for p in subset})
    return FreezePlan(tuple(uuid for _, _, uuid, _ in chosen), tuple(frozen))


def _room_at_home(devices: Sequence[Device], leases: Sequence[Placement], p: Placement,
                  rules: Rules) -> bool:
    """Whether ``p`` fits on its logical GPUs where ``leases`` run now, within the rules."""
    capacity = {d.uuid: d.total for d in devices if d.healthy}
    others = [q for q in leases if q.id != p.id]
    running, count = physical_load(others), physical_count(others)
    return all(running.get(u, 0) + p.request <= capacity.get(u, 0)
               and (rules.max_per_gpu is None or count.get(u, 0) < rules.max_per_gpu)
               for u in p.logical)


def reclaim_order(
    borrowers: Iterable[Placement], restoring: frozenset[str] = frozenset()
) -> list[Placement]:
    """Who gives memory back first: kernels still restoring last, then the largest loan, then
    the newest lease, then by id.

    A kernel that has just come back holds what it is restoring: taking it back first would
    kill it again for the same memory (a loop). The largest loan first means the fewest
    notebooks are disturbed; among equals the newest lease yields, since the older one has had
    its memory longer.
    """
    return sorted(
        borrowers, key=lambda p: (p.id in restoring, -(p.usage - p.request), -p.created, p.id)
    )


def plan_reclaim(
    device: Device, leases: Sequence[Placement], used: int, headroom: int,
    restoring: frozenset[str] = frozenset(),
) -> list[Reclaim]:
    """Borrowers on ``device`` to take back, when an owner's guarantee is threatened.

    ``used`` is the device memory in use now (all processes). A lease under its request is
    owed ``request - usage``; the guarantee is threatened when free memory has fallen below
    ``headroom`` while something is still owed, by ``min(owed, headroom) - free``. Borrowers
    (usage above request) are chosen in :func:`reclaim_order` until their loans cover that.

    A ``restoring`` kernel (within its grace after it came back) is chosen only when the other
    borrowers' loans together do not cover the deficit: the guarantee comes before the grace.
    """
    on_device = [p for p in leases if device.uuid in p.physical]
    owed = sum(max(0, p.request - p.usage) for p in on_device)
    free = max(0, device.total - used)
    deficit = min(owed, headroom) - free
    if deficit <= 0:
        return []
    chosen: list[Reclaim] = []
    covered = 0
    for p in reclaim_order((q for q in on_device if q.usage > q.request), restoring):
        loan = p.usage - p.request
        chosen.append(Reclaim(p.id, device.uuid, loan, deficit))
        covered += loan
        if covered >= deficit:
            break
    return chosen


def room(device: Device, leases: Sequence[Placement], lease_id: str, used: int,
         headroom: int) -> int:
    """How much more ``lease_id`` can hold on ``device`` now without setting off a reclaim.

    Its unused request is always its own. Beyond it the lease borrows, and :func:`plan_reclaim`
    takes loans back once free memory falls below what the others are owed (capped at
    ``headroom``): it may grow until free memory is down to that. Its limit caps both.
    """
    on_device = [p for p in leases if device.uuid in p.physical]
    me = next((p for p in on_device if p.id == lease_id), None)
    if me is None:
        return 0
    own = max(0, me.request - me.usage)
    others_owed = sum(max(0, p.request - p.usage) for p in on_device if p.id != lease_id)
    free = max(0, device.total - used)
    grow = max(own, free - min(others_owed, headroom))
    return max(0, min(grow, me.limit - me.usage)) if me.limit else max(0, grow)


def kills_in_window(kill_times: Iterable[float], now: float, window: float) -> int:
    """How many times a lease was killed in the last ``window`` seconds."""
    return sum(1 for t in kill_times if now - window <= t <= now)


def fits_in_place(devices: Sequence[Device], others: Iterable[Placement], lease: Placement) -> bool:
    """Whether ``lease``, with a changed request, stays where it is: beside ``others`` (every
    lease but it) its request fits each of its logical GPUs in the plan and each physical GPU
    it runs on. Its count on those GPUs does not change, so ``max_per_gpu`` never stops it."""
    others = list(others)
    capacity = {d.uuid: d.total for d in devices if d.healthy}
    planned, running = logical_load(others), physical_load(others)
    return all(planned.get(u, 0) + lease.request <= capacity.get(u, 0) for u in lease.logical) and all(
        running.get(u, 0) + lease.request <= capacity.get(u, 0) for u in lease.physical
    )


def plan_activation(devices: Sequence[Device], leases: Sequence[Placement],
                    pending: Collection[str], rules: Rules = Rules()) -> list[str]:
    """The ``pending`` leases (ids) that can become active, in the order of ``leases``: each
    GPU one runs on holds every lease placed there (the pending ones too) within its capacity
    and ``rules.max_per_gpu``. A lease moving away counts where it runs until its move is done."""
    capacity = {d.uuid: d.total for d in devices}
    load, count = physical_load(leases), physical_count(leases)
    bound = rules.max_per_gpu
    return [
        p.id for p in leases
        if p.id in pending and all(
            load.get(u, 0) <= capacity.get(u, 0) and (bound is None or count.get(u, 0) <= bound)
            for u in p.physical
        )
    ]


# The reclaim ladder's steps for one lease (offloading is the kernel's, within the grace).
NONE = "none"  # nothing to take back
SHRINK = "shrink"  # send `shrink` and start the grace
WAIT = "wait"  # asked already; the grace runs
KILL = "kill"  # the grace passed and it still holds the memory
CANCEL = "cancel"  # asked, but nothing is to be taken back any more
# Why a lease is on the ladder: an owner is owed memory it borrows, or it is above its limit.
RECLAIM = "reclaim"
LIMIT = "limit"


@dataclass(frozen=True)
class Standing:
    """A lease as the reclaim ladder sees it: bytes it holds and may hold (``limit`` 0: none),
    and whether it was asked to shrink, with the deadline of that grace."""

    usage: int
    request: int
    limit: int = 0
    shrinking: bool = False
    deadline: float | None = None


@dataclass(frozen=True)
class Step:
    """The ladder's next step for a lease, ``cause`` (RECLAIM or LIMIT; None when nothing is
    to be taken back), and ``at``: the deadline a SHRINK sets, or the one a WAIT runs to."""

    action: str
    cause: str | None = None
    at: float | None = None


def reclaim_step(standing: Standing, now: float, *, owed: bool, grace: float,
                 enforce_limit: bool) -> Step:
    """Where the reclaim ladder takes a lease next: ``shrink``, wait out the grace, then kill.

    ``owed``: :func:`plan_reclaim` chose it on some GPU (its loan is wanted). Without that, a
    lease above its limit climbs the same ladder when ``enforce_limit``. A lease within its
    request is never taken from: that much is guaranteed. When nothing is to be taken back a
    shrink asked is called off.
    """
    over_limit = enforce_limit and standing.limit > 0 and standing.usage > standing.limit
    borrowing = standing.usage > standing.request
    cause = RECLAIM if owed and borrowing else LIMIT if over_limit and borrowing else None
    if cause is None:
        return Step(CANCEL if standing.shrinking else NONE)
    if not standing.shrinking:
        return Step(SHRINK, cause, now + grace)
    if standing.deadline is not None and now >= standing.deadline:
        return Step(KILL, cause)
    return Step(WAIT, cause, standing.deadline)
