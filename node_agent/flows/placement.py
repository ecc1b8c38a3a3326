"""Placement: where a lease goes (its share, quotas, moves or freezes that make room), and why it waits."""

from __future__ import annotations

import logging
import secrets
import time
from collections import Counter
from dataclasses import replace
from typing import Any

from node_agent import policy
from node_agent.flows.common import (
    Caller,
    Conflict,
    CreateLease,
    OverQuota,
    Refused,
    Resize,
    describe,
    whose,
)
from node_agent.flows.room import Room
from node_agent.ledger import CLUSTER, Lease
from node_agent.quantities import MiB, Quantity, QuantityError, check_share, format_bytes, parse_quantity
from node_agent.stats import AFTER_WAIT, RELEASED
from node_agent.words import LEASE_STATE_WORDS

log = logging.getLogger("gpufrac.agent")

# The smallest share: below it a fraction such as 1e-300 would make a lease of no bytes.
MIN_SHARE = MiB


def _compute_share(current: tuple[float | None, float | None], request: float | None,
                   limit: float | None) -> tuple[float | None, float | None]:
    """Compute fractions after a change: the limit defaults to the request, and must not be
    below it."""
    req = request if request is not None else current[0]
    lim = limit if limit is not None else request if request is not None else current[1]
    if lim is not None and req is None:
        raise Refused("compute_limit", "needs compute_request beside it")
    if req is not None and lim is not None and lim < req:
        raise Refused("compute_limit", f"must be at least compute_request ({req:g}), got {lim:g}")
    return req, lim


def kept_plan(lease: Lease) -> dict[str, Any]:
    """What placing ``lease`` again keeps: the GPUs it can reach, the cluster's plan."""
    return {"reach": lease.reach, "logical": lease.logical if lease.planned_by else None}


class Placement(Room):
    """Where each lease is planned and runs (the ledger keeps it: logical and physical GPUs,
    and what a pending one waits for)."""

    def create_lease(self, caller: Caller, ask: CreateLease) -> Lease:
        self.ctx.polling.wake()
        held = sum(1 for lease in self.ledger.leases.values() if lease.owner_uid == caller.uid)
        if not caller.admin and held >= self.config.max_leases_per_user:
            raise OverQuota(None, f"you hold {held} leases, the most one user may hold on "
                            "this node; release some (`gpufrac-agent status`)")
        healthy = [g for g in self.ctx.gpus if g.healthy]
        if not 1 <= ask.devices <= max(1, len(healthy)):
            raise Refused("devices", f"expected 1 to {len(healthy)} GPUs, got {ask.devices}")
        req, lim = self._resolve_share(ask.request, ask.limit)
        self._check_quota(caller, req, ask.devices)
        compute_request, compute_limit = _compute_share(
            (None, None), ask.compute_request, ask.compute_limit)
        self._check_gpus(ask)

        frozen: tuple[str, ...] = ()
        try:
            logical, physical, moves = self.place(ask.kind, req, lim, ask.devices,
                                                  self.ctx.planning_view(), reach=ask.reach,
                                                  logical=ask.logical)
        except Conflict as exc:
            plan = self._room_by_freezing(ask, req) if exc.field == "request" else None
            if plan is None:
                if ask.kind == policy.JOB and exc.field == "request":
                    raise Conflict("request", self._no_way(ask, req, caller.uid)) from exc
                raise
            logical = physical = plan.gpus
            moves, frozen = [], plan.frozen
        # Room the plan counts as made may still be held by leases on their way out.
        leaving = () if moves or frozen else self._leaving(physical, req)
        now = time.time()
        lease = Lease(
            id="l-" + secrets.token_hex(6), kind=ask.kind, owner_uid=caller.uid, client=ask.client,
            kernel_id=ask.kernel_id, name=ask.name, request=req, limit=lim,
            request_spec=str(ask.request), limit_spec=str(ask.limit), logical=logical,
            physical=physical, state="pending" if moves or frozen or leaving else "active",
            created=now, updated=now, reason=self.waiting_reason(moves, caller.uid) if moves else (
                f"waiting for {len(frozen)} notebook(s) on {self.ctx.labels(physical)} to be frozen "
                "(their kernels keep everything in host memory and thaw when this job ends)"
                if frozen else f"waiting for {len(leaving)} lease(s) still on "
                f"{self.ctx.labels(physical)} to finish leaving it" if leaving else "placed"),
            compute_request=compute_request, compute_limit=compute_limit, devices=ask.devices,
            reach=ask.reach, planned_by=CLUSTER if ask.logical is not None else "",
            waits_for=tuple(m.lease_id for m in moves) + frozen + leaving,
        )
        with self.ledger.transaction():
            self.ledger.insert(lease)
            self.ctx.moves.start_moves(moves, f"free {self.ctx.labels(physical)}", lease)
            for notebook_id in frozen:
                self.ctx.freezing.make_way(self.ledger.leases[notebook_id], lease)
        log.info("lease %s (%s, uid %d): request %s on %s, physical %s, %d move(s), %d freeze(s)",
                 lease.id, ask.kind, caller.uid, format_bytes(req), logical, physical, len(moves),
                 len(frozen))
        return self.ledger.leases[lease.id]

    def _check_quota(self, caller: Caller, req: int, devices: int, owner: int | None = None,
                     exclude: str | None = None) -> None:
        """Refuse (OverQuota) a share of ``req`` bytes on each of ``devices`` GPUs that would
        take ``owner``'s leases (the caller's; ``exclude`` not counted: it is being resized)
        past --max-bytes-per-user or --max-gpus-per-user. Admins are not capped."""
        cfg = self.config
        if caller.admin or (cfg.max_bytes_per_user is None and cfg.max_gpus_per_user is None):
            return
        uid = caller.uid if owner is None else owner
        mine = [lease for lease in self.ledger.leases.values()
                if lease.owner_uid == uid and lease.id != exclude]
        held = sum(lease.request * lease.devices for lease in mine)
        asked = req * devices
        if cfg.max_bytes_per_user is not None and held + asked > cfg.max_bytes_per_user:
            raise OverQuota("request", (
                f"max_bytes_per_user: you reserve {format_bytes(held)} in {len(mine)} other "
                f"lease(s); {format_bytes(asked)} more would pass the "
                f"{format_bytes(cfg.max_bytes_per_user)} one user may reserve on this node "
                "(--max-bytes-per-user); ask for less or release some (`gpufrac-agent status`)"))
        if cfg.max_gpus_per_user is not None:
            # A share counts as its part of a GPU (the smallest, as fractions resolve).
            usable = self._smallest_usable()
            gpus = sum(lease.request * lease.devices / usable for lease in mine)
            more = asked / usable
            if gpus + more > cfg.max_gpus_per_user + 1e-9:
                raise OverQuota("devices" if devices > 1 else "request", (
                    f"max_gpus_per_user: you reserve {gpus:.2f} GPU(s) in {len(mine)} other "
                    f"lease(s); {more:.2f} more would pass the {cfg.max_gpus_per_user} one user "
                    "may reserve on this node (--max-gpus-per-user); ask for less or release "
                    "some (`gpufrac-agent status`)"))

    def _resolve_share(self, request: Quantity, limit: Quantity) -> tuple[int, int]:
        """Request and limit in bytes; fractions resolve against the smallest healthy GPU's
        usable memory, so a lease fits wherever it lands. A share counts its process's CUDA
        context, as NVML does: a request smaller than a context could never be kept."""
        healthy = [g for g in self.ctx.gpus if g.healthy]
        try:
            req, lim = check_share(request, limit, self._smallest_usable())
        except QuantityError as exc:
            raise Refused(exc.field, exc.message) from exc
        if req < MIN_SHARE:
            raise Refused("request", f"{format_bytes(req)} is too small to hold anything; "
                          f"ask for at least {format_bytes(MIN_SHARE)}")
        context = max(g.context_size for g in healthy)
        if req < context:
            raise Refused("request", f"{format_bytes(req)} is less than the "
                          f"{format_bytes(context)} a CUDA context takes on this node's GPUs; "
                          f"ask for at least {format_bytes(context)} (a share counts its context)")
        return req, lim

    def _smallest_usable(self) -> int:
        """What fractions resolve against: the smallest healthy GPU's usable memory."""
        healthy = [g.memory_usable for g in self.ctx.gpus if g.healthy]
        if not healthy:
            raise Conflict(None, "this node has no healthy GPU to place a lease on")
        return min(healthy)

    def _check_gpus(self, ask: CreateLease) -> None:
        """The GPUs a lease names are this node's, its logical ones healthy and reachable."""
        for name, uuids in (("reachable_gpus", ask.reach), ("logical_gpus", ask.logical or ())):
            for uuid in uuids:
                gpu = self.ctx.gpu(uuid)
                if gpu is None:
                    known = ", ".join(g.uuid for g in self.ctx.gpus)
                    raise Refused(name, f"{uuid} is not a GPU of this node; it has {known}")
                if name == "logical_gpus" and not gpu.healthy:
                    # Not the caller's mistake: the lease waits, as for room.
                    raise Conflict(name, f"the cluster's plan puts it on {self.ctx.gpu_label(uuid)}, "
                                         f"which is not usable now: {gpu.error}")
        if ask.reach and len(ask.reach) < ask.devices:
            raise Refused("reachable_gpus", f"names {len(ask.reach)} GPU(s), fewer than the "
                                            f"{ask.devices} asked for")
        if ask.logical is not None:
            if len(ask.logical) != ask.devices:
                raise Refused("logical_gpus", f"expected {ask.devices} GPU(s), one per device, "
                                              f"got {len(ask.logical)}")
            unreachable = set(ask.logical) - set(ask.reach) if ask.reach else set()
            if unreachable:
                raise Refused("reachable_gpus", "must include the logical GPUs, where the lease "
                                                f"moves back to; {sorted(unreachable)} are not")

    def place(self, kind: str, req: int, lim: int, count: int, others: list[policy.Placement],
              *, reach: tuple[str, ...] = (), logical: tuple[str, ...] | None = None
               ) -> tuple[tuple[str, ...], tuple[str, ...], list[policy.Move]]:
        """Where a lease of ``req`` bytes on ``count`` GPUs goes: its logical GPUs (planned, or
        the cluster's ``logical`` where they have room), the ones it runs on among those it can
        ``reach``, and the moves that make room there."""
        devices = self.ctx.devices()
        rules = self.config.rules
        if logical is not None:
            planned = [d for d in devices if d.uuid in logical]
            if policy.plan_logical(planned, others, req, count, rules) is None:
                raise Conflict(
                    "logical_gpus",
                    f"the cluster's plan puts it on {self.ctx.labels(logical)}, which has no room for "
                    f"{format_bytes(req)} more in this node's plan (leases the cluster does not "
                    "know of hold it: gpufrac-agent status shows them)")
            return self._run_where(kind, req, lim, logical, others, reach)
        # Planned only where its processes can run: it moves back there when room is needed.
        devices = [d for d in devices if not reach or d.uuid in reach]
        logical = policy.plan_logical(devices, others, req, count, rules)
        if logical is None:
            if policy.plan_logical(devices, others, req, count) is not None:
                raise Conflict(
                    "request",
                    f"every GPU with room already runs {rules.max_per_gpu} lease(s), the most "
                    "this node allows (--max-workloads-per-gpu); wait for leases to end "
                    "(gpufrac-agent status shows them)")
            load = policy.logical_load(others)
            best = max((d.total - load.get(d.uuid, 0) for d in devices if d.healthy), default=0)
            raise Conflict(
                "request",
                f"no GPU has room for {format_bytes(req)} more; the most any GPU can still "
                f"guarantee is {format_bytes(best)}. Ask for less, or wait for leases to end "
                "(gpufrac-agent status shows them)",
            )
        return self._run_where(kind, req, lim, logical, others, reach)

    def _run_where(self, kind: str, req: int, lim: int, logical: tuple[str, ...],
                   others: list[policy.Placement], reach: tuple[str, ...]
                   ) -> tuple[tuple[str, ...], tuple[str, ...], list[policy.Move]]:
        devices = self.ctx.devices()
        rules = self.config.rules
        reachable = [d for d in devices if not reach or d.uuid in reach]
        physical = policy.plan_physical(reachable, others, kind, req, logical, lim, rules)
        moves = policy.plan_compaction(devices, others, {u: req for u in physical}, rules)
        if moves is None:
            raise Conflict("request", "no set of moves makes room; try again shortly")
        return logical, physical, moves

    def _leaving(self, physical: tuple[str, ...], req: int) -> tuple[str, ...]:
        """The leases moving or freezing off ``physical`` that a new lease of ``req`` bytes
        there waits for: none where it fits beside everything that still runs there."""
        leases = self.ledger.leases.values()
        capacity = {d.uuid: d.total for d in self.ctx.devices()}
        running = policy.physical_load(lease.placement() for lease in leases)
        if all(running.get(u, 0) + req <= capacity.get(u, 0) for u in physical):
            return ()
        return tuple(lease.id for lease in leases if lease.state in ("migrating", "freezing")
                     and set(lease.physical) & set(physical))

    def _room_by_freezing(self, ask: CreateLease, req: int) -> policy.FreezePlan | None:
        """Where a job that finds no room (and no moves that make it) runs once the notebooks
        in its way are frozen: on a one-GPU node, or with every GPU busy, they wait in host
        memory rather than stop it. None for notebooks, the cluster's plans, or no such room."""
        if ask.kind != policy.JOB or ask.logical is not None:
            return None
        devices = [d for d in self.ctx.devices() if not ask.reach or d.uuid in ask.reach]
        return policy.plan_freezes(devices, self.ctx.planning_view(), req, ask.devices,
                                   self._freezable(), self.config.rules)

    def _freezable(self) -> set[str]:
        """The leases a job may freeze: running notebooks the agent planned (a cluster's plan
        would still count them)."""
        return {lease.id for lease in self.ledger.leases.values() if lease.kind == policy.NOTEBOOK
                and lease.state in ("active", "shrinking") and not lease.planned_by}

    def resize(self, caller: Caller, lease_id: str, change: Resize) -> Lease:
        self.ctx.polling.wake()
        lease = self.ctx.lease(caller, lease_id)
        if lease.state not in ("active", "shrinking"):
            raise Conflict("lease", f"the lease is {LEASE_STATE_WORDS.get(lease.state, lease.state)}; "
                                    "its share can change once it runs on a GPU")
        request = change.request or parse_quantity(lease.request_spec, "request")
        limit = change.limit or parse_quantity(lease.limit_spec, "limit")
        if change.limit is None:
            # The limit stays as it was, unless the new request is above it: then it rises
            # to the request (a limit below the request would be refused).
            usable = self._smallest_usable()
            if limit.bytes_of(usable) < request.bytes_of(usable):
                limit = request
        req, lim = self._resolve_share(request, limit)
        self._check_quota(caller, req, lease.devices, lease.owner_uid, exclude=lease.id)
        others = self.ctx.planning_view(exclude=lease.id)
        compute_request, compute_limit = _compute_share(
            (lease.compute_request, lease.compute_limit), change.compute_request,
            change.compute_limit)
        changes = {"request": req, "limit": lim, "request_spec": str(request),
                   "limit_spec": str(limit), "compute_request": compute_request,
                   "compute_limit": compute_limit}
        # Whoever follows the lease (the Jupyter server) hears of the change as it happens.
        notice = {"request_spec": changes["request_spec"], "limit_spec": changes["limit_spec"],
                  "request": req, "limit": lim}
        said = f"request {format_bytes(req)}, limit {format_bytes(lim)}"
        if policy.fits_in_place(self.ctx.devices(), others,
                                replace(lease.placement(), request=req, limit=lim)):
            with self.ledger.transaction():
                lease = self.ledger.update(lease.id, **changes, reason="request changed in place")
                self.ctx.directives.add(lease, "resized", said, **notice)
            return lease
        logical, physical, moves = self.place(lease.kind, req, lim, len(lease.logical), others,
                                              **kept_plan(lease))
        if physical == lease.physical:
            # It stays; whatever must make room moves, and it is told nothing (there is
            # nothing for it to do).
            with self.ledger.transaction():
                self.ctx.moves.start_moves(moves, "make room", lease)
                lease = self.ledger.update(
                    lease.id, **changes, logical=logical,
                    reason="request changed; it stays where it runs"
                    + (f" and {len(moves)} other lease(s) move to make room" if moves else ""))
                self.ctx.directives.add(lease, "resized", said, **notice)
            return lease
        reason = (f"moved from {self.ctx.labels(lease.physical)} to {self.ctx.labels(physical)} "
                  f"because its request changed to {format_bytes(req)}")
        with self.ledger.transaction():
            self.ctx.moves.start_moves(moves, "make room", lease)
            deadline = time.time() + self.config.migrate_grace
            lease = self.ledger.update(lease.id, **changes, logical=logical, target=physical,
                                       state="migrating", deadline=deadline, reason=reason)
            self.stats.move_started(lease.id, "request_changed")
            self.ctx.directives.add(lease, "resized", said, **notice)
            self.ctx.moves.move(lease, reason, cause="request_changed")
        return lease

    def release(self, caller: Caller, lease_id: str) -> None:
        self.ctx.polling.wake()
        self.end(self.ctx.lease(caller, lease_id))

    def end(self, lease: Lease) -> None:
        """The lease is released: what it held, and what waited for it, is free now."""
        self.ledger.delete(lease.id)
        self.ctx.freezing.forget(lease.id)
        self.stats.move_ended(lease.id, RELEASED)  # a no-op unless it was on its way
        self.ctx.usage.forget(lease.id)
        self.activate_pending()

    def activate_pending(self) -> None:
        leases = self.ledger.leases
        pending = [lease for lease in leases.values() if lease.state == "pending"]
        if not pending:  # as nearly every tick finds: no placement to build
            return
        # An unparked lease that found no room waits with no GPU, until one has room for it.
        for lease in pending:
            if not lease.physical:
                self.ctx.parking.place_waiting(lease, AFTER_WAIT)
        placed = {lease.id for lease in leases.values()
                  if lease.state == "pending" and lease.physical}
        if not placed:
            return
        placements = [lease.placement() for lease in leases.values()]
        for lease_id in policy.plan_activation(self.ctx.devices(), placements, placed,
                                               self.config.rules):
            lease = leases[lease_id]
            if lease.parked_at is not None:
                self.ctx.parking.unparked(lease, lease.logical, lease.physical, AFTER_WAIT)
            else:
                self.ledger.update(lease_id, state="active", reason="placed after compaction")

    def waiting_for(self, lease: Lease, reader_uid: int) -> list[dict[str, Any]]:
        """What a pending ``lease`` waits for, for the user ``reader_uid``: each lease its plan
        moves, freezes or parks that still runs on its GPUs — who (`_whose`), where, what is
        done to it (``moving``, ``freezing`` or ``parking``: its client was asked to, once its
        kernel is idle) and ``deadline``, when a move is cut off at the latest (None: nothing
        is timed). Empty for a lease that waits for nothing in particular."""
        if lease.state != "pending":
            return []
        out = []
        for other_id in lease.waits_for:
            other = self.ledger.leases.get(other_id)
            here = [g for g in other.physical if g in lease.physical] if other else []
            if other is None or not here:
                continue  # released, moved, frozen or parked: its room is made
            action = {"migrating": "moving", "freezing": "freezing"}.get(other.state, "parking")
            out.append({
                "who": whose(other, reader_uid), "kind": other.kind,
                "gpu": self.ctx.labels(here), "action": action,
                "to": self.ctx.labels(other.target) if action == "moving" else None,
                "deadline": other.deadline if action == "moving" else None,
            })
        return out

    def waiting_reason(self, moves: list[policy.Move], owner_uid: int) -> str:
        """What a lease of ``owner_uid`` waits for, for its user: their own notebooks by name and id, other
        users' counted per GPU (neither ids nor names of theirs)."""
        parts: list[str] = []
        others: Counter[str] = Counter()
        for move in moves:
            moved = self.ledger.leases.get(move.lease_id)
            where = self.ctx.labels(move.from_gpus)
            if moved is not None and moved.owner_uid == owner_uid:
                parts.append(f"{describe(moved)} from {where}")
            else:
                others[where] += 1
        parts += [f"another user's notebook from {where}" if n == 1
                  else f"{n} other users' notebooks from {where}" for where, n in others.items()]
        return f"waiting for {len(moves)} notebook(s) to move: " + ", ".join(parts)

    def no_room_reason(self, lease: Lease) -> str:
        """Why no GPU takes ``lease`` now, GPU by GPU, in words its user understands."""
        need = format_bytes(lease.request)
        rules = self.config.rules
        short = policy.shortfalls(self.ctx.devices(), self.ctx.planning_view(), lease.request, rules)
        if len(self.ctx.gpus) - len(short) >= lease.devices:
            # The plan has room, but the notebooks spread over it cannot all move back yet.
            return f"waiting for a GPU: no set of moves makes room for its request of {need} yet"

        where = "no GPU has" if lease.devices == 1 else f"fewer than {lease.devices} GPUs have"
        return (f"waiting for a GPU: {where} {need} free for its request: "
                + (", ".join(self._shortfall(s, lease.owner_uid, "has") for s in short)
                   or "this node lists no GPU"))

    def _shortfall(self, s: policy.Shortfall, reader_uid: int, free: str) -> str:
        """Why GPU ``s`` cannot take a lease, for the user ``reader_uid``; ``free`` says how
        its free memory is meant (``has``, ``can free only``)."""
        label = f"GPU {s.index}"
        if not s.healthy:
            return f"{label} is unhealthy"
        if s.whole is not None:
            # Another user's job is named no more than `node` names it: not whose it is.
            return f"{label} is held whole by {whose(self.ledger.leases[s.whole], reader_uid)}"
        if s.full:
            return (f"{label} already runs {self.config.rules.max_per_gpu} lease(s), the most "
                    "this node allows")
        return f"{label} {free} {format_bytes(s.free)}"

    def _no_way(self, ask: CreateLease, req: int, owner_uid: int) -> str:
        """Why nothing the agent may do (move, freeze or park notebooks) makes room for a job
        now, GPU by GPU as if every notebook it may freeze were frozen, and what its user can
        do instead: never to wait, since nobody waits for it."""
        movable = self._freezable()
        fixed = [p for p in self.ctx.planning_view() if p.id not in movable]
        devices = [d for d in self.ctx.devices() if not ask.reach or d.uuid in ask.reach]
        short = policy.shortfalls(devices, fixed, req, self.config.rules)
        gpus = "a GPU" if ask.devices == 1 else f"{ask.devices} GPUs"
        why = ("; ".join(self._shortfall(s, owner_uid, "can free only") for s in short)
               or "leases it cannot touch now (moving, freezing or thawing) still run there")
        return (f"nothing this agent may move, freeze or park makes room for {format_bytes(req)} "
                f"on {gpus}: {why}. "
                "Jobs, and notebooks the cluster placed, are never moved or frozen. Run it again "
                "once they end (`gpufrac-agent status` shows them), or ask for less")
