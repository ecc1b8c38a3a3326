"""The ledger: durable, atomic, and the only writer of state."""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path

import pytest

from node_agent.ledger import Lease, Ledger


def _lease(lease_id: str = "l-1") -> Lease:
    now = time.time()
    return Lease(id=lease_id, kind="notebook", owner_uid=1000, client="c", request=1, limit=2,
                 request_spec="1", limit_spec="2", logical=("GPU-a",), physical=("GPU-b",),
                 state="active", created=now, updated=now)


def test_survives_reopen(tmp_path: Path) -> None:
    ledger = Ledger(tmp_path)
    ledger.insert(_lease())
    ledger.set_pids("l-1", ((42, 7),))
    ledger.update("l-1", state="migrating", target=("GPU-a",), deadline=5.0, reason="why")
    ledger.add_directive(ledger.leases["l-1"], "migrate", {"to_gpu": "GPU-a"})
    ledger.close()
    again = Ledger(tmp_path)
    lease = again.leases["l-1"]
    assert (lease.state, lease.target, lease.pids, lease.deadline) == (
        "migrating", ("GPU-a",), ((42, 7),), 5.0)
    [d] = again.directives_after(0, client="c")
    assert d.kind == "migrate" and d.body == {"to_gpu": "GPU-a"} and again.last_seq() == d.seq
    assert again.directives_after(0, client="other") == []


def test_a_failed_change_leaves_nothing_behind(tmp_path: Path) -> None:
    ledger = Ledger(tmp_path)
    ledger.insert(_lease())
    with pytest.raises(RuntimeError), ledger.transaction():
        ledger.update("l-1", state="killed")
        ledger.insert(_lease("l-2"))
        raise RuntimeError("crash between two writes")
    assert ledger.leases["l-1"].state == "active" and "l-2" not in ledger.leases
    ledger.close()
    assert set(Ledger(tmp_path).leases) == {"l-1"}


def test_unknown_fields_refused(tmp_path: Path) -> None:
    ledger = Ledger(tmp_path)
    ledger.insert(_lease())
    with pytest.raises(KeyError, match="owner_uid"):
        ledger.update("l-1", owner_uid=0)


def test_kill_times_and_deadlines_survive_reopen(tmp_path: Path) -> None:
    ledger = Ledger(tmp_path)
    ledger.insert(_lease())
    ledger.update("l-1", restore_until=7.0, orphan_deadline=8.0, registered=1.0)
    ledger.add_kill("l-1", 2.0, "reclaim")
    ledger.add_kill("l-1", 3.0, "migrate_timeout")
    ledger.close()
    again = Ledger(tmp_path)
    lease = again.leases["l-1"]
    assert (lease.restore_until, lease.orphan_deadline, lease.registered) == (7.0, 8.0, 1.0)
    assert again.kill_times("l-1") == [2.0, 3.0]
    assert again.kill_times("l-1", "reclaim") == [2.0]
    again.delete("l-1")
    assert again.kill_times("l-1") == []


def test_a_ledger_from_before_the_new_columns_opens(tmp_path: Path) -> None:
    with sqlite3.connect(tmp_path / "ledger.sqlite3") as db:
        db.execute(
            "CREATE TABLE leases (id TEXT PRIMARY KEY, kind TEXT NOT NULL, owner_uid INTEGER NOT"
            " NULL, client TEXT NOT NULL, kernel_id TEXT, name TEXT NOT NULL DEFAULT '', request"
            " INTEGER NOT NULL, lim INTEGER NOT NULL, request_spec TEXT NOT NULL, limit_spec TEXT"
            " NOT NULL, logical TEXT NOT NULL, physical TEXT NOT NULL, target TEXT NOT NULL"
            " DEFAULT '[]', state TEXT NOT NULL, reason TEXT NOT NULL DEFAULT '', deadline REAL,"
            " created REAL NOT NULL, updated REAL NOT NULL)"
        )
        db.execute("INSERT INTO leases (id, kind, owner_uid, client, request, lim, request_spec,"
                   " limit_spec, logical, physical, state, created, updated) VALUES ('l-old',"
                   " 'notebook', 1000, 'c', 1, 2, '1', '2', '[\"GPU-a\"]', '[\"GPU-a\"]',"
                   " 'active', 1.0, 1.0)")
    ledger = Ledger(tmp_path)
    assert ledger.leases["l-old"].orphan_deadline is None
    # It ran on as many GPUs as it was planned on, and was never parked.
    assert (ledger.leases["l-old"].devices, ledger.leases["l-old"].parked_at) == (1, None)
    assert ledger.update("l-old", orphan_deadline=9.0).orphan_deadline == 9.0
    ledger.update("l-old", state="parked", logical=(), physical=(), parked_at=5.0)
    ledger.close()
    again = Ledger(tmp_path).leases["l-old"]
    assert again.orphan_deadline == 9.0
    assert (again.state, again.logical, again.devices, again.parked_at) == ("parked", (), 1, 5.0)
