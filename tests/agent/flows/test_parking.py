"""Parked notebook leases against a real agent: no GPU held, nothing measured, placed again on
the next cell (at once, or by the agent when room appears), and only by their owner."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families
from unix_users import as_user

from harness.agent import AgentProcess, wait_for
from node_agent.client import AgentClient, AgentError
from node_agent.quantities import GiB

from ..conftest import Holder

NOBODY = 65534
EVERY_KIND = ("migrate", "shrink", "killed", "park", "resized", "bursting", "unparked")


def _heard(c: AgentClient, cursor: int, client: str = "srv",
           kinds: tuple[str, ...] = EVERY_KIND) -> list[dict[str, Any]]:
    return c.directives(client=client, after=cursor, timeout=0, kinds=kinds)[0]


def _metric(c: AgentClient, name: str, **labels: str) -> float:
    [value] = [s.value for f in text_string_to_metric_families(c.metrics()) for s in f.samples
               if s.name == name and s.labels.items() >= labels.items()]
    return value


def _refused(call: Callable[[], Any]) -> AgentError:
    with pytest.raises(AgentError) as err:
        call()
    return err.value


def test_a_parked_lease_frees_its_memory_at_once_for_a_job_and_is_never_moved(
    start_agent: Callable[..., AgentProcess],
) -> None:
    c = start_agent(spec="2x4GiB").client()
    gpu0, gpu1 = (g["uuid"] for g in c.node()["gpus"])
    a = c.create_lease(client="srv", request="3Gi", kernel_id="ka")
    b = c.create_lease(client="srv", request="3Gi", kernel_id="kb")
    assert (a["physical_gpu"], b["physical_gpu"]) == (gpu0, gpu1)
    _, cursor = c.directives(client="srv", after=-1, timeout=0)

    parked = c.park(a["id"], reason="idle for 10 minutes")
    assert parked["state"] == "parked" and parked["reason"] == "idle for 10 minutes"
    assert parked["physical_gpus"] == parked["logical_gpus"] == parked["target_gpus"] == []
    assert parked["usage"] == 0 and parked["deadline"] is None and parked["parked_at"]
    assert (parked["request"], parked["limit"], parked["devices"]) == (3 * GiB, 3 * GiB, 1)
    # The whole GPU is the job's at once: nobody moves, nothing waits.
    job = c.create_lease(client="run", kind="job")
    assert (job["state"], job["physical_gpu"]) == ("active", gpu0)
    assert [s["lease"] for s in c.node()["gpus"][0]["shares"]] == [job["id"]]
    assert _heard(c, cursor) == []
    # Parking again changes nothing (a tick may still stamp its orphan deadline: no process).
    again = c.park(a["id"])
    assert (again["state"], again["parked_at"], again["reason"]) == (
        "parked", parked["parked_at"], parked["reason"])
    # A job is never parked.
    err = _refused(lambda: c.park(job["id"]))
    assert (err.status, err.field) == (409, "lease") and "only notebook" in err.message


def test_parking_lets_a_waiting_lease_run_at_once(
    start_agent: Callable[..., AgentProcess],
) -> None:
    c = start_agent(spec="1x4GiB").client()
    b = c.create_lease(client="srv", request="3Gi")
    c.park(b["id"])
    a = c.create_lease(client="srv", request="3Gi")
    assert c.unpark(b["id"])["state"] == "pending"
    _, cursor = c.directives(client="srv", after=-1, timeout=0)
    c.park(a["id"])
    # No tick needed: parking runs the same activation as a release.
    running = c.lease(b["id"])
    assert running["state"] == "active" and running["physical_gpus"] == [a["physical_gpu"]]
    assert [(d["kind"], d["lease_id"]) for d in _heard(c, cursor)] == [("unparked", b["id"])]


def test_a_parked_lease_is_not_measured_shrunk_or_killed(
    start_agent: Callable[..., AgentProcess], holders: Callable[..., Holder],
) -> None:
    # Limits enforced and a short grace: a measured lease above its limit is killed quickly.
    agent = start_agent("--enforce-limits", "--reclaim-grace", "0.2")
    c = agent.client()
    lease = c.create_lease(client="srv", request="0.25", limit="0.5")
    kernel = holders(CUDA_VISIBLE_DEVICES=lease["physical_gpu"])
    c.register_pid(lease["id"], kernel.pid)
    kernel.hold(100)
    wait_for(lambda: c.lease(lease["id"])["usage"] > 90 * 2**20, 10, "the kernel measured")
    _, cursor = c.directives(client="srv", after=-1, timeout=0)

    c.park(lease["id"])
    # The same process goes on (its variables in host memory), and a new one registers.
    kernel.hold(500)
    restarted = holders()
    restarted.hold(600)
    parked = c.register_pid(lease["id"], restarted.pid)
    assert parked["state"] == "parked" and sorted(parked["pids"]) == sorted(
        [kernel.pid, restarted.pid])
    time.sleep(1.0)  # twenty polls
    seen = c.lease(lease["id"])
    assert (seen["state"], seen["usage"], seen["physical_gpus"]) == ("parked", 0, [])
    assert all(g["memory_used"] == 0 for g in c.node()["gpus"])
    assert kernel.alive() and restarted.alive()
    assert _heard(c, cursor) == []
    # What the kernel reports is not kept either.
    c.report_usage(lease["id"], 900 * 2**20)
    time.sleep(0.3)
    assert c.lease(lease["id"])["usage"] == 0


def test_a_parked_lease_survives_an_agent_restart_and_shows_in_status(
    start_agent: Callable[..., AgentProcess], holders: Callable[..., Holder],
) -> None:
    agent = start_agent(spec="2x4GiB")
    c = agent.client()
    lease = c.create_lease(client="srv", request="1Gi", limit="2Gi", kernel_id="k")
    c.register_pid(lease["id"], holders().pid)
    parked = c.park(lease["id"])
    agent.stop()
    agent.start()
    c = agent.client()
    again = c.lease(lease["id"])
    for key in ("state", "physical_gpus", "logical_gpus", "request", "limit", "parked_at",
                "pids", "devices", "reason"):
        assert again[key] == parked[key], key
    run = [sys.executable, "-m", "node_agent", "--socket", agent.socket, "status"]
    doc = json.loads(subprocess.run([*run, "--json"], capture_output=True, text=True,
                                    check=True).stdout)
    [shown] = doc["leases"]
    assert (shown["state"], shown["physical_gpus"], shown["physical_gpu"], shown["request"]) == (
        "parked", [], None, GiB)
    table = subprocess.run(run, capture_output=True, text=True, check=True).stdout
    assert "parked, needs 1.0 GiB" in table, table
    # Placed again by the restarted agent.
    assert c.unpark(lease["id"])["state"] == "active"


def test_unpark_with_room_runs_at_once_maybe_on_another_gpu_and_tells_the_client(
    start_agent: Callable[..., AgentProcess], holders: Callable[..., Holder],
) -> None:
    c = start_agent(spec="2x4GiB").client()
    gpu0, gpu1 = (g["uuid"] for g in c.node()["gpus"])
    a = c.create_lease(client="srv", request="1Gi", limit="2Gi", kernel_id="ka")
    assert a["physical_gpu"] == gpu0
    c.park(a["id"])
    c.create_lease(client="other", request="3Gi")  # the GPU it left
    kernel = holders()
    c.register_pid(a["id"], kernel.pid)
    kernel.hold(200)  # host memory while parked: not device memory once it has a GPU either
    _, cursor = c.directives(client="srv", after=-1, timeout=0)

    back = c.unpark(a["id"])
    # Spread, as a new notebook: planned beside the 3 GiB lease, run on the empty GPU.
    assert (back["state"], back["logical_gpu"], back["physical_gpus"]) == ("active", gpu0, [gpu1])
    assert back["parked_at"] is None and back["restore_until"] > time.time()
    assert "unparked" in back["reason"]
    # The notice reaches the server only when it asks for it by kind.
    assert c.directives(client="srv", after=cursor, timeout=0)[0] == []
    [notice] = _heard(c, cursor)
    assert (notice["kind"], notice["lease_id"], notice["kernel_id"]) == ("unparked", a["id"], "ka")
    assert (notice["gpu"], notice["gpus"], notice["request"], notice["limit"]) == (
        gpu1, [gpu1], GiB, 2 * GiB)
    # Its process is followed on its new GPU from now on: what it allocates there counts.
    kernel.hold(50)
    wait_for(lambda: 0 < c.lease(a["id"])["usage"] < 200 * 2**20, 10, "usage on the new GPU")
    # An unpark of a running lease changes nothing.
    same = c.unpark(a["id"])
    assert (same["state"], same["physical_gpus"], same["reason"], same["restore_until"]) == (
        "active", [gpu1], back["reason"], back["restore_until"])
    assert [d["kind"] for d in _heard(c, cursor)] == ["unparked"]
    assert _metric(c, "gpufrac_unparks_total", how="at_once") == 1
    assert _metric(c, "gpufrac_parks_total") == 1


def test_unpark_without_room_waits_saying_why_then_runs_when_the_job_ends(
    start_agent: Callable[..., AgentProcess],
) -> None:
    c = start_agent(spec="2x4GiB").client()
    gpu0 = c.node()["gpus"][0]["uuid"]
    a = c.create_lease(client="srv", request="3Gi", kernel_id="ka")
    c.park(a["id"])
    job = c.create_lease(client="run", kind="job", devices=2, name="python train.py")
    _, cursor = c.directives(client="srv", after=-1, timeout=0)

    waiting = c.unpark(a["id"])
    assert (waiting["state"], waiting["physical_gpus"]) == ("pending", [])
    assert waiting["reason"] == (
        "waiting for a GPU: no GPU has 3.0 GiB free for its request: GPU 0 is held whole by "
        f'job "python train.py" ({job["id"]}), GPU 1 is held whole by job "python train.py" '
        f'({job["id"]})')
    again = c.unpark(a["id"])
    assert (again["state"], again["reason"]) == ("pending", waiting["reason"]), "nothing new"
    time.sleep(0.3)
    assert c.lease(a["id"])["state"] == "pending"
    assert _metric(c, "gpufrac_unpark_waits_total") == 1
    assert _metric(c, "gpufrac_lease_state", lease=a["id"], gpufrac_lease_state="pending") == 1

    c.release(job["id"])
    running = c.lease(a["id"])
    assert (running["state"], running["physical_gpus"]) == ("active", [gpu0])
    assert "once room appeared" in running["reason"]
    [notice] = _heard(c, cursor)
    assert (notice["kind"], notice["gpu"], notice["request"]) == ("unparked", gpu0, 3 * GiB)
    assert _metric(c, "gpufrac_unparks_total", how="after_wait") == 1
    # What the cell waited: from its ask to the GPU, the 0.3 s above and more.
    assert _metric(c, "gpufrac_unpark_duration_seconds_count") == 1
    assert _metric(c, "gpufrac_unpark_duration_seconds_sum") >= 0.3
    assert _metric(c, "gpufrac_unpark_duration_seconds_bucket", le="0.1") == 0


def test_a_waiting_lease_parked_again_stops_waiting(
    start_agent: Callable[..., AgentProcess],
) -> None:
    c = start_agent(spec="1x4GiB").client()
    a = c.create_lease(client="srv", request="3Gi")
    c.park(a["id"])
    job = c.create_lease(client="run", kind="job")
    assert c.unpark(a["id"])["state"] == "pending"
    _, cursor = c.directives(client="srv", after=-1, timeout=0)
    cancelled = c.park(a["id"], reason="the user stopped waiting for a GPU")
    assert (cancelled["state"], cancelled["physical_gpus"]) == ("parked", [])
    c.release(job["id"])
    time.sleep(0.3)
    assert c.lease(a["id"])["state"] == "parked", "no GPU is taken for a wait called off"
    assert _heard(c, cursor) == []
    assert _metric(c, "gpufrac_lease_state", lease=a["id"], gpufrac_lease_state="parked") == 1


def test_unpark_that_needs_notebooks_to_move_runs_once_they_have(
    start_agent: Callable[..., AgentProcess],
) -> None:
    c = start_agent(spec="2x4GiB").client()
    gpu0, gpu1 = (g["uuid"] for g in c.node()["gpus"])
    a = c.create_lease(client="srv", request="1")  # a whole GPU, not burstable
    c.park(a["id"])
    c.create_lease(client="nb", request="2Gi", limit="4Gi")
    spread = c.create_lease(client="nb", request="2Gi", limit="4Gi")
    assert (spread["logical_gpu"], spread["physical_gpu"]) == (gpu0, gpu1)
    _, cursor = c.directives(client="srv", after=-1, timeout=0)

    waiting = c.unpark(a["id"])
    assert (waiting["state"], waiting["physical_gpus"]) == ("pending", [gpu1])
    assert "waiting for 1 notebook(s) to move" in waiting["reason"]
    [move] = _heard(c, cursor, client="nb")
    assert (move["kind"], move["lease_id"], move["to_gpu"]) == ("migrate", spread["id"], gpu0)
    assert _heard(c, cursor) == []
    c.migrated(spread["id"])
    assert c.lease(a["id"])["state"] == "active"
    assert [(d["kind"], d["gpu"]) for d in _heard(c, cursor)] == [("unparked", gpu1)]


def test_park_request_asks_only_the_leases_own_client_and_only_when_it_asks(
    start_agent: Callable[..., AgentProcess],
) -> None:
    c = start_agent().client()
    a = c.create_lease(client="srv-a", request="0.25", kernel_id="ka")
    c.create_lease(client="srv-b", request="0.25")
    _, cursor = c.directives(client="srv-a", after=-1, timeout=0)

    asked = c.park_request(a["id"])
    assert asked["state"] == "active", "the agent only asks; the server parks"
    # A server that does not name `park` (and the kernel's own long-poll) never hears of it.
    assert c.directives(client="srv-a", after=cursor, timeout=0)[0] == []
    assert c.directives(lease=a["id"], after=cursor, timeout=0)[0] == []
    assert _heard(c, cursor, client="srv-b") == []
    [park] = _heard(c, cursor, client="srv-a", kinds=("migrate", "shrink", "killed", "park",
                                                       "unparked"))
    assert (park["kind"], park["lease_id"], park["kernel_id"]) == ("park", a["id"], "ka")
    assert (park["gpu"], park["request"]) == (a["physical_gpu"], a["request"])
    assert "%gpu park" in park["reason"]
    c.park(a["id"])
    err = _refused(lambda: c.park_request(a["id"]))
    assert (err.status, err.field) == (409, "lease") and "parked already" in err.message


def test_a_lease_on_the_move_or_killed_is_not_parked(
    start_agent: Callable[..., AgentProcess],
) -> None:
    c = start_agent("--migrate-grace", "3").client()
    moving = c.create_lease(client="srv", request="0.25", limit="0.5")
    c.create_lease(client="run", kind="job", request="0.5")
    assert c.resize(moving["id"], request="0.75")["state"] == "migrating"
    for call in (lambda: c.park(moving["id"]), lambda: c.park_request(moving["id"])):
        err = _refused(call)
        assert (err.status, err.field) == (409, "lease")
        assert "migrating" in err.message and "move is under way" in err.message
    assert c.lease(moving["id"])["state"] == "migrating", "nothing half-applied"
    wait_for(lambda: c.lease(moving["id"])["state"] == "killed", 10, "the move to time out")
    for call in (lambda: c.park(moving["id"]), lambda: c.park_request(moving["id"])):
        err = _refused(call)
        assert (err.status, err.field) == (409, "lease") and "killed" in err.message
    assert c.unpark(moving["id"])["state"] == "killed", "an unpark changes only a parked lease"


def test_bad_ids_and_bodies_name_the_field_and_change_nothing(
    start_agent: Callable[..., AgentProcess],
) -> None:
    c = start_agent().client()
    lease = c.create_lease(client="srv", request="0.25")
    bad_ids = ("/v1/leases/l%20x/park", "/v1/leases/" + "a" * 65 + "/unpark",
               "/v1/leases/l.x/park-request", "/v1/leases/l%2Fx")
    bad_bodies = (
        ("park", {"reason": 7}, "reason"), ("park", {"reason": ""}, "reason"),
        ("park", {"reason": "x" * 201}, "reason"), ("park", {"why": "idle"}, "why"),
        ("park", {"uid": 0}, "uid"), ("unpark", {"gpu": "GPU-0"}, "gpu"),
        ("park-request", {"now": True}, "now"),
    )
    asked = [(path, {}, "lease") for path in bad_ids] + [
        (f"/v1/leases/{lease['id']}/{action}", body, field) for action, body, field in bad_bodies]
    for path, body, field in asked:
        with pytest.raises(AgentError) as err:
            c.request("POST", path, body)
        assert (err.value.status, err.value.field) == (400, field), (path, body)
    assert c.lease(lease["id"])["state"] == "active"
    assert c.directives(client="srv", after=0, timeout=0, kinds=EVERY_KIND)[0] == []
    err = _refused(lambda: c.unpark("l-000000000000"))
    assert (err.status, err.field) == (404, "lease")


def test_only_the_owner_or_an_admin_parks_and_unparks(
    start_agent: Callable[..., AgentProcess],
) -> None:
    agent = start_agent(spec="1x4GiB")
    root = agent.client()
    mine = root.create_lease(client="root", request="1Gi")
    theirs = as_user(NOBODY, lambda: agent.client().create_lease(client="nobody",
                                                                   request="2Gi"))["ok"]
    for action in (lambda: agent.client().park(mine["id"]),
                   lambda: agent.client().park_request(mine["id"]),
                   lambda: agent.client().unpark(mine["id"])):
        denied = as_user(NOBODY, action)
        assert (denied["status"], denied["field"]) == (404, "lease"), denied
    assert root.lease(mine["id"])["state"] == "active"
    assert root.directives(client="root", after=0, timeout=0, kinds=EVERY_KIND)[0] == []
    # The owner parks its own; root, an admin, parks anyone's.
    assert as_user(NOBODY, lambda: agent.client().park(theirs["id"]))["ok"]["state"] == "parked"
    root.park(mine["id"])
    denied = as_user(NOBODY, lambda: agent.client().unpark(mine["id"]))
    assert denied["status"] == 404 and root.lease(mine["id"])["state"] == "parked"
    # Waiting behind someone else's job, a user learns why but not whose job it is.
    job = root.create_lease(client="run", kind="job", name="secret-experiment")
    waiting = as_user(NOBODY, lambda: agent.client().unpark(theirs["id"]))["ok"]
    assert waiting["state"] == "pending"
    assert "GPU 0 is held whole by another user's job" in waiting["reason"]
    assert job["id"] not in waiting["reason"] and "secret" not in waiting["reason"]


def test_a_parked_lease_whose_kernel_died_is_released_after_the_orphan_grace(
    start_agent: Callable[..., AgentProcess], holders: Callable[..., Holder],
) -> None:
    c = start_agent("--orphan-grace", "0.3").client()
    lease = c.create_lease(client="srv", request="0.25")
    kernel = holders()
    c.register_pid(lease["id"], kernel.pid)
    c.park(lease["id"])
    time.sleep(0.5)
    assert c.lease(lease["id"])["state"] == "parked", "a live kernel keeps it"
    kernel.stop()
    wait_for(lambda: all(x["id"] != lease["id"] for x in c.leases()), 10, "the orphan released")
