"""Attacks on a real agent by real Unix users (a victim, an attacker, an admin group), and
requests meant to freeze or crash it: each is refused, and the agent goes on serving."""

from __future__ import annotations

import ctypes
import importlib
import json
import logging
import os
import resource
import shutil
import signal
import socket
import stat
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from unix_users import ADMINS, ATTACKER, VICTIM, User, as_user, group, user

from harness.agent import AgentProcess, http_bytes, raw_request, wait_for
from jupyter_gpufrac.server.agent_socket import default_agent_socket
from node_agent.cli import main as cli_main
from node_agent.client import AgentClient, AgentError
from node_agent.http_server import REFUSALS_LOGGED_PER_S, REQUEST_TIMEOUT, TURNS_PER_USER

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


CLONE_NEWPID = 0x20000000


def test_pids_of_another_pid_namespace_are_looked_up_by_their_owner_only(
    agent: AgentProcess, people: dict[str, User]
) -> None:
    """Finding 4: the attacker, in a PID namespace of its own with 200 sleepers, registers pids
    nobody has, again and again, then its own children; the victim registers meanwhile. Each
    gets what it should: the attacker's own processes found (by what it numbers them), none
    that is not in its namespace, and the victim's registration is answered."""
    attacker, victim = people["attacker"], people["victim"]
    victims = as_user(victim, lambda: agent.client().create_lease(client="v", request="0.25"))
    victim_lease = victims["ok"]["id"]
    victims_kernel = psutil.Popen(["sleep", "60"], user=victim.uid, group=victim.gid)

    def in_a_namespace_of_its_own() -> Any:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.unshare(CLONE_NEWPID) != 0:
            raise OSError(ctypes.get_errno(), "unshare")
        read, write = os.pipe()
        first = os.fork()  # pid 1 of the new namespace
        if first == 0:
            os.close(read)
            try:
                os.setgroups([])
                os.setresgid(attacker.gid, attacker.gid, attacker.gid)
                os.setresuid(attacker.uid, attacker.uid, attacker.uid)
                out = {"ok": _register_from_inside(agent)}
            except BaseException as exc:
                out = {"crash": repr(exc)}
            os.write(write, json.dumps(out).encode())
            os._exit(0)
        os.close(write)
        data = b""
        while chunk := os.read(read, 65536):
            data += chunk
        os.waitpid(first, 0)
        return json.loads(data)

    os.environ["GPUFRAC_VICTIMS_PID"] = str(victims_kernel.pid)
    try:
        outer = as_user(0, in_a_namespace_of_its_own)
        assert "ok" in outer, outer
        answer = outer["ok"]
        assert "ok" in answer, answer
        found = answer["ok"]
        assert found["self"] == [1, True] and found["child"][1] and found["child"][0] != 2
        assert all(status == 400 for status in found["nobody"]), found["nobody"]
        # The victim's process, by the number it has here: not in the attacker's namespace.
        assert found["victims"] == 400
        registered = as_user(victim, lambda: agent.client().register_pid(victim_lease,
                                                                         victims_kernel.pid))
        assert registered["ok"]["pids"] == [victims_kernel.pid], registered
    finally:
        del os.environ["GPUFRAC_VICTIMS_PID"]
        victims_kernel.kill()
        victims_kernel.wait()


def _register_from_inside(agent: AgentProcess) -> dict[str, Any]:
    """In its own PID namespace: sleepers, then registrations of itself, of a child, of pids
    nobody has, and of the victim's process (its pid here, given in the environment)."""
    sleepers = []
    for _ in range(200):
        pid = os.fork()
        if pid == 0:
            signal.pause()
            os._exit(0)
        sleepers.append(pid)
    client = agent.client()
    lease = client.create_lease(client="a", request="0.125")["id"]
    try:
        def status(pid: int) -> int:
            try:
                client.register_pid(lease, pid)
            except AgentError as err:
                return err.status
            return 200
        own = client.register_pid(lease, os.getpid())["pids"]
        child = client.register_pid(lease, sleepers[0])["pids"]
        return {"self": [os.getpid(), len(own) == 1],
                "child": [child[-1], len(child) == 2],
                "nobody": [status(pid) for pid in range(5000, 5030)],
                "victims": status(int(os.environ["GPUFRAC_VICTIMS_PID"]))}
    finally:
        for pid in sleepers:
            os.kill(pid, signal.SIGKILL)


def test_a_flood_of_one_users_requests_waits_behind_itself_not_before_others(
    agent: AgentProcess, people: dict[str, User]
) -> None:
    """Finding 4: 256 connections of one user scraping /metrics made every other user's
    request wait behind all of theirs (p95 1.3 s). A user's requests are served a few at a
    time (TURNS_PER_USER), the rest of theirs wait their turn: here the attacker's turns are
    all taken by requests whose bodies never finish, and its next request waits while the
    victim's, with long-polls of its own waiting meanwhile, are answered at once."""
    attacker, victim = people["attacker"], people["victim"]
    body = b'{"client": "a", "request": "0.25"}'
    # Asked to say "100 Continue", the agent says so once the request has its turn.
    half = http_bytes("POST", "/v1/leases", body,
                      headers="Expect: 100-continue\r\n")[:-len(body) // 2]
    report_r, report_w = os.pipe()
    go_r, go_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the attacker: its turns held by half-sent bodies, then one more request
        out: dict[str, Any]
        try:
            os.setgroups([])
            os.setresgid(attacker.gid, attacker.gid, attacker.gid)
            os.setresuid(attacker.uid, attacker.uid, attacker.uid)
            holding = [socket.socket(socket.AF_UNIX) for _ in range(TURNS_PER_USER)]
            for sock in holding:
                sock.connect(agent.socket)
                sock.sendall(half)
                sock.settimeout(10)
                assert sock.recv(64).startswith(b"HTTP/1.1 100")
            waiting = socket.socket(socket.AF_UNIX)
            waiting.connect(agent.socket)
            waiting.sendall(http_bytes("GET", "/v1/node"))
            waiting.settimeout(1.0)
            try:
                early = waiting.recv(64).decode()
            except TimeoutError:
                early = ""
            os.write(report_w, b"waited\n")
            os.read(go_r, 1)
            holding[0].close()  # one turn given back: the waiting request is served
            waiting.settimeout(10)
            out = {"early": early, "then": waiting.recv(64).decode()}
        except BaseException as exc:
            out = {"crash": repr(exc)}
        os.write(report_w, json.dumps(out).encode() + b"\n")
        os._exit(0)
    try:
        with os.fdopen(report_r) as report:
            assert report.readline() == "waited\n"

            def long_polls_then_node() -> Any:
                polls = [AgentClient(agent.socket, timeout=40) for _ in range(8)]
                waits = [threading.Thread(target=c.directives, kwargs={
                    "client": "v", "after": 0, "timeout": 20}, daemon=True) for c in polls]
                for thread in waits:
                    thread.start()
                started = time.monotonic()
                node = agent.client(timeout=5).node()
                return {"gpus": len(node["gpus"]), "seconds": time.monotonic() - started}

            served = as_user(victim, long_polls_then_node)
            assert served.get("ok", {}).get("gpus") == 2, served
            assert served["ok"]["seconds"] < 5
            os.write(go_w, b"x")
            seen = json.loads(report.readline())
        assert seen.get("early") == "", seen  # it waited its turn
        assert seen.get("then", "").startswith("HTTP/1.1 200"), seen
    finally:
        os.close(go_w)
        os.waitpid(pid, 0)


def test_a_new_listeners_cursor_tells_nothing_of_other_users(
    agent: AgentProcess, people: dict[str, User]
) -> None:
    """Finding 12: ``directives?after=-1`` answered the node's directive counter, so anyone
    could watch how busy other users were. A new listener's cursor is past the directives it
    may see, whatever others get."""
    victim, attacker = people["victim"], people["attacker"]

    def cursor() -> int:
        return int(agent.client().directives(client="jupyter", after=-1, timeout=0)[1])

    def busy_victim() -> list[int]:
        c = agent.client()
        lease = c.create_lease(client="jupyter", request="0.25", limit="0.5")
        for request in ("0.5", "0.25", "0.5"):  # each a `resized` notice for the victim
            c.resize(lease["id"], request=request)
        return [cursor(), int(c.directives(client="jupyter", after=0, timeout=0)[1])]

    before = as_user(attacker, cursor)["ok"]
    mine, newest = as_user(victim, busy_victim)["ok"]
    after = as_user(attacker, cursor)["ok"]
    assert (before, after) == (0, 0), (before, after)
    # The victim's own cursor is past the victim's own directives.
    assert mine == newest > 0


@pytest.mark.parametrize("level", ["info", "debug"])
def test_refused_requests_do_not_flood_the_log(
    start_agent: Callable[..., AgentProcess], people: dict[str, User], level: str
) -> None:
    """Finding 12: every 4xx was logged at INFO (61k lines, 5 MB in minutes). Refusals are
    debug lines, at most REFUSALS_LOGGED_PER_S a second."""
    agent = start_agent("--log-level", level)
    before = len(agent.log.read_bytes())

    def refused_many() -> tuple[list[int], float]:
        statuses = []
        started = time.monotonic()
        with socket.socket(socket.AF_UNIX) as sock:
            sock.connect(agent.socket)
            for n in range(300):
                sock.sendall(http_bytes("GET", f"/v1/leases/l-{n}").replace(
                    b"Connection: close", b"Connection: keep-alive"))
                data = b""
                while b"\r\n\r\n" not in data or not data.endswith(b"}"):
                    data += sock.recv(65536)
                statuses.append(int(data.split()[1]))
        return statuses, time.monotonic() - started

    answered, seconds = as_user(people["attacker"], refused_many)["ok"]
    assert set(answered) == {404}
    agent.client().node()  # a request after them: the log has what they made it write
    written = agent.log.read_bytes()[before:]
    lines = written.count(b"\n")
    if level == "info":
        assert lines == 0, written[-2000:]
    else:
        said = written.count(b"404 GET /v1/leases/")
        assert 0 < said <= REFUSALS_LOGGED_PER_S * (int(seconds) + 2), (said, seconds)


def test_a_squatted_socket_folder_leaves_the_victims_server_a_folder_of_its_own(
    planted: tuple[Path, socket.socket], people: dict[str, User]
) -> None:
    """Finding 10: the attacker made /tmp/gpufrac-<victim's uid> before the victim's first
    start; the victim's Jupyter server could not start its agent, and had no GPU until an
    administrator removed the folder. The server picks a folder of the victim's own, its agent
    serves there, and the log names the squatter's folder for the administrator."""
    folder, listener = planted
    victim = people["victim"]
    state = Path(f"/tmp/gpufrac-state-{victim.uid}")

    def victims_server() -> dict[str, Any]:
        os.environ.pop("XDG_RUNTIME_DIR", None)
        os.environ.pop("GPUFRAC_AGENT_SOCKET", None)
        lines: list[str] = []
        log = logging.getLogger("victims-server")
        handler = logging.Handler()
        handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
        log.addHandler(handler)
        path = default_agent_socket(log)
        agent = os.fork()
        if agent == 0:  # the embedded agent, on that socket
            os._exit(cli_main(["serve", "--socket", path, "--simulate", "1x1GiB",
                               "--state-dir", str(state)]))
        try:
            node = wait_for(lambda: _node_or_none(path), 30, "the victim's agent")
        finally:
            os.kill(agent, signal.SIGTERM)
            os.waitpid(agent, 0)
        return {"path": path, "gpus": len(node["gpus"]), "log": lines,
                "env": os.environ.get("GPUFRAC_AGENT_SOCKET")}

    try:
        served = as_user(victim, victims_server)
        assert "ok" in served, served
        path = Path(served["ok"]["path"])
        assert served["ok"]["gpus"] == 1 and served["ok"]["env"] == str(path)
        assert folder not in path.parents
        st = path.parent.stat()
        assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (victim.uid, 0o700)
        [said] = served["ok"]["log"]
        assert f"{folder} cannot be used" in said and f"administrator should remove {folder}" in said
        with pytest.raises(BlockingIOError):
            listener.accept()  # the victim never talked to the attacker's socket
    finally:
        shutil.rmtree(state, ignore_errors=True)
        for made in Path("/tmp").glob(f"gpufrac-{victim.uid}-*"):
            shutil.rmtree(made, ignore_errors=True)


def _node_or_none(path: str) -> dict[str, Any] | None:
    try:
        return AgentClient(path, timeout=2).node()
    except AgentError:
        return None
