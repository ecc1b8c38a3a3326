"""The ledger: durable, atomic, and the only writer of state."""

from __future__ import annotations

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
