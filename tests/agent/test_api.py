"""The agent's API against a real agent process on a temporary Unix socket."""

from __future__ import annotations

import json
import os
import socket
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families
from unix_users import as_user

from harness.agent import (
    AgentProcess,
    free_port,
    full_listen_queue,
    http_bytes,
    nvml_works,
    raw_request,
    wait_for,
)
from node_agent import procs
from node_agent.client import AgentClient, AgentError, AgentUnavailable
from node_agent.quantities import GiB

from .conftest import Holder

NOBODY = 65534


def test_lease_lifecycle(start_agent: Callable[..., AgentProcess], holders: Callable[..., Holder]) -> None:
    agent = start_agent()
    c = agent.client()
    node = c.node()
    assert node["simulated"] and node["backend"] == "simulated" and len(node["gpus"]) == 2
    lease = c.create_lease(client="t", request="0.25", limit="0.5", kernel_id="k1")
    assert lease["state"] == "active" and lease["owner_uid"] == os.getuid()
    assert lease["request"] == GiB // 4 and lease["limit"] == GiB // 2
    assert lease["request_spec"] == "0.25" and lease["kernel_id"] == "k1"
    h = holders()
    lease = c.register_pid(lease["id"], h.pid)
    assert lease["pids"] == [h.pid]
    other = c.create_lease(client="t", request="0.25")
    with pytest.raises(AgentError) as err:
        c.register_pid(other["id"], h.pid)
    assert (err.value.status, err.value.field) == (409, "pid") and lease["id"] in err.value.message
    c.release(other["id"])
    h.hold(100)
    got = wait_for(lambda: (x := c.lease(lease["id"]))["usage"] >= 100 * 2**20 and x, what="usage")
    assert got["bursting"] is False
    h.hold(200)
    assert wait_for(lambda: c.lease(lease["id"])["bursting"], what="bursting")
    assert [x["id"] for x in c.leases()] == [lease["id"]]
    # Metrics carry DCGM's GPU labels, so that dashboards join them with its own.
    from prometheus_client.parser import text_string_to_metric_families

    samples = [s for f in text_string_to_metric_families(c.metrics()) for s in f.samples]
    gpu = next(g for g in node["gpus"] if g["uuid"] == lease["physical_gpu"])
    dcgm = {"gpu": str(gpu["index"]), "UUID": gpu["uuid"], "modelName": gpu["name"]}
    [request] = [s for s in samples if s.name == "gpufrac_lease_request_bytes"]
    assert request.value == GiB // 4 and request.labels["hostname"]
    assert request.labels.items() >= {"lease": lease["id"], "kernel_id": "k1", "kind": "notebook",
                                      **dcgm}.items()
    assert any(s.name == "gpufrac_gpu_memory_total_bytes" and s.labels.items() >= dcgm.items()
               for s in samples)
    # The state is a state set of its own, not a label of the values (a new series each change).
    assert "state" not in request.labels
    states = {s.labels["gpufrac_lease_state"]: s.value for s in samples
              if s.name == "gpufrac_lease_state" and s.labels["lease"] == lease["id"]}
    assert states == {"pending": 0, "active": 1, "migrating": 0, "shrinking": 0, "killed": 0,
                      "parked": 0, "freezing": 0, "thawing": 0}
    c.release(lease["id"])
    assert c.leases() == []
    with pytest.raises(AgentError) as err:
        c.lease(lease["id"])
    assert err.value.status == 404 and err.value.field == "lease"


@pytest.mark.parametrize(
    ("body", "status", "field", "words"),
    [
        ({"client": "t", "request": "abc"}, 400, "request", "expected a share of one GPU"),
        ({"client": "t", "request": "0.5", "limit": "0.25"}, 400, "limit", "at least the request"),
        ({"client": "t", "request": "2Gi"}, 400, "request", "more than one GPU holds"),
        ({"client": "t"}, 400, "request", "is required"),
        ({"request": "0.5"}, 400, "client", "is required"),
        ({"client": "t", "request": "0.5", "kind": "batch"}, 400, "kind", "one of"),
        ({"client": "t", "request": "0.5", "devices": 3}, 400, "devices", "1 to 2"),
        ({"client": "t", "request": "0.5", "devices": True}, 400, "devices", "whole number"),
        ({"client": "t", "request": "0.5", "uid": 0}, 400, "uid", "SO_PEERCRED"),
        ({"client": "t", "request": "0.5", "colour": "red"}, 400, "colour", "unknown field"),
    ],
)
def test_bad_requests_name_the_field(
    start_agent: Callable[..., AgentProcess], body: dict[str, Any], status: int, field: str, words: str
) -> None:
    c = start_agent().client()
    with pytest.raises(AgentError) as err:
        c.request("POST", "/v1/leases", body)
    assert (err.value.status, err.value.field) == (status, field)
    assert words in err.value.message
    assert c.leases() == [], "nothing half-applied"


def test_malformed_transport_and_full_node(start_agent: Callable[..., AgentProcess]) -> None:
    agent = start_agent()
    c = agent.client()
    for path, expected in (("/v1/nope", 404), ("/v1/directives?client=x&after=zz", 400)):
        with pytest.raises(AgentError) as err:
            c.request("GET", path)
        assert err.value.status == expected
    # Raw bytes that are not JSON.
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(agent.socket)
        s.sendall(b"POST /v1/leases HTTP/1.1\r\nHost: a\r\nContent-Length: 9\r\n"
                  b"Connection: close\r\n\r\n{not json")
        reply = b"".join(iter(lambda: s.recv(65536), b""))
    assert reply.startswith(b"HTTP/1.1 400") and b"expected a JSON object" in reply
    c.create_lease(client="t", request="1")
    c.create_lease(client="t", request="1")
    with pytest.raises(AgentError) as err:
        c.create_lease(client="t", request="0.5")
    assert err.value.status == 409 and err.value.field == "request"
    assert "no GPU has room" in err.value.message
    assert len(c.leases()) == 2
    assert c.node()["gpus"], "the agent still answers"


def test_unavailable_agent_says_what_to_do(tmp_path: Any) -> None:
    with pytest.raises(AgentUnavailable, match="gpufrac-agent serve"):
        AgentClient(str(tmp_path / "none.sock")).node()


def test_a_client_waits_out_a_full_listen_queue_then_says_the_agent_is_busy(
    tmp_path: Any,
) -> None:
    path = str(tmp_path / "busy.sock")
    with full_listen_queue(path):
        started = time.monotonic()
        with pytest.raises(AgentUnavailable, match="too busy: its listen queue stayed full"):
            AgentClient(path, timeout=1.0).node()
        # It kept trying for its timeout (with backoff) before it gave up.
        assert time.monotonic() - started >= 0.5


def test_resize_in_place_or_by_a_move(start_agent: Callable[..., AgentProcess]) -> None:
    c = start_agent().client()
    gpu0, gpu1 = (g["uuid"] for g in c.node()["gpus"])
    a = c.create_lease(client="t", request="0.25", limit="0.5")
    # Fits where it is: changed in place, nothing moves.
    a = c.resize(a["id"], request="0.5", limit="1")
    assert (a["request"], a["limit"], a["state"], a["physical_gpu"]) == (GiB // 2, GiB, "active", gpu0)
    assert a["reason"] == "request changed in place"
    with pytest.raises(AgentError) as err:
        c.resize(a["id"], request="0.75", limit="0.5")
    assert err.value.field == "limit"
    assert c.lease(a["id"])["request"] == GiB // 2, "a refused change changes nothing"
    job = c.create_lease(client="t", kind="job", request="0.5")
    assert job["physical_gpu"] == gpu0
    # No room next to the job: the notebook is sent to GPU 1 with its new request.
    _, cursor = c.directives(client="t", after=-1, timeout=0)
    a = c.resize(a["id"], request="0.75")
    assert (a["state"], a["target_gpus"], a["logical_gpu"]) == ("migrating", [gpu1], gpu1)
    found, _ = c.directives(client="t", after=cursor, timeout=5)
    assert [(d["kind"], d["cause"], d["to_gpu"]) for d in found] == [("migrate", "request_changed", gpu1)]
    a = c.migrated(a["id"])
    assert (a["state"], a["physical_gpu"]) == ("active", gpu1)
    assert c.resize(a["id"], request="1")["state"] == "active"
    # Nowhere to grow: refused, and nothing half-applied.
    d = c.create_lease(client="t", request="0.5")
    with pytest.raises(AgentError) as err:
        c.resize(d["id"], request="0.75")
    assert err.value.status == 409 and err.value.field == "request"
    assert c.lease(d["id"])["request"] == GiB // 2 and c.lease(d["id"])["state"] == "active"


def test_a_resize_that_stays_moves_only_the_others(start_agent: Callable[..., AgentProcess]) -> None:
    """Growing where it runs by moving a neighbour away: the neighbour is told to move, the
    lease itself is never sent a move onto its own GPU (and so never killed at its deadline)."""
    c = start_agent().client()
    gpu0, gpu1 = (g["uuid"] for g in c.node()["gpus"])
    c.create_lease(client="t", request="0.5")
    grows = c.create_lease(client="t", request="0.25", limit="1")
    neighbour = c.create_lease(client="t", request="0.25", limit="1")
    assert grows["physical_gpu"] == neighbour["physical_gpu"] == gpu1
    _, cursor = c.directives(client="t", after=-1, timeout=0)
    grown = c.resize(grows["id"], request="1")
    assert (grown["state"], grown["physical_gpu"], grown["request"]) == ("active", gpu1, GiB)
    assert "1 other lease(s) move to make room" in grown["reason"]
    found, _ = c.directives(client="t", after=cursor, timeout=1)
    assert [(d["lease_id"], d["kind"], d["to_gpu"]) for d in found] == [
        (neighbour["id"], "migrate", gpu0)]


def test_users_see_only_their_own_leases(
    start_agent: Callable[..., AgentProcess], holders: Callable[..., Holder]
) -> None:
    agent = start_agent()
    root = agent.client()
    mine = root.create_lease(client="root", request="0.25")
    theirs = as_user(NOBODY, lambda: agent.client().create_lease(client="nobody", request="0.25"))
    assert theirs["ok"]["owner_uid"] == NOBODY
    their_id = theirs["ok"]["id"]
    # nobody sees only its own lease, and cannot read, change or release root's.
    assert [x["id"] for x in as_user(NOBODY, lambda: agent.client().leases())["ok"]] == [their_id]
    for action in (
        lambda: agent.client().lease(mine["id"]),
        lambda: agent.client().release(mine["id"]),
        lambda: agent.client().resize(mine["id"], request="0.5"),
        lambda: agent.client().directives(lease=mine["id"], timeout=0),
    ):
        denied = as_user(NOBODY, action)
        assert denied["status"] == 404 and denied["field"] == "lease"
    assert root.lease(mine["id"])["request_spec"] == "0.25"
    # root is an admin and sees both.
    assert {x["id"] for x in root.leases()} == {mine["id"], their_id}
    # Metrics show others' leases only to admins; every GPU to everyone.
    seen = as_user(NOBODY, lambda: agent.client().metrics())["ok"]
    assert mine["id"] not in seen and f'lease="{their_id}"' in seen
    assert seen.count("gpufrac_gpu_healthy{") == 2
    assert mine["id"] in root.metrics()
    # The node shows every share on each GPU, others' without lease id or owner.
    shares = [s for g in as_user(NOBODY, lambda: agent.client().node())["ok"]["gpus"]
              for s in g["shares"]]
    assert sorted(str(s["lease"]) for s in shares) == sorted([their_id, "None"])
    assert all(set(s) == {"lease", "kind", "request", "usage", "state"} for s in shares)
    assert {s["lease"] for g in root.node()["gpus"] for s in g["shares"]} == {mine["id"], their_id}


def test_pid_registration_rules(
    start_agent: Callable[..., AgentProcess], holders: Callable[..., Holder]
) -> None:
    agent = start_agent()
    theirs = as_user(NOBODY, lambda: agent.client().create_lease(client="nobody", request="0.25"))
    lease_id = theirs["ok"]["id"]
    root_process = holders()
    # Spoofing: nobody names root's process, with or without a uid in the body.
    spoof = as_user(NOBODY, lambda: agent.client().register_pid(lease_id, root_process.pid))
    assert spoof["status"] == 403 and spoof["field"] == "pid"
    spoof = as_user(NOBODY, lambda: agent.client().request(
        "POST", f"/v1/leases/{lease_id}/pids", {"pid": root_process.pid, "uid": 0}))
    assert spoof["status"] == 400 and spoof["field"] == "uid"
    gone = as_user(NOBODY, lambda: agent.client().register_pid(lease_id, 2**22 + 7))
    assert gone["status"] == 400 and "no running process" in gone["message"]
    # Its own process is fine.
    own = subprocess.Popen(["sleep", "60"], user=NOBODY)
    try:
        ok = as_user(NOBODY, lambda: agent.client().register_pid(lease_id, own.pid))
        assert ok["ok"]["pids"] == [own.pid]
    finally:
        own.kill()
        own.wait()


def test_pid_reuse_is_never_killed(
    start_agent: Callable[..., AgentProcess], holders: Callable[..., Holder]
) -> None:
    """A registered pid whose process died and was reused by another process: the agent
    must drop it, never kill the newcomer."""
    agent = start_agent("--reclaim-grace", "0", "--orphan-grace", "30")
    c = agent.client()
    lease = c.create_lease(client="t", request="0.25", limit="1")
    bystander = holders()
    c.register_pid(lease["id"], bystander.pid)
    agent.kill()
    # While the agent is down, pretend the registered process died and its pid was reused:
    # the ledger's start time no longer matches the live process.
    db = sqlite3.connect(os.path.join(agent.state_dir, "ledger.sqlite3"))
    db.execute("UPDATE pids SET start_time = start_time - 1")
    db.commit()
    db.close()
    agent.start()
    assert wait_for(lambda: c.lease(lease["id"])["pids"] == [], what="stale pid dropped")
    assert bystander.alive()


def test_kill_checks_the_start_time(holders: Callable[..., Holder]) -> None:
    h = holders()
    ident = procs.identify(h.pid)
    assert ident is not None and ident.uid == os.getuid()
    assert not procs.kill(h.pid, ident.start_time + 1), "a reused pid is not the registered process"
    assert h.alive()
    assert procs.kill(h.pid, ident.start_time)
    h.proc.wait(timeout=10)
    assert not procs.is_alive(h.pid, ident.start_time)


def test_tcp_needs_a_token(shared_tmp: Any) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "node_agent", "serve", "--simulate", "1x1GiB", "--socket",
         str(shared_tmp / "a.sock"), "--state-dir", str(shared_tmp / "s"), "--tcp", "127.0.0.1:0"],
        capture_output=True, text=True, timeout=30, check=False,
    )
    assert out.returncode == 2 and "needs --token-file" in out.stderr


def test_tcp_with_token(start_agent: Callable[..., AgentProcess], shared_tmp: Any) -> None:
    import http.client

    token_file = shared_tmp / "token"
    token_file.write_text("s3cret-token-of-some-length\n")
    token_file.chmod(0o600)  # serve refuses a token file others may read
    port = free_port()
    agent = start_agent("--tcp", f"127.0.0.1:{port}", "--token-file", str(token_file))
    agent.client().create_lease(client="t", request="0.25")

    def get(headers: dict[str, str]) -> tuple[int, Any]:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        conn.request("GET", "/v1/leases", headers=headers)
        response = conn.getresponse()
        return response.status, json.loads(response.read())

    status, body = get({})
    assert status == 401 and "token" in body["error"]["message"]
    assert get({"Authorization": "token wrong"})[0] == 401
    # Bytes outside ASCII are a wrong token too, not an error in the agent.
    assert get({"Authorization": "token s3cret-t\u00f6ken".encode().decode("latin-1")})[0] == 401
    status, body = get({"Authorization": "token s3cret-token-of-some-length"})
    assert status == 200 and len(body["leases"]) == 1


def test_serve_without_gpu_suggests_simulation(shared_tmp: Any) -> None:
    if nvml_works():
        pytest.skip("NVML works on this machine: serve would serve it")
    out = subprocess.run(
        [sys.executable, "-m", "node_agent", "serve", "--socket", str(shared_tmp / "a.sock"),
         "--state-dir", str(shared_tmp / "s")],
        capture_output=True, text=True, timeout=30, check=False,
    )
    assert out.returncode == 2 and "--simulate" in out.stderr


def test_status_json_is_the_stable_document(
    start_agent: Callable[..., AgentProcess]
) -> None:
    agent = start_agent()
    agent.client().create_lease(client="t", request="0.25", limit="0.5")
    run = [sys.executable, "-m", "node_agent", "--socket", agent.socket, "status"]
    doc = json.loads(subprocess.run([*run, "--json"], capture_output=True, text=True, check=True).stdout)
    assert set(doc) == {"gpus", "leases"}
    assert set(doc["gpus"][0]) == {"uuid", "index", "name", "memory_total", "memory_used"}
    assert set(doc["leases"][0]) == {"id", "kind", "owner_uid", "request", "limit", "usage",
                                     "logical_gpu", "physical_gpu", "physical_gpus", "state",
                                     "pod", "protection", "fallback"}
    assert doc["leases"][0]["pod"] is None  # not in a pod
    assert (doc["leases"][0]["protection"], doc["leases"][0]["fallback"]) == (
        "checkpoint on disk", "")
    assert isinstance(doc["leases"][0]["request"], int)
    assert doc["leases"][0]["physical_gpu"].startswith("GPU-")
    table = subprocess.run(run, capture_output=True, text=True, check=True).stdout
    assert "simulated node: 2 GPU(s)" in table and "256.0 MiB" in table and "notebook" in table


def test_second_agent_on_same_socket_or_state_refused(start_agent: Callable[..., AgentProcess]) -> None:
    agent = start_agent()
    out = subprocess.run(
        [sys.executable, "-m", "node_agent", "serve", "--simulate", "1x1GiB", "--socket", agent.socket,
         "--state-dir", agent.state_dir + "-other"],
        capture_output=True, text=True, timeout=30, check=False,
    )
    assert out.returncode == 1 and "already answers" in out.stderr
    assert agent.client().ping()


def test_notices_come_only_to_whoever_asks_for_them(start_agent: Callable[..., AgentProcess]) -> None:
    c = start_agent().client()
    lease = c.create_lease(client="t", request="0.25", limit="1")
    _, cursor = c.directives(client="t", after=-1, timeout=0)
    c.resize(lease["id"], request="0.5", limit="1")
    assert c.directives(client="t", after=cursor, timeout=0) == ([], cursor + 1)
    heard, _ = c.directives(client="t", after=cursor, timeout=0, kinds=["resized", "migrate"])
    assert [(d["kind"], d["request_spec"], d["limit_spec"]) for d in heard] == [("resized", "0.5", "1")]
    with pytest.raises(AgentError) as err:
        c.directives(client="t", after=cursor, timeout=0, kinds=["resized", "reboot"])
    assert err.value.status == 400 and err.value.field == "kinds" and "bursting" in err.value.message


@pytest.mark.parametrize(
    ("body", "field", "words"),
    [
        ({}, "kind", "is required"),
        ({"kind": "snapshot", "bytes": 1}, "kind", '"checkpoint" or "offload"'),
        ({"kind": "checkpoint", "bytes": 1}, "trigger", "is required"),
        ({"kind": "checkpoint", "trigger": "often", "bytes": 1}, "trigger", "one of"),
        ({"kind": "checkpoint", "trigger": "cell"}, "bytes", "is required"),
        ({"kind": "checkpoint", "trigger": "cell", "bytes": -1}, "bytes", ">= 0"),
        ({"kind": "checkpoint", "trigger": "cell", "bytes": 1.5}, "bytes", "integer"),
        ({"kind": "checkpoint", "trigger": "cell", "bytes": 1, "written_bytes": True},
         "written_bytes", "integer"),
        ({"kind": "checkpoint", "trigger": "cell", "bytes": 1, "seconds": -0.1}, "seconds", "0 to"),
        ({"kind": "checkpoint", "trigger": "cell", "bytes": 1, "seconds": "1"}, "seconds", "0 to"),
        ({"kind": "checkpoint", "trigger": "cell", "bytes": 1, "seconds": 1e9}, "seconds", "0 to"),
        ({"kind": "offload", "reason": "boredom", "bytes": 1}, "reason", "one of"),
        ({"kind": "offload", "reason": "park", "bytes": 1, "trigger": "cell"}, "trigger",
         "unknown field"),
        ({"kind": "offload", "reason": "park", "bytes": 1, "uid": 0}, "uid", "SO_PEERCRED"),
    ],
)
def test_bad_observations_name_the_field_and_count_nothing(
    start_agent: Callable[..., AgentProcess], body: dict[str, Any], field: str, words: str
) -> None:
    c = start_agent().client()
    lease = c.create_lease(client="t", request="0.25")
    with pytest.raises(AgentError) as err:
        c.request("POST", f"/v1/leases/{lease['id']}/observations", body)
    assert (err.value.status, err.value.field) == (400, field), err.value
    assert words in err.value.message, err.value.message
    reported = [s for f in text_string_to_metric_families(c.metrics()) for s in f.samples
                if s.name.startswith(("gpufrac_checkpoint_", "gpufrac_offload"))]
    assert reported and all(s.value == 0 for s in reported), "nothing half-counted"


@pytest.mark.parametrize("field", ["client", "name", "kernel_id", "request", "logical_gpus"])
def test_a_lone_surrogate_in_any_field_is_a_400_naming_it(
        start_agent: Callable[..., AgentProcess], field: str) -> None:
    """Finding 9: JSON may name a lone surrogate (\\ud800), which no UTF-8 store can hold: the
    ledger's insert raised and the agent answered 500."""
    agent = start_agent()
    body = {"client": "c", "request": "0.25", field: "\ud800"}
    if field == "logical_gpus":
        body[field] = ["GPU-\udfff"]
    status, answer = raw_request(agent.socket, http_bytes(
        "POST", "/v1/leases", json.dumps(body).encode()))
    assert status == 400, (status, answer)
    assert answer["error"]["field"] == field and "not valid Unicode" in answer["error"]["message"]
    assert agent.client().leases() == []
