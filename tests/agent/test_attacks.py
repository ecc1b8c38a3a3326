"""Attacks on a real agent by real Unix users (a victim, an attacker, an admin group), and
requests meant to freeze or crash it: each is refused, and the agent goes on serving."""

from __future__ import annotations

import importlib
import json
import os
import resource
import shutil
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from unix_users import ADMINS, ATTACKER, VICTIM, User, as_user, group, user

from harness.agent import AgentProcess, http_bytes, raw_request, wait_for
from node_agent.api import REQUEST_TIMEOUT
from node_agent.cli import main as cli_main
from node_agent.client import AgentClient, AgentError

# What `serve` imports, loaded before any fork: a child that became another user may not be
# able to read this Python's own files (they can live under root's home).
for _module in ("node_agent.api", "node_agent.ledger", "node_agent.devices"):
    importlib.import_module(_module)

OPERATOR = "gpufrac-operator"


@pytest.fixture(scope="module")
def people() -> dict[str, User]:
    """The victim V, the attacker A, and an operator in the agent's admin group."""
    group(ADMINS)
    return {"victim": user(VICTIM), "attacker": user(ATTACKER),
            "operator": user(OPERATOR, ADMINS)}


@pytest.fixture
def agent(start_agent: Callable[..., AgentProcess], people: dict[str, User]) -> AgentProcess:
    return start_agent("--admin-group", ADMINS, "--max-leases-per-user", "8")


def test_admin_rights_come_from_the_connection_not_from_what_its_pid_becomes(
    agent: AgentProcess, people: dict[str, User]
) -> None:
    """F1: the attacker connects; then the pid it connected from turns into an admin-group
    member's process (here: the same process takes the admin group, as a reused pid would).
    Nothing the agent learns about that pid afterwards may make the attacker an admin."""
    victim, attacker, admins = people["victim"], people["attacker"], group(ADMINS)
    lease = as_user(victim, lambda: agent.client().create_lease(client="v", request="0.25"))
    lease_id = lease["ok"]["id"]

    def connect_then_become_admin() -> Any:
        # Root stays the saved uid, so the child can change its groups after connecting.
        os.setgroups([])
        os.setresgid(attacker.gid, attacker.gid, 0)
        os.setresuid(attacker.uid, attacker.uid, 0)
        sock = socket.socket(socket.AF_UNIX)
        sock.connect(agent.socket)
        os.setresuid(-1, 0, -1)
        os.setgroups([admins])
        os.setresuid(-1, attacker.uid, -1)
        with sock:
            sock.sendall(http_bytes("PATCH", f"/v1/leases/{lease_id}", b'{"request": "0.75"}'))
            data = b""
            while chunk := sock.recv(65536):
                data += chunk
        return data.decode()

    answer = as_user(0, connect_then_become_admin)["ok"]
    assert answer.startswith("HTTP/1.1 404"), answer
    assert agent.client().lease(lease_id)["request_spec"] == "0.25"
    # A real member of the group is an admin, from its own connection.
    seen = as_user(people["operator"], lambda: agent.client().lease(lease_id))
    assert seen["ok"]["id"] == lease_id


def test_a_lease_naming_someone_elses_client_never_reaches_them(
    agent: AgentProcess, people: dict[str, User]
) -> None:
    """F2: the attacker writes a root-run server's client id and one of its kernel ids (both
    in `ps`) on a lease of its own and makes the agent move it. The server, asking for its
    client's directives, hears nothing of it; an admin can still follow the lease by id."""
    root = agent.client()
    _, cursor = root.directives(client="jupyter-root", after=-1, timeout=0)

    def forge() -> str:
        c = agent.client()
        forged = c.create_lease(client="jupyter-root", kernel_id="victims-kernel",
                                request="0.25", limit="0.5")
        c.create_lease(client="a", kind="job", request="0.5")
        moved = c.resize(forged["id"], request="0.75")
        assert moved["state"] == "migrating"
        return str(forged["id"])

    forged_id = as_user(people["attacker"], forge)["ok"]
    found, _ = root.directives(client="jupyter-root", after=cursor, timeout=0.5)
    assert found == []
    by_id, _ = root.directives(lease=forged_id, after=cursor, timeout=0)
    assert [(d["kind"], d["kernel_id"]) for d in by_id] == [("migrate", "victims-kernel")]
    # The attacker hears of its own lease under that client name, and of nobody else's.
    heard = as_user(people["attacker"],
                    lambda: agent.client().directives(client="jupyter-root", after=cursor,
                                                      timeout=0))
    assert [d["lease_id"] for d in heard["ok"][0]] == [forged_id]


@pytest.fixture
def planted(people: dict[str, User]) -> Iterator[tuple[Path, socket.socket]]:
    """F3: the attacker's folder where the victim's default socket would be, with a socket
    listening in it (no XDG_RUNTIME_DIR for the victim, so the default is under /tmp)."""
    folder = Path(f"/tmp/gpufrac-{people['victim'].uid}")
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(mode=0o777)
    folder.chmod(0o777)
    os.chown(folder, people["attacker"].uid, people["attacker"].gid)
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(folder / "agent.sock"))
    os.chmod(folder / "agent.sock", 0o777)
    listener.listen(16)
    listener.setblocking(False)
    yield folder, listener
    listener.close()
    shutil.rmtree(folder, ignore_errors=True)


def test_a_socket_folder_planted_by_another_user_is_refused(
    planted: tuple[Path, socket.socket], people: dict[str, User],
    capfd: pytest.CaptureFixture[str],
) -> None:
    folder, listener = planted

    def victim_runs(*argv: str) -> int:
        os.environ.pop("XDG_RUNTIME_DIR", None)
        os.environ.pop("GPUFRAC_AGENT_SOCKET", None)
        return cli_main(list(argv))

    assert as_user(people["victim"], lambda: victim_runs("status"))["ok"] == 1
    state = f"/tmp/gpufrac-state-{people['victim'].uid}"
    served = as_user(people["victim"],
                     lambda: victim_runs("serve", "--simulate", "1x1GiB", "--state-dir", state))
    assert served.get("ok") == 2, served
    err = capfd.readouterr().err
    assert err.count(f"{folder} must be yours with mode 0700") == 2, err
    with pytest.raises(BlockingIOError):
        listener.accept()  # the victim never talked to the attacker's socket
    shutil.rmtree(state, ignore_errors=True)


def test_numbers_that_would_freeze_or_crash_the_agent_are_refused_at_once(
    agent: AgentProcess,
) -> None:
    """F6, F7 and the low ones: every bad input is a 4xx naming the field, answered at once."""
    path = agent.socket
    lease = agent.client().create_lease(client="t", request="0.25")
    started = time.monotonic()
    for body, field in (
        (json.dumps({"client": "t", "request": "1" * 700_000}).encode(), None),  # 413: too big
        (json.dumps({"client": "t", "request": "9" * 40}).encode(), "request"),
        (json.dumps({"client": "t", "request": "1e-300"}).encode(), "request"),
        (json.dumps({"client": "t", "request": 1e-300}).encode(), "request"),
        (json.dumps({"client": "t", "request": "0.25", "kernel_id": "k" * 129}).encode(),
         "kernel_id"),
        (json.dumps({"client": "t", "request": "0.25", "name": "n" * 201}).encode(), "name"),
        (b'{"client": "t", "request": ' + b"[" * 10_000 + b"]" * 10_000 + b"}", None),
        (b'{"client": {"nested": [1, 2]}, "request": "0.25"}', "client"),
    ):
        status, answer = raw_request(path, http_bytes("POST", "/v1/leases", body))
        assert 400 <= status < 500, (status, answer)
        assert answer["error"]["field"] == field, answer
    for query, field in (("timeout=nan", "timeout"), ("timeout=inf", "timeout"),
                         ("timeout=-1", "timeout"), ("after=" + "9" * 30, "after"),
                         ("after=-2", "after"), ("timeout=1e999", "timeout")):
        status, answer = raw_request(path, http_bytes("GET", f"/v1/directives?client=t&{query}"))
        assert status == 400 and answer["error"]["field"] == field, (query, answer)
    assert time.monotonic() - started < 10, "every refusal came at once"
    assert agent.client().lease(lease["id"])["request_spec"] == "0.25"


def test_a_user_may_hold_only_so_many_leases(
    agent: AgentProcess, people: dict[str, User]
) -> None:
    def grab() -> Any:
        c = agent.client()
        made = [c.create_lease(client="greedy", request="1Mi") for _ in range(8)]
        try:
            c.create_lease(client="greedy", request="1Mi")
        except AgentError as exc:
            return {"made": len(made), "status": exc.status, "message": exc.message}
        return {"made": len(made) + 1}

    got = as_user(people["attacker"], grab)["ok"]
    assert got["made"] == 8 and got["status"] == 429 and "release some" in got["message"]
    # Others are not held back by it.
    assert as_user(people["victim"],
                   lambda: agent.client().create_lease(client="v", request="1Mi"))["ok"]


def test_idle_half_sent_connections_neither_starve_others_nor_spin_the_agent(
    agent: AgentProcess, people: dict[str, User], tmp_path: Path
) -> None:
    """F11: the agent runs out of descriptors under connections that never finish their
    headers. It stays quiet (no spin, little log), others are served once they close, and a
    single user cannot take them all."""
    assert agent.process is not None
    resource.prlimit(agent.process.pid, resource.RLIMIT_NOFILE, (64, 64))
    proc = psutil.Process(agent.process.pid)
    log_before = agent.log.stat().st_size
    hogs: list[socket.socket] = []
    try:
        for _ in range(100):  # as root: not held back by the per-user limit
            sock = socket.socket(socket.AF_UNIX)
            sock.setblocking(False)
            try:
                sock.connect(agent.socket)
            except BlockingIOError:
                sock.close()
                break
            sock.send(b"GET /v1/node HTTP/1.1\r\nHo")
            hogs.append(sock)
        proc.cpu_percent(None)
        time.sleep(2.0)  # the measurement is over an interval: there is no event to wait for
        busy = proc.cpu_percent(None)
        assert busy < 50, f"the agent spun at {busy:.0f} % CPU at its descriptor limit"
        grown = agent.log.stat().st_size - log_before
        assert grown < 20_000, f"{grown} bytes of log in 2 s"
        # A connection that never finishes its headers is closed when its time is up.
        first = hogs[0]
        first.settimeout(REQUEST_TIMEOUT + 5)
        assert first.recv(1) == b""
    finally:
        for sock in hogs:
            sock.close()
    wait_for(lambda: _answers(agent.client(timeout=2)), 15, "the agent to serve again")


def _answers(client: AgentClient) -> bool:
    try:
        client.node()
    except AgentError:
        return False
    return True


def test_one_user_cannot_hold_every_connection(
    agent: AgentProcess, people: dict[str, User]
) -> None:
    attacker = people["attacker"]
    report_r, report_w = os.pipe()
    done_r, done_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the attacker: holds 300 connections until told to stop
        out: dict[str, Any]
        try:
            os.setgroups([])
            os.setresgid(attacker.gid, attacker.gid, attacker.gid)
            os.setresuid(attacker.uid, attacker.uid, attacker.uid)
            hogs = [socket.socket(socket.AF_UNIX) for _ in range(300)]
            for sock in hogs:
                sock.connect(agent.socket)
            try:
                agent.client(timeout=5).node()
                out = {"status": 200}
            except AgentError as exc:
                out = {"status": exc.status, "message": exc.message}
        except BaseException as exc:
            out = {"crash": repr(exc)}
        os.write(report_w, json.dumps(out).encode() + b"\n")
        os.read(done_r, 1)
        os._exit(0)
    try:
        with os.fdopen(report_r) as report:
            refused = json.loads(report.readline())
        assert refused.get("status") == 503, refused
        assert "too many connections" in refused["message"]
        # While the attacker holds its share of connections, the victim is served.
        assert as_user(people["victim"], lambda: agent.client(timeout=5).node())["ok"]["gpus"]
    finally:
        os.write(done_w, b"x")
        os.waitpid(pid, 0)
