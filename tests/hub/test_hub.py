"""JupyterHub for real on a shared GPU node (issue #13): JupyterHub with configurable-http-proxy,
LocalProcessSpawner as in docs/jupyterhub/, real Unix users, one system agent (root, simulated
2x4GiB). Two users' notebooks are spread over the GPUs, a third user's whole-GPU job compacts
them with their variables kept, each user sees only their own leases, checkpoints are each
user's own, and a Hub admin in the agent's admin group sees everything."""

from __future__ import annotations

import os
import random
import stat
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

import psutil
import pytest
from unix_users import as_user

from harness.agent import rest_call, wait_for
from harness.hub import still_running
from hub.conftest import NAMES, ORPHAN_GRACE, HubNode

pytestmark = pytest.mark.e2e

NOTEBOOK_USERS = ("alice", "bob")
SEEDS = {"alice": 11, "bob": 22}

# Host memory stands for device memory on the simulated node: 64 MiB the agent measures.
STATE = """
import os, random
random.seed({seed})
shared = [1, 2, 3]
data = {{"a": shared, "b": shared, "owner": os.environ["USER"]}}
def twice(x):
    return 2 * x
block = bytearray(64 * 2**20)
block[::4096] = b"x" * len(block[::4096])
print("WHERE", os.getpid(), os.environ["CUDA_VISIBLE_DEVICES"], os.environ["GPUFRAC_LEASE_ID"])
"""

CHECK = """
import os
assert data["a"] is data["b"] is shared and shared == [1, 2, 3], "aliases"
assert twice(21) == 42, "a cell's function"
assert len(block) == 64 * 2**20 and block[4096] == ord("x"), "the block"
print("WHERE", os.getpid(), os.environ["CUDA_VISIBLE_DEVICES"], os.environ["GPUFRAC_LEASE_ID"])
print("OWNER", data["owner"], os.getuid())
print("DRAW", random.random())
"""


def where(output: str) -> tuple[int, str, str]:
    """pid, GPU and lease a cell printed (the first cell after a restore also says why)."""
    pid, gpu, lease = next(line.split()[1:] for line in output.splitlines() if line.startswith("WHERE "))
    return int(pid), gpu, lease


@pytest.fixture(scope="module")
def node(hub_node: HubNode) -> Iterator[HubNode]:
    """Alice and Bob each start their server through the Hub and open a notebook that holds state."""
    hub = hub_node.hub
    for role in (*NOTEBOOK_USERS, "dave"):
        hub_node.tokens[role] = hub.new_token(NAMES[role])
    # Both servers at once, as two people logging in (the Hub answers a spawn request only once
    # the server is up, or after its slow_spawn_timeout).
    with ThreadPoolExecutor(len(NOTEBOOK_USERS)) as pool:
        servers = {role: pool.submit(hub.start_server, NAMES[role], hub_node.tokens[role],
                                     hub_node.homes[role]) for role in NOTEBOOK_USERS}
    for role in NOTEBOOK_USERS:
        hub_node.servers[role] = servers[role].result()
        hub.wait_ready(NAMES[role], hub_node.servers[role])
    for role in NOTEBOOK_USERS:
        hub_node.notebooks[role] = hub_node.servers[role].open_notebook("work.ipynb")
    yield hub_node


@pytest.fixture(scope="module")
def before(node: HubNode) -> dict[str, tuple[int, str, str]]:
    """Where each notebook's kernel ran its first cell: pid, GPU, lease."""
    return {role: where(node.notebooks[role].ok(STATE.format(seed=SEEDS[role])))
            for role in NOTEBOOK_USERS}


def test_two_users_notebooks_are_spread_over_the_gpus(
    node: HubNode, before: dict[str, tuple[int, str, str]]
) -> None:
    # Each server runs the documented configuration, on the system agent.
    log = node.hub.log_text()
    assert log.count("--GpuFrac.embedded_agent=False") >= 2
    assert log.count(f"gpufrac: using the GPU agent at {node.agent.socket}") >= 2
    gpus = {gpu["uuid"] for gpu in node.servers["alice"].get("/api/gpufrac/node")["gpus"]}
    assert len(gpus) == 2
    # Spread: each burstable notebook has an idle GPU of its own to burst into.
    assert {gpu for _, gpu, _ in before.values()} == gpus
    # Each kernel runs as its user, and its lease is theirs.
    for role in NOTEBOOK_USERS:
        uid = node.users[role].uid
        assert psutil.Process(before[role][0]).uids().real == uid
        lease = node.servers[role].kernel_status(node.notebooks[role].kernel_id)["lease"]
        assert lease["owner_uid"] == uid and lease["id"] == before[role][2]


def test_each_user_sees_only_their_own_leases_and_the_gpus_totals(
    node: HubNode, before: dict[str, tuple[int, str, str]]
) -> None:
    for role, other in (("alice", "bob"), ("bob", "alice")):
        mine, theirs = before[role][2], before[other][2]
        # The widget's REST, through the Hub's proxy with the user's own token.
        rest = node.servers[role].get("/api/gpufrac/node")
        assert [lease["id"] for lease in rest["leases"]] == [mine]
        assert theirs not in str(rest)
        # The GPUs' totals count everyone: the other user's 64 MiB shows on their GPU, unnamed
        # (once the agent has measured it: it polls).
        assert all(gpu["memory_total"] == 4 * 2**30 for gpu in rest["gpus"])

        def their_gpu(role: str = role, other: str = other) -> dict[str, Any] | None:
            gpus = node.servers[role].get("/api/gpufrac/node")["gpus"]
            gpu = next(gpu for gpu in gpus if gpu["uuid"] == before[other][1])
            return gpu if gpu["memory_used"] >= 64 * 2**20 else None

        assert wait_for(their_gpu, 10, f"{other}'s usage in {role}'s totals")["leases"] == []
        # %gpu: this kernel's lease, and the node's GPUs with their totals, nothing of the other's.
        shown = node.notebooks[role].ok("%gpu")
        # (Leases by name, not id: the id is for --json; the other's never appears at all.)
        assert "this kernel's share of GPU" in shown and theirs not in shown
        assert shown.count(" used of 4.0 GiB") == 2, shown
        # The agent itself, asked by the user's own process: only their own lease.
        status = node.status_as(role)
        assert [lease["id"] for lease in status["leases"]] == [mine]
        assert len(status["gpus"]) == 2
        # Another user's token does not open this user's server.
        code, _ = rest_call(f"{node.servers[role].url}/api/gpufrac/node", node.tokens[other])
        assert code == 403, code


def test_a_hub_admin_in_the_admin_group_sees_everything(
    node: HubNode, before: dict[str, tuple[int, str, str]]
) -> None:
    everyone = {lease for _, _, lease in before.values()}
    # The agent shows a member of --admin-group every lease, with its owner.
    status = node.status_as("dave")
    assert everyone <= {lease["id"] for lease in status["leases"]}
    owners = {lease["id"]: lease["owner_uid"] for lease in status["leases"]}
    assert {owners[before[role][2]] for role in NOTEBOOK_USERS} == {
        node.users[role].uid for role in NOTEBOOK_USERS}
    # The Hub lets its admin into every user's server: each one's widget, as that user sees it.
    for role in NOTEBOOK_USERS:
        code, rest = rest_call(f"{node.servers[role].url}/api/gpufrac/node", node.tokens["dave"])
        assert code == 200 and [lease["id"] for lease in rest["leases"]] == [before[role][2]]
    code, users = node.hub.api("/users", token=node.tokens["dave"])
    assert code == 200
    running = {user["name"] for user in users if user.get("servers")}
    assert running == {NAMES[role] for role in NOTEBOOK_USERS}
    # Carol, outside the group and holding no lease now, is shown none of theirs.
    assert node.status_as("carol")["leases"] == []


def test_checkpoints_live_in_each_users_own_data_directory_0700(
    node: HubNode, before: dict[str, tuple[int, str, str]]
) -> None:
    folders = {}
    for role in NOTEBOOK_USERS:
        who = node.users[role]
        folder = node.homes[role] / ".local" / "share" / "jupyter" / "gpufrac" / "checkpoints"
        assert str(folder) in node.notebooks[role].ok("%gpu")
        kernel = folder / node.notebooks[role].kernel_id

        def written(kernel: Path = kernel) -> bool:
            return kernel.is_dir() and any(kernel.iterdir())

        wait_for(written, 30, f"{role}'s first checkpoint")
        # Every folder is the user's own with mode 0700; no file is open to group or others.
        for path in [folder, *folder.rglob("*")]:
            info = path.lstat()
            assert info.st_uid == who.uid, (path, info.st_uid)
            if stat.S_ISDIR(info.st_mode):
                assert stat.S_IMODE(info.st_mode) == 0o700, (path, oct(info.st_mode))
            assert not info.st_mode & 0o077, (path, oct(info.st_mode))
        folders[role] = folder
    # The other user cannot even list them (unpickling runs code: nobody else's may be loaded).
    for role, other in (("alice", "bob"), ("bob", "alice")):
        answer = as_user(node.users[other], partial(os.listdir, str(folders[role])))
        assert "PermissionError" in answer.get("crash", ""), answer


def test_a_third_users_whole_gpu_job_compacts_them_with_their_variables_kept(
    node: HubNode, before: dict[str, tuple[int, str, str]]
) -> None:
    out = node.homes["carol"] / "job-gpu"
    job = node.agent_cli("carol", "run", "--gpus", "1", "--timeout", "120", "--",
                         "sh", "-c", f'echo "$CUDA_VISIBLE_DEVICES" > {out}; sleep 1')
    assert job.returncode == 0, job.stderr
    moved = [role for role in NOTEBOOK_USERS
             if "migrated" in node.servers[role].events(node.notebooks[role].kernel_id)]
    assert len(moved) == 1, {role: node.servers[role].events(node.notebooks[role].kernel_id)
                             for role in NOTEBOOK_USERS}
    [mover] = moved
    [stayer] = [role for role in NOTEBOOK_USERS if role != mover]
    # The job, carol's, ran on the GPU the notebook left.
    assert out.read_text().strip() == before[mover][1]
    assert out.stat().st_uid == node.users["carol"].uid

    server, kernel = node.servers[mover], node.notebooks[mover].kernel_id

    def restored() -> dict[str, Any] | None:
        status = server.kernel_status(kernel)
        return status if status["events"][-1]["event"] == "restored" else None

    status = wait_for(restored, 60, f"{mover}'s restore report", interval=0.2)
    report = status["events"][-1]
    assert report["lost"] == [] and {"shared", "data", "twice", "block"} <= set(report["restored"])
    assert status["state"] == "restored" and status["gpu"]["uuid"] == before[stayer][1]

    # Same page, same kernel id: the variables, a cell's function and the generator carry on.
    for role in NOTEBOOK_USERS:
        output = node.notebooks[role].ok(CHECK)
        pid, gpu, lease = where(output)
        assert f"OWNER {NAMES[role]} {node.users[role].uid}" in output
        assert f"DRAW {random.Random(SEEDS[role]).random()}" in output, output
        assert lease == before[role][2]  # one lease, kept through the move
        if role == mover:
            assert pid != before[role][0] and gpu == before[stayer][1]
            assert "free GPU" in output  # the first cell after the move says what happened
        else:
            assert (pid, gpu) == before[role][:2]
            assert "migrating" not in node.servers[role].events(node.notebooks[role].kernel_id)
    # The restored kernel still checkpoints into its user's own folder.
    assert str(node.homes[mover]) in node.notebooks[mover].ok("%gpu")
    # Each user still sees only their own lease, now both on one GPU.
    for role in NOTEBOOK_USERS:
        assert [lease["id"] for lease in node.status_as(role)["leases"]] == [before[role][2]]


def test_a_server_the_hub_stops_resumes_its_notebook_when_started_again(node: HubNode) -> None:
    """The Hub stops alice's server (as jupyterhub-idle-culler does: DELETE its server), then
    she starts it again and reopens her notebook: the same state, cell numbers and draws."""
    nb, name = node.notebooks["alice"], NAMES["alice"]
    nb.ok("import random\nnext_draw = random.Random()\nnext_draw.setstate(random.getstate())")
    last = nb.run("'the last cell before the stop'").execution_count
    assert isinstance(last, int)
    pid = node.hub.server_pid(name)
    nb.close()
    status, body = node.hub.api(f"/users/{name}/server", "DELETE")
    assert status in (202, 204), (status, body)
    assert pid is not None and still_running([pid], timeout=60) == []
    # LocalProcessSpawner's SIGINT: the server first made the kernel's checkpoint durable.
    assert f"gpufrac: stopping: kernel {nb.kernel_id} (work.ipynb): durable, after cell " \
           f"[{last}]" in node.hub.log_text()

    server = node.hub.start_server(name, node.tokens["alice"], node.homes["alice"])
    node.hub.wait_ready(name, server)
    node.servers["alice"] = server
    reopened = node.notebooks["alice"] = server.open_notebook("work.ipynb")
    event = wait_for(lambda: next((e for e in server.kernel_status(reopened.kernel_id)["events"]
                                   if e["event"] == "restored"), None), 60, "the resume")
    assert event["ok"] is True and event["cause"] == "resumed", event
    reply = reopened.run(CHECK + "print('NEXT', next_draw.random())")
    assert reply.status == "ok", reply.error
    assert reply.execution_count == last + 1, (reply.execution_count, last)
    assert "its Jupyter server on " in reply.stdout and " was stopped at " in reply.stdout
    draw = next(line.split()[1] for line in reply.stdout.splitlines() if line.startswith("DRAW "))
    assert f"NEXT {draw}" in reply.stdout, reply.stdout


def test_everything_stops_with_the_hub(node: HubNode) -> None:
    """Stopping the Hub stops every server, kernel and the proxy, and no lease stays behind."""
    kernels = [where(node.notebooks[role].ok(
        "import os\nprint('WHERE', os.getpid(), os.environ['CUDA_VISIBLE_DEVICES'], "
        "os.environ['GPUFRAC_LEASE_ID'])"))[0] for role in NOTEBOOK_USERS]
    servers = [pid for role in NOTEBOOK_USERS if (pid := node.hub.server_pid(NAMES[role]))]
    assert len(servers) == 2 and set(kernels) <= set(node.user_pids())
    problems = node.shutdown()
    assert not problems, "\n".join(problems)
    assert node.hub.process.poll() is not None and node.user_pids() == []
    assert still_running([*servers, *kernels], timeout=5) == []
    # See the next test: today the servers exit without a word to the agent, so their leases
    # go when the agent finds their processes gone, after --orphan-grace.
    client = node.agent.client()
    node.leases_left_at_stop = [lease["id"] for lease in client.leases()]
    wait_for(lambda: client.leases() == [], ORPHAN_GRACE + 10, "the agent to release every lease",
             interval=0.5)


def test_stopped_servers_release_their_leases_themselves(node: HubNode) -> None:
    assert node.leases_left_at_stop == [], node.leases_left_at_stop
