"""The ledger: leases, their processes and outstanding directives, in SQLite (WAL).

Only this module writes state. Every change is one transaction, so an agent killed at any
moment comes back to a ledger that is either before or after each change, never between.
"""

from __future__ import annotations

import heapq
import json
import os
import sqlite3
import time
from bisect import bisect_left, bisect_right
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from node_agent.policy import Placement
from node_agent.quantities import stored_spec
from node_agent.words import CHECKPOINT_ON_DISK, FROZEN_IN_HOST_MEMORY

# "freezing" and "thawing": the driver is moving the lease's GPU state to its processes' host
# memory or back (seconds); a frozen lease is "parked" (idle) or "pending" (waiting for room).
STATES = ("pending", "active", "migrating", "shrinking", "killed", "parked", "freezing",
          "thawing")
# ``planned_by`` of a lease whose logical GPUs the cluster's scheduler chose (KAI's plan, told
# by the lease's client), and of a job lease for a pod the kubelet gave whole GPUs: its life is
# the pod's, not its processes'.
CLUSTER = "cluster"
KUBELET = "kubelet"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS leases (
    id TEXT PRIMARY KEY,
    kind TEXT NOT NULL,
    owner_uid INTEGER NOT NULL,
    client TEXT NOT NULL,
    kernel_id TEXT,
    name TEXT NOT NULL DEFAULT '',
    request INTEGER NOT NULL,
    lim INTEGER NOT NULL,
    request_spec TEXT NOT NULL,
    limit_spec TEXT NOT NULL,
    logical TEXT NOT NULL,
    physical TEXT NOT NULL,
    target TEXT NOT NULL DEFAULT '[]',
    state TEXT NOT NULL,
    reason TEXT NOT NULL DEFAULT '',
    deadline REAL,
    restore_until REAL,
    orphan_deadline REAL,
    registered REAL,
    compute_request REAL,
    compute_limit REAL,
    devices INTEGER,
    parked_at REAL,
    reach TEXT,
    planned_by TEXT,
    pod TEXT,
    frozen_at REAL,
    frozen_bytes INTEGER,
    frozen_on TEXT,
    fallback TEXT,
    waits_for TEXT,
    created REAL NOT NULL,
    updated REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS pids (
    lease_id TEXT NOT NULL REFERENCES leases(id) ON DELETE CASCADE,
    pid INTEGER NOT NULL,
    start_time INTEGER NOT NULL,
    PRIMARY KEY (lease_id, pid)
);
CREATE TABLE IF NOT EXISTS directives (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    client TEXT NOT NULL,
    lease_id TEXT NOT NULL,
    owner_uid INTEGER NOT NULL,
    kind TEXT NOT NULL,
    body TEXT NOT NULL,
    created REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS kills (
    lease_id TEXT NOT NULL,
    at REAL NOT NULL,
    cause TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS kills_by_lease ON kills (lease_id, at);
CREATE INDEX IF NOT EXISTS directives_by_created ON directives (created);
"""

# Columns added after the first release: (name, SQL type), added to older ledgers on open.
# At most this many directives are kept per lease (the oldest go first), besides the TTL: one
# lease's churn must not cost anyone else's reads, nor memory without end.
DIRECTIVES_PER_LEASE = 64
# Notices where only the latest counts: a new one replaces the lease's earlier one of its kind.
COALESCED = frozenset({"resized", "bursting"})

_ADDED_COLUMNS = (("restore_until", "REAL"), ("orphan_deadline", "REAL"), ("registered", "REAL"),
                  ("compute_request", "REAL"), ("compute_limit", "REAL"), ("devices", "INTEGER"),
                  ("parked_at", "REAL"), ("reach", "TEXT"), ("planned_by", "TEXT"),
                  ("pod", "TEXT"), ("frozen_at", "REAL"), ("frozen_bytes", "INTEGER"),
                  ("frozen_on", "TEXT"), ("fallback", "TEXT"), ("waits_for", "TEXT"))


@dataclass(frozen=True)
class Lease:
    """One workload's claim on GPU memory. ``usage`` is measured, never stored."""

    id: str
    kind: str
    owner_uid: int
    client: str
    request: int
    limit: int
    request_spec: str
    limit_spec: str
    logical: tuple[str, ...]
    physical: tuple[str, ...]
    state: str
    created: float
    updated: float
    kernel_id: str | None = None
    name: str = ""
    target: tuple[str, ...] = ()
    reason: str = ""
    deadline: float | None = None
    # Until when a kernel that came back (restart, move) is spared by reclaim.
    restore_until: float | None = None
    # When the lease is released unless a live process is registered by then.
    orphan_deadline: float | None = None
    # When a process was first registered: a later registration is a kernel coming back.
    registered: float | None = None
    pids: tuple[tuple[int, int], ...] = ()  # (pid, start time in clock ticks)
    usage: int = 0
    # Share of the GPU's compute (fractions; None: not asked for), and the measured SM
    # utilization of its processes in percent (None: not sampled).
    compute_request: float | None = None
    compute_limit: float | None = None
    compute_usage: int | None = None
    # How many GPUs it runs on, kept apart from ``logical``: a parked lease has none, and must
    # still say how many it needs when it is placed again.
    devices: int = 1
    # When it was parked: set while it is parked or waiting to be placed again, so that it is
    # told `unparked` once it runs.
    parked_at: float | None = None
    # The GPUs its processes can be started on (empty: any of the node's): a container sees
    # only the GPUs it was given.
    reach: tuple[str, ...] = ()
    # Who chose its logical GPUs: "" the agent, else CLUSTER or KUBELET; the agent never
    # re-plans those.
    planned_by: str = ""
    # On Kubernetes: (namespace, pod, container) its processes run in, or the pod holding the
    # GPUs of a KUBELET lease; () elsewhere.
    pod: tuple[str, ...] = ()
    # While its processes are frozen (the driver holds their GPU state in their host memory):
    # since when, how many bytes left the GPU, and the GPUs they were frozen on.
    frozen_at: float | None = None
    frozen_bytes: int = 0
    frozen_on: tuple[str, ...] = ()
    # Why the last freeze of it could not be used, and so a checkpoint and restart stood in
    # ("": none did).
    fallback: str = ""
    # While pending: the leases (ids) the agent is moving, freezing or parking to make room for
    # it, as its plan chose them.
    waits_for: tuple[str, ...] = ()

    @property
    def frozen(self) -> bool:
        return self.frozen_at is not None

    @property
    def protection(self) -> str:
        """What keeps its kernel's state while it has no GPU, as people read it."""
        return FROZEN_IN_HOST_MEMORY if self.frozen else CHECKPOINT_ON_DISK

    def placement(self) -> Placement:
        return Placement(
            self.id, self.kind, self.request, self.logical, self.physical,
            self.usage, self.created, self.limit, self.reach, bool(self.planned_by),
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "kind": self.kind,
            "owner_uid": self.owner_uid,
            "client": self.client,
            "kernel_id": self.kernel_id,
            "name": self.name,
            "request": self.request,
            "limit": self.limit,
            "request_spec": self.request_spec,
            "limit_spec": self.limit_spec,
            "devices": self.devices,
            "logical_gpu": self.logical[0] if self.logical else None,
            "logical_gpus": list(self.logical),
            "physical_gpu": self.physical[0] if self.physical else None,
            "physical_gpus": list(self.physical),
            "target_gpus": list(self.target),
            "pids": [pid for pid, _ in self.pids],
            "usage": self.usage,
            "bursting": self.usage > self.request,
            "compute_request": self.compute_request,
            "compute_limit": self.compute_limit,
            "compute_usage": self.compute_usage,
            "state": self.state,
            "reason": self.reason,
            "deadline": self.deadline,
            "restore_until": self.restore_until,
            "orphan_deadline": self.orphan_deadline,
            "parked_at": self.parked_at,
            "reachable_gpus": list(self.reach),
            "planned_by": self.planned_by or "agent",
            "pod": dict(zip(("namespace", "name", "container"), self.pod, strict=True))
            if self.pod else None,
            "frozen": self.frozen,
            "frozen_at": self.frozen_at,
            "frozen_bytes": self.frozen_bytes,
            "frozen_gpus": list(self.frozen_on),
            "protection": self.protection,
            "fallback": self.fallback,
            "created": self.created,
            "updated": self.updated,
        }


@dataclass
class Directive:
    seq: int
    client: str
    lease_id: str
    owner_uid: int
    kind: str
    body: dict[str, Any] = field(default_factory=dict)
    created: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            **self.body,
            "seq": self.seq,
            "client": self.client,
            "lease_id": self.lease_id,
            "kind": self.kind,
            "created": self.created,
        }


class Ledger:
    """Leases in SQLite, mirrored in memory for the agent's decisions."""

    # Directives older than this are dropped at start-up and when new ones are written.
    directive_ttl = 3600.0

    def __init__(self, state_dir: str | os.PathLike[str]) -> None:
        self.path = Path(state_dir) / "ledger.sqlite3"
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        # isolation_level=None: we issue BEGIN IMMEDIATE ourselves, one per change.
        self._db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.execute("PRAGMA foreign_keys=ON")
        self._db.executescript(_SCHEMA)
        self._add_columns()
        self.leases: dict[str, Lease] = {}
        self._depth = 0
        # Directives in memory, each list in seq order, by lease and by (owner uid, client name):
        # a reader touches only its own. ``_expiry`` holds (a lower bound of its oldest's
        # created, lease id) for each lease in ``_by_lease``, so the TTL costs what it drops.
        self._by_lease: dict[str, list[Directive]] = {}
        self._by_client: dict[tuple[int, str], list[Directive]] = {}
        self._expiry: list[tuple[float, str]] = []
        self._last_seq = 0
        # Counts the changes made (each transaction, and each reload): a view built from the
        # ledger is current while this has not moved.
        self.revision = 0
        self._reload()

    def close(self) -> None:
        self._db.close()

    def _add_columns(self) -> None:
        have = {row[1] for row in self._db.execute("PRAGMA table_info(leases)")}
        for name, kind in _ADDED_COLUMNS:
            if name not in have:
                self._db.execute(f"ALTER TABLE leases ADD COLUMN {name} {kind}")
        # A lease from before the devices column runs on as many GPUs as it is planned on:
        # written down once, before a park empties its logical GPUs.
        older = self._db.execute("SELECT id, logical FROM leases WHERE devices IS NULL").fetchall()
        self._db.executemany("UPDATE leases SET devices = ? WHERE id = ?",
                             [(len(json.loads(logical)), lease_id) for lease_id, logical in older])

    # --- reading -------------------------------------------------------------------
    def _reload(self) -> None:
        pids: dict[str, list[tuple[int, int]]] = {}
        for lease_id, pid, start in self._db.execute(
            "SELECT lease_id, pid, start_time FROM pids ORDER BY pid"
        ):
            pids.setdefault(lease_id, []).append((pid, start))
        usage = {k: (v.usage, v.compute_usage) for k, v in self.leases.items()}
        self.leases = {}
        cursor = self._db.execute("SELECT * FROM leases ORDER BY created, id")
        columns = [c[0] for c in cursor.description]
        for row in cursor:
            r = dict(zip(columns, row, strict=True))
            self.leases[r["id"]] = Lease(
                id=r["id"], kind=r["kind"], owner_uid=r["owner_uid"], client=r["client"],
                kernel_id=r["kernel_id"], name=r["name"], request=r["request"], limit=r["lim"],
                request_spec=stored_spec(r["request_spec"]),
                limit_spec=stored_spec(r["limit_spec"]),
                logical=tuple(json.loads(r["logical"])), physical=tuple(json.loads(r["physical"])),
                target=tuple(json.loads(r["target"])), state=r["state"], reason=r["reason"],
                deadline=r["deadline"], restore_until=r["restore_until"],
                orphan_deadline=r["orphan_deadline"], registered=r["registered"],
                created=r["created"], updated=r["updated"],
                pids=tuple(pids.get(r["id"], ())), usage=usage.get(r["id"], (0, None))[0],
                compute_usage=usage.get(r["id"], (0, None))[1],
                compute_request=r["compute_request"], compute_limit=r["compute_limit"],
                devices=r["devices"],
                parked_at=r["parked_at"],
                reach=tuple(json.loads(r["reach"] or "[]")), planned_by=r["planned_by"] or "",
                pod=tuple(json.loads(r["pod"] or "[]")),
                frozen_at=r["frozen_at"], frozen_bytes=r["frozen_bytes"] or 0,
                frozen_on=tuple(json.loads(r["frozen_on"] or "[]")), fallback=r["fallback"] or "",
                waits_for=tuple(json.loads(r["waits_for"] or "[]")),
            )
        self._load_directives()

    def _load_directives(self) -> None:
        """Directives from SQLite into memory; at start-up those past the TTL, superseded or
        over the per-lease bound (a ledger from an older agent) are deleted."""
        self._by_lease, self._by_client, self._expiry = {}, {}, []
        cutoff = time.time() - self.directive_ttl
        dropped: list[Directive] = []
        for s, c, lid, uid, kind, body, created in self._db.execute(
            "SELECT seq, client, lease_id, owner_uid, kind, body, created FROM directives"
            " WHERE created >= ? ORDER BY seq", (cutoff,)
        ):
            dropped += self._keep(Directive(s, c, lid, uid, kind, json.loads(body), created))
        row = self._db.execute("SELECT seq FROM sqlite_sequence WHERE name = 'directives'").fetchone()
        self._last_seq = int(row[0]) if row else 0
        if self._depth == 0:  # not after a rollback: there memory already matches the file
            with self.transaction():
                self._db.execute("DELETE FROM directives WHERE created < ?", (cutoff,))
                self._db.executemany("DELETE FROM directives WHERE seq = ?",
                                     [(d.seq,) for d in dropped])

    def _keep(self, d: Directive) -> list[Directive]:
        """Add ``d`` in memory; returns those it displaced: the lease's earlier notice of a
        coalesced kind, and the oldest past DIRECTIVES_PER_LEASE."""
        queue = self._by_lease.get(d.lease_id)
        if queue is None:
            queue = self._by_lease[d.lease_id] = []
            heapq.heappush(self._expiry, (d.created, d.lease_id))
        dropped = [old for old in queue if old.kind == d.kind] if d.kind in COALESCED else []
        for old in dropped:
            self._forget(old)
        queue.append(d)
        self._by_client.setdefault((d.owner_uid, d.client), []).append(d)
        over = queue[:-DIRECTIVES_PER_LEASE]
        for old in over:
            self._forget(old)
        return dropped + over

    def _forget(self, d: Directive) -> None:
        _remove(self._by_lease[d.lease_id], d)
        key = (d.owner_uid, d.client)
        _remove(self._by_client[key], d)
        if not self._by_client[key]:
            del self._by_client[key]

    def _expire(self, now: float) -> list[Directive]:
        """Drop from memory the directives past the TTL; returns them."""
        cutoff = now - self.directive_ttl
        gone: list[Directive] = []
        while self._expiry and self._expiry[0][0] < cutoff:
            _, lease_id = heapq.heappop(self._expiry)
            queue = self._by_lease[lease_id]
            old = [d for d in queue if d.created < cutoff]
            for d in old:
                self._forget(d)
            gone += old
            if queue:
                heapq.heappush(self._expiry, (min(d.created for d in queue), lease_id))
            else:
                del self._by_lease[lease_id]
        return gone

    def directives_after(self, seq: int, client: str | None = None, lease_id: str | None = None,
                         owner_uid: int | None = None) -> list[Directive]:
        """Kept directives after ``seq``, oldest first: of a lease, of a client name (of one
        owner's leases with ``owner_uid``), or all. By lease, or by owner and client, it costs
        what that reader's own directives do, whatever others have."""
        if lease_id is not None:
            queue = self._by_lease.get(lease_id, [])
        elif client is not None and owner_uid is not None:
            queue = self._by_client.get((owner_uid, client), [])
        else:
            queue = sorted((d for q in self._by_lease.values() for d in q), key=_seq)
        return [d for d in queue[bisect_right(queue, seq, key=_seq):]
                if client in (None, d.client) and owner_uid in (None, d.owner_uid)]

    def kill_times(self, lease_id: str, cause: str | None = None) -> list[float]:
        """When the agent killed the lease's processes (for ``cause`` only, if given)."""
        query = "SELECT at FROM kills WHERE lease_id = ?"
        args: list[Any] = [lease_id]
        if cause is not None:
            query += " AND cause = ?"
            args.append(cause)
        return [float(at) for (at,) in self._db.execute(query + " ORDER BY at", args)]

    def last_seq(self) -> int:
        return self._last_seq

    # --- writing -------------------------------------------------------------------
    @contextmanager
    def transaction(self) -> Iterator[None]:
        """One atomic change; nested calls join the outer one. On error, memory is reloaded."""
        if self._depth:
            self._depth += 1
            try:
                yield
            finally:
                self._depth -= 1
            return
        self._db.execute("BEGIN IMMEDIATE")
        self._depth = 1
        try:
            yield
        except BaseException:
            self._db.execute("ROLLBACK")
            self._reload()
            raise
        else:
            self._db.execute("COMMIT")
        finally:
            self._depth = 0
            self.revision += 1

    def insert(self, lease: Lease) -> Lease:
        with self.transaction():
            self._db.execute(
                "INSERT INTO leases (id, kind, owner_uid, client, kernel_id, name, request, lim,"
                " request_spec, limit_spec, logical, physical, target, state, reason, deadline,"
                " restore_until, orphan_deadline, registered, compute_request, compute_limit,"
                " devices, parked_at, reach, planned_by, pod, frozen_at, frozen_bytes, frozen_on,"
                " fallback, waits_for, created, updated)"
                " VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
                (
                    lease.id, lease.kind, lease.owner_uid, lease.client, lease.kernel_id,
                    lease.name, lease.request, lease.limit, lease.request_spec, lease.limit_spec,
                    json.dumps(lease.logical), json.dumps(lease.physical), json.dumps(lease.target),
                    lease.state, lease.reason, lease.deadline, lease.restore_until,
                    lease.orphan_deadline, lease.registered, lease.compute_request,
                    lease.compute_limit, lease.devices, lease.parked_at,
                    json.dumps(lease.reach), lease.planned_by, json.dumps(lease.pod),
                    lease.frozen_at, lease.frozen_bytes, json.dumps(lease.frozen_on),
                    lease.fallback, json.dumps(lease.waits_for), lease.created, lease.updated,
                ),
            )
            self.leases[lease.id] = lease
        return lease

    _COLUMNS = {
        "state": "state", "reason": "reason", "deadline": "deadline", "physical": "physical",
        "logical": "logical", "target": "target", "request": "request", "limit": "lim",
        "request_spec": "request_spec", "limit_spec": "limit_spec",
        "restore_until": "restore_until", "orphan_deadline": "orphan_deadline",
        "compute_request": "compute_request", "compute_limit": "compute_limit",
        "registered": "registered", "parked_at": "parked_at", "pod": "pod",
        "frozen_at": "frozen_at", "frozen_bytes": "frozen_bytes", "frozen_on": "frozen_on",
        "fallback": "fallback", "waits_for": "waits_for",
    }

    def update(self, lease_id: str, **changes: Any) -> Lease:
        """Change stored fields of a lease (see ``_COLUMNS``); stamps ``updated``."""
        unknown = set(changes) - set(self._COLUMNS)
        if unknown:
            raise KeyError(f"not a stored lease field: {sorted(unknown)}")
        now = time.time()
        values = {
            self._COLUMNS[k]: json.dumps(v) if isinstance(v, tuple) else v
            for k, v in changes.items()
        }
        values["updated"] = now
        with self.transaction():
            sets = ", ".join(f"{col} = ?" for col in values)
            self._db.execute(
                f"UPDATE leases SET {sets} WHERE id = ?", [*values.values(), lease_id]
            )
            lease = replace(self.leases[lease_id], **changes, updated=now)
            self.leases[lease_id] = lease
        return lease

    def delete(self, lease_id: str) -> None:
        with self.transaction():
            self._db.execute("DELETE FROM leases WHERE id = ?", (lease_id,))
            self._db.execute("DELETE FROM pids WHERE lease_id = ?", (lease_id,))
            self._db.execute("DELETE FROM kills WHERE lease_id = ?", (lease_id,))
            self.leases.pop(lease_id, None)

    def set_pids(self, lease_id: str, pids: tuple[tuple[int, int], ...]) -> Lease:
        with self.transaction():
            self._db.execute("DELETE FROM pids WHERE lease_id = ?", (lease_id,))
            self._db.executemany(
                "INSERT INTO pids (lease_id, pid, start_time) VALUES (?,?,?)",
                [(lease_id, pid, start) for pid, start in pids],
            )
            lease = replace(self.leases[lease_id], pids=pids)
            self.leases[lease_id] = lease
        return lease

    def set_usage(self, lease_id: str, usage: int, compute: int | None = None) -> None:
        """Measured usage lives in memory only: it is re-measured after a restart."""
        lease = self.leases.get(lease_id)
        if lease is not None and (lease.usage, lease.compute_usage) != (usage, compute):
            self.leases[lease_id] = replace(lease, usage=usage, compute_usage=compute)

    def add_kill(self, lease_id: str, at: float, cause: str) -> None:
        """Remember a kill: counting them must survive an agent restart."""
        with self.transaction():
            self._db.execute("INSERT INTO kills (lease_id, at, cause) VALUES (?,?,?)",
                             (lease_id, at, cause))

    def add_directive(self, lease: Lease, kind: str, body: dict[str, Any]) -> Directive:
        """Write a directive; the lease's superseded ones, its oldest past the bound and any
        past the TTL go in the same transaction (on a rollback memory is reloaded)."""
        now = time.time()
        with self.transaction():
            cursor = self._db.execute(
                "INSERT INTO directives (client, lease_id, owner_uid, kind, body, created)"
                " VALUES (?,?,?,?,?,?)",
                (lease.client, lease.id, lease.owner_uid, kind, json.dumps(body), now),
            )
            d = Directive(int(cursor.lastrowid or 0), lease.client, lease.id, lease.owner_uid,
                          kind, body, now)
            gone = self._keep(d) + self._expire(now)
            self._db.executemany("DELETE FROM directives WHERE seq = ?", [(old.seq,) for old in gone])
            self._last_seq = max(self._last_seq, d.seq)
        return d


def _seq(d: Directive) -> int:
    return d.seq


def _remove(queue: list[Directive], d: Directive) -> None:
    """Remove ``d`` from a list in seq order, found by bisection."""
    i = bisect_left(queue, d.seq, key=_seq)
    if i < len(queue) and queue[i] is d:
        del queue[i]
