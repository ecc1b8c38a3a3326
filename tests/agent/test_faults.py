"""SIGKILL the agent at random moments during lease churn and compaction; the ledger holds."""

from __future__ import annotations

import os
import random
import sqlite3
import threading
import time
from collections.abc import Callable

from harness.agent import AgentProcess, wait_for
from node_agent.client import AgentClient, AgentError, AgentUnavailable

from .conftest import Holder

GiB = 2**30


class Churn:
    """Creates, registers, releases and compacts, tolerating an agent that vanishes."""

    def __init__(self, client: AgentClient, holders: Callable[..., Holder], seed: int) -> None:
        self.c = client
        self.holders = holders
        self.rnd = random.Random(seed)
        self.known: dict[str, Holder | None] = {}  # acknowledged leases -> registered process
        self.released: set[str] = set()
        self.stop = threading.Event()
        self.errors: list[BaseException] = []
        self.ops = 0
        self.moves = 0

    def step(self) -> None:
        # At most three small notebooks: all bin-pack onto GPU 0, so GPU 1 is logically free
        # for a job while spread notebooks sit there physically, and compaction must move them.
        op = self.rnd.random()
        if len(self.known) < 3 and op < 0.5:
            lease = self.c.create_lease(client="churn", request=self.rnd.choice(["0.25", "0.125"]),
                                        limit="1")
            self.known[lease["id"]] = None
            h = self.holders()
            self.c.register_pid(lease["id"], h.pid)
            self.known[lease["id"]] = h
        elif op < 0.7 and self.known:
            lease_id = self.rnd.choice(sorted(self.known))
            self.released.add(lease_id)
            self.known.pop(lease_id)
            self.c.release(lease_id)
        else:
            self.compact()

    def compact(self) -> None:
        # A job whose release (or whose creation's reply) was lost to a kill still holds its
        # GPU; a real `gpufrac-agent run` would be gone and its lease orphaned. Clear them.
        # Likewise a notebook whose creation's reply was lost: no kernel will ever use it.
        for lease in self.c.leases():
            if lease["kind"] == "job" or lease["id"] not in self.known:
                self.c.release(lease["id"])
        try:
            job = self.c.create_lease(client="churn-job", kind="job", request="1")
        except AgentError as exc:
            if exc.status == 409:  # no whole GPU free logically: fine
                return
            raise
        for lease in self.c.leases():
            if lease["state"] == "migrating":
                self.c.migrated(lease["id"])
                self.moves += 1
        self.c.release(job["id"])

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                self.step()
                self.ops += 1
            except AgentUnavailable:
                self.stop.wait(0.02)
            except AgentError as exc:
                # 409: the node is full. 404: a reply lost to a kill left us acting on a
                # lease that the ledger (rightly) no longer has.
                if exc.status not in (404, 409):
                    self.errors.append(exc)
                self.ops += 1
            except BaseException as exc:
                self.errors.append(exc)
                return


def check_ledger(agent: AgentProcess) -> None:
    db = sqlite3.connect(os.path.join(agent.state_dir, "ledger.sqlite3"))
    try:
        assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        orphans = db.execute(
            "SELECT COUNT(*) FROM pids WHERE lease_id NOT IN (SELECT id FROM leases)").fetchone()[0]
        assert orphans == 0
    finally:
        db.close()


def check_guarantees(c: AgentClient) -> None:
    totals = {g["uuid"]: g["memory_total"] for g in c.node()["gpus"]}
    logical: dict[str, int] = {}
    physical: dict[str, int] = {}
    leases = c.leases()
    said = [(x["id"], x["kind"], x["state"], x["logical_gpus"], x["request"], x["reason"])
            for x in leases]
    for lease in leases:
        assert lease["state"] in ("pending", "active", "migrating", "shrinking", "freezing",
                                  "thawing", "killed")
        # A job placed by freezing plans its GPU whole: the notebooks being frozen for it
        # leave the plan once frozen (they thaw when it ends).
        for u in lease["logical_gpus"] if lease["state"] != "freezing" else ():
            logical[u] = logical.get(u, 0) + lease["request"]
        if lease["state"] == "pending":
            continue
        where = lease["target_gpus"] if lease["state"] == "migrating" else lease["physical_gpus"]
        assert where, lease
        for u in where:
            physical[u] = physical.get(u, 0) + lease["request"]
    for u, total in totals.items():
        assert logical.get(u, 0) <= total, f"logical plan over capacity on {u}: {said}"
        assert physical.get(u, 0) <= total, f"guarantees over capacity on {u}"


def test_sigkill_during_churn_and_compaction(
    start_agent: Callable[..., AgentProcess], holders: Callable[..., Holder]
) -> None:
    agent = start_agent("--orphan-grace", "600", "--migrate-grace", "600")
    rnd = random.Random(20261121)
    churn = Churn(agent.client(timeout=2), holders, seed=7)
    thread = threading.Thread(target=churn.run, daemon=True)
    thread.start()
    kills = 0
    # Eight kills, and more (up to 20) until compaction has moved a notebook at least once:
    # on a loaded machine all of the first eight can fall between compactions.
    while kills < 8 or (churn.moves < 1 and kills < 20):
        # Let some work through, then kill at a random moment.
        target = churn.ops + rnd.randint(2, 6)
        wait_for(lambda t=target: churn.ops >= t or churn.errors, timeout=30, what="churn progress")
        threading.Event().wait(rnd.uniform(0.0, 0.05))
        agent.kill()
        kills += 1
        check_ledger(agent)
        agent.start()
        check_guarantees(agent.client())
    churn.stop.set()
    thread.join(timeout=30)
    assert not churn.errors, churn.errors
    assert churn.ops >= 8 and churn.moves >= 1, (churn.ops, churn.moves)

    c = agent.client()
    present = {x["id"]: x for x in c.leases()}
    # No acknowledged lease is lost; a registered live process is re-adopted.
    for lease_id, holder in churn.known.items():
        assert lease_id in present, f"lease {lease_id} lost"
        if holder is not None and holder.alive():
            assert holder.pid in present[lease_id]["pids"]
    check_guarantees(c)

    # Leases whose processes died while the agent was down are cleaned up after a restart.
    agent.kill()
    dead = [lid for lid, h in churn.known.items() if h is not None][:3]
    for lease_id in dead:
        h = churn.known[lease_id]
        assert h is not None
        h.stop()
    agent.args += ["--orphan-grace", "0.2"]
    agent.start()
    wait_for(lambda: not set(dead) & {x["id"] for x in c.leases()}, what="dead leases cleaned up")
    check_ledger(agent)


def test_an_orphan_deadline_outlives_agent_restarts(
    start_agent: Callable[..., AgentProcess], holders: Callable[..., Holder]
) -> None:
    agent = start_agent("--orphan-grace", "3")
    c = agent.client()
    lease = c.create_lease(client="c", request="0.25")
    h = holders()
    assert c.register_pid(lease["id"], h.pid)["orphan_deadline"] is None
    h.stop()
    deadline = wait_for(lambda: c.lease(lease["id"])["orphan_deadline"], what="orphan deadline")
    # Restarts closer together than the grace: a timer kept in memory would never run out.
    while time.time() < deadline + 0.5:
        agent.kill()
        agent.start()
        present = {x["id"]: x for x in c.leases()}
        if lease["id"] not in present:
            break
        assert present[lease["id"]]["orphan_deadline"] == deadline
    wait_for(lambda: lease["id"] not in {x["id"] for x in c.leases()}, timeout=2,
             what="the orphan released at its stored deadline")
    check_ledger(agent)
