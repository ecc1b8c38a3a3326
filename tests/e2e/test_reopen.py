"""A notebook outlives its server and its node: reopened on another one, it carries on exactly.

Two simulated nodes, each its own agent and server, share one notebook folder and one checkpoint
folder (a volume both mount). The reference for "exactly" is a stock kernel that runs the same
completed cells undisturbed on the surviving node (tests/e2e/test_sequences.py's fingerprint).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import pytest

from harness.agent import AgentProcess, wait_for
from harness.jupyter import Notebook, Server, kill_tree, start_server, stop_server

from .sequence_cells import FINGERPRINT, MUTATIONS, fingerprint

pytestmark = pytest.mark.e2e

CONFIG = (
    "c.GpuFrac.lease_poll_interval = 0.5\n"
    "c.GpuFrac.agent_check_interval = 0.5\n"
    "c.GpuFrac.spare_kernels = False\n"
)
KERNELSPECS = {
    # jupyter_client's own provisioner: no lease, no kernel hook, never disturbed.
    "reference": {"kernel_provisioner": {"provisioner_name": "local-provisioner"}},
}
SEED = "import random, numpy, torch\nrandom.seed(11)\nnumpy.random.seed(11)\ntorch.manual_seed(11)"
# Waits in the kernel for the checkpoint written in the background (prints nothing).
WRITTEN = "__import__('jupyter_gpufrac.kernel', fromlist=['x'])._hook.checkpointer.flush(120)"


class Shared(NamedTuple):
    """What both nodes mount: the notebooks and the user's checkpoint folder."""

    notebooks: Path
    checkpoints: Path


class Node(NamedTuple):
    name: str
    agent: AgentProcess
    tmp: Path


@pytest.fixture
def shared(tmp_path: Path) -> Shared:
    found = Shared(tmp_path / "volume" / "notebooks", tmp_path / "volume" / "checkpoints")
    found.notebooks.mkdir(parents=True)
    return found


@pytest.fixture
def nodes(tmp_path: Path) -> Iterator[tuple[Node, Node]]:
    a = Node("node-a", AgentProcess(tmp_path / "a" / "agent", "2x2GiB").start(), tmp_path / "a")
    b = Node("node-b", AgentProcess(tmp_path / "b" / "agent", "1x4GiB").start(), tmp_path / "b")
    try:
        yield a, b
    finally:
        for node in (a, b):
            if node.agent.process is not None and node.agent.process.poll() is None:
                node.agent.stop()


def serve(node: Node, shared: Shared, name: str, config: str = "") -> Server:
    """A Jupyter server of the same user on ``node``: the shared notebooks and checkpoints."""
    return start_server(
        node.tmp / name, node.agent.socket,
        CONFIG + f"c.GpuFrac.checkpoint_dir = {str(shared.checkpoints)!r}\n" + config,
        KERNELSPECS, env={"GPUFRAC_NODE_NAME": node.name}, root=shared.notebooks)


def restored(server: Server, kernel_id: str) -> dict[str, Any]:
    return wait_for(lambda: next((e for e in server.kernel_status(kernel_id)["events"]
                                  if e["event"] == "restored"), None),
                    60, "the restore's report", interval=0.2)


def both(subject: Notebook, reference: Notebook, code: str) -> None:
    subject.ok(code)
    reference.ok(code)


def same_state(subject: Notebook, reference: Notebook) -> str:
    """Both kernels' fingerprints are equal; returns what the subject's cell printed."""
    printed = subject.ok(FINGERPRINT)
    theirs = fingerprint(reference.ok(FINGERPRINT))
    assert fingerprint(printed) == theirs, f"\nsubject:   {fingerprint(printed)}\nreference: {theirs}"
    return printed


def test_stopped_with_a_grace_and_reopened_on_another_node_it_continues_exactly(
        nodes: tuple[Node, Node], shared: Shared) -> None:
    """SIGTERM as Kubernetes sends it to an evicted pod (after its preStop hook), then SIGKILL of
    whatever is left 30 s later; the same notebook opened on the other node resumes there."""
    a, b = nodes
    server_b = serve(b, shared, "server")
    server_a = serve(a, shared, "server")
    try:
        reference = server_b.open_notebook("reference.ipynb", kernel="reference")
        subject = server_a.open_notebook("train.ipynb")
        busy = server_a.open_notebook("busy.ipynb")
        busy.ok("done = 'before'")
        both(subject, reference, SEED)
        for code in MUTATIONS:
            both(subject, reference, code)
        last = subject.run("'the last cell on node-a'").execution_count
        reference.ok("'the last cell on node-a'")
        assert isinstance(last, int)
        # The pod's preStop hook: every checkpoint durable while the server still runs.
        flushed = subprocess.run(
            [sys.executable, "-m", "jupyter_gpufrac", "flush", "--runtime-dir",
             str(a.tmp / "server" / "runtime")],
            capture_output=True, text=True, timeout=60,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
        assert flushed.returncode == 0, flushed.stdout + flushed.stderr
        assert f"kernel {subject.kernel_id} (train.ipynb): durable, after cell [{last}]" \
            in flushed.stdout, flushed.stdout
        subject.close()
        busy.send("half = 'done'\nimport time\ntime.sleep(600)")
        wait_for(lambda: server_a.get(f"/api/kernels/{busy.kernel_id}")["execution_state"]
                 == "busy", 30, "the cell to run")
        server_a.process.send_signal(signal.SIGTERM)
        try:
            server_a.process.wait(30)
        finally:
            kill_tree(server_a.process)
        log = server_a.log_text()
        assert f"gpufrac: stopping: kernel {subject.kernel_id} (train.ipynb): durable, after " \
            f"cell [{last}]" in log, log[-3000:]
        assert f"gpufrac: stopping: kernel {busy.kernel_id} (busy.ipynb): durable, after cell " \
            "[1] at " in log, log[-3000:]
        assert "; a cell was running: what it did is not in the checkpoint" in log
        assert "gpufrac: stopping: 2 of 2 kernels' checkpoints durable" in log, log[-3000:]

        moved = server_b.open_notebook("train.ipynb")
        event = restored(server_b, moved.kernel_id)
        assert event["ok"] is True, event
        # The notification: from when and where, what came back; the reason in full.
        assert event["message"].startswith(f"Resumed from cell [{last}] at "), event
        assert " on node-a, GPU " in event["message"], event
        assert re.search(r": restored (\d+) of \1 variables\.$", event["message"]), event
        said = event["reason"]
        assert "its Jupyter server on node-a was stopped at" in said, said
        assert "it ran on GPU " in said and " there, and runs on GPU 0 (" in said, said
        reply = moved.run(FINGERPRINT)
        assert reply.status == "ok", reply.error
        # The notebook's cell numbers go on where they were.
        assert reply.execution_count == last + 1, (reply.execution_count, last)
        assert "gpufrac: This notebook was resumed from the last checkpoint of its earlier " \
               "kernel: its Jupyter server on node-a was stopped at" in reply.stdout, reply.stdout
        assert fingerprint(reply.stdout) == fingerprint(reference.ok(FINGERPRINT))
        # And it draws what an undisturbed kernel draws.
        for code in MUTATIONS[:3]:
            both(moved, reference, code)
        same_state(moved, reference)
    finally:
        for server in (server_a, server_b):
            stop_server(server)


def test_a_node_killed_outright_loses_only_what_its_last_durable_checkpoint_did_not_hold(
        nodes: tuple[Node, Node], shared: Shared) -> None:
    """No grace at all: the server, its kernels and the node's agent SIGKILLed at once. The
    notebook reopened on the other node has what the last durable checkpoint held, and is told
    which cell was running."""
    a, b = nodes
    server_a = serve(a, shared, "server")
    server_b = serve(b, shared, "server")
    try:
        subject = server_a.open_notebook("killed.ipynb")
        subject.ok("kept = list(range(5))\nimport random\nrandom.seed(3)")
        subject.ok(WRITTEN)
        subject.send("lost = 'never checkpointed'\nimport time\ntime.sleep(600)")
        wait_for(lambda: server_a.get(f"/api/kernels/{subject.kernel_id}")["execution_state"]
                 == "busy", 30, "the cell to run")
        kill_tree(server_a.process)
        a.agent.kill()

        # The other node's GPU is taken whole by a job: the notebook comes back without one.
        b.agent.client().create_lease(client="job", kind="job", request="1")
        reopened = server_b.open_notebook("killed.ipynb")
        event = restored(server_b, reopened.kernel_id)
        said = event["reason"]
        assert "its kernel on node-a ended without being stopped: its server or node went away" \
            in said, said
        assert "it ran on GPU " in said and "there, and runs without a GPU here." in said, said
        assert server_b.kernel_status(reopened.kernel_id)["state"] == "no-gpu"
        assert event["ok"] is False and event["interrupted_cell"].startswith("[3] lost = "), event
        output = reopened.ok("print(kept, 'lost' in globals(), random.random())")
        import random

        random.seed(3)
        assert f"[0, 1, 2, 3, 4] False {random.random()}" in output, output
    finally:
        stop_server(server_b)
        kill_tree(server_a.process)


NOTEBOOK = {"type": "notebook", "format": "json",
            "content": {"cells": [], "metadata": {}, "nbformat": 4, "nbformat_minor": 5}}


def create(server: Server, path: str) -> None:
    """A file (``.ipynb``) or folder in the served folder, through the contents API."""
    body = NOTEBOOK if path.endswith(".ipynb") else {"type": "directory"}
    status, found = server.api(f"/api/contents/{path}", "PUT", body)
    assert status in (200, 201), (status, found)


def rename(server: Server, source: str, target: str) -> None:
    status, found = server.api(f"/api/contents/{source}", "PATCH", {"path": target})
    assert status == 200, (status, found)


def events_of(server: Server, kernel_id: str, kind: str) -> list[dict[str, Any]]:
    return [e for e in server.kernel_status(kernel_id)["events"] if e["event"] == kind]


def sigterm(server: Server) -> None:
    server.process.send_signal(signal.SIGTERM)
    server.process.wait(30)


def test_a_notebook_keeps_its_state_through_renames_and_an_older_checkpoint_is_named(
        nodes: tuple[Node, Node], shared: Shared) -> None:
    """Renamed while its kernel runs (a file), then moved while only its state waits on disk (a
    folder above it), then reopened under its new name: it resumes. And the files of another
    notebook's checkpoint put back from an older copy (a backup, a stale cache of a network
    file system) under its newer record: restored, but named as older."""
    a, _ = nodes
    first = serve(a, shared, "first")
    try:
        create(first, "draft.ipynb")
        create(first, "project")
        nb = first.open_notebook("draft.ipynb")
        nb.ok("kept = 'through two renames'")
        rename(first, "draft.ipynb", "project/final.ipynb")
        wait_for(lambda: "checkpoint records follow draft.ipynb to project/final.ipynb"
                 in first.log_text(), 10, "the record to follow the rename")
        aged = first.open_notebook("aged.ipynb")
        aged.ok("value = 'old'")
        aged.ok(WRITTEN)
        folder = shared.checkpoints / aged.kernel_id
        copy = shared.checkpoints.parent / "older-copy"
        subprocess.run(["cp", "-a", str(folder), str(copy)], check=True)
        aged.ok("value = 'new'")
        for page in (nb, aged):
            page.close()
        sigterm(first)
    finally:
        stop_server(first)
    for item in copy.iterdir():  # the record stays: the notebook's newest word
        if item.name != "notebook.json":
            subprocess.run(["rm", "-rf", str(folder / item.name)], check=True)
            subprocess.run(["cp", "-a", str(item), str(folder / item.name)], check=True)
    second = serve(a, shared, "second")
    try:
        rename(second, "project", "archive")
        wait_for(lambda: "checkpoint records follow project to archive" in second.log_text(), 10,
                 "the waiting state's record to follow the folder")
        reopened = second.open_notebook("archive/final.ipynb")
        assert restored(second, reopened.kernel_id)["ok"] is True
        assert "through two renames" in reopened.ok("print(kept)")

        again = second.open_notebook("aged.ipynb")
        event = restored(second, again.kernel_id)
        assert event["ok"] is False and "older than the newest one recorded for it" \
            in event["message"], event
        output = again.ok("print(value)")
        assert "Warning: this checkpoint is older than the newest one recorded for it" in output
        assert output.strip().endswith("old"), output
    finally:
        stop_server(second)


def test_shut_down_by_its_user_it_starts_fresh_culled_for_idling_it_resumes(
        nodes: tuple[Node, Node], shared: Shared) -> None:
    """A kernel its user shut down starts fresh next time, as Jupyter does; jupyter_server's own
    idle culling (cull_idle_timeout) is a park to disk that the next open resumes."""
    a, _ = nodes
    server = serve(a, shared, "server", "c.MappingKernelManager.cull_idle_timeout = 3\n"
                                        "c.MappingKernelManager.cull_interval = 1\n")
    try:
        shut = server.open_notebook("shut.ipynb")
        shut.ok("gone = 'with its kernel'")
        sessions = server.get("/api/sessions")
        session = next(s for s in sessions if s["kernel"]["id"] == shut.kernel_id)
        shut.close()
        assert server.api(f"/api/sessions/{session['id']}", "DELETE")[0] == 204
        idle = server.open_notebook("idle.ipynb")
        idle.ok("import random\nrandom.seed(9)\nparked = 'on disk'")
        idle.close()  # the culler takes only kernels nobody is connected to
        wait_for(lambda: server.api(f"/api/kernels/{idle.kernel_id}")[0] == 404, 60,
                 "jupyter_server to cull the idle kernel", interval=0.2)
        assert f"kernel {idle.kernel_id}: culled for being idle" in server.log_text()

        again = server.open_notebook("idle.ipynb")
        event = restored(server, again.kernel_id)
        assert "stopped its kernel at" in event["reason"] and "for being idle" in event["reason"]
        import random

        random.seed(9)
        assert f"on disk {random.random()}" in again.ok("print(parked, random.random())")
        fresh = server.open_notebook("shut.ipynb")
        assert fresh.ok("print('gone' in globals())").strip().endswith("False")
        assert not events_of(server, fresh.kernel_id, "restored")
    finally:
        stop_server(server)


def test_asked_the_user_restores_takes_over_with_gpu_restore_or_starts_fresh(
        nodes: tuple[Node, Node], shared: Shared) -> None:
    """c.GpuFrac.resume = "ask": a new kernel starts fresh and the question is put (an event,
    the kernel view); the answer restores (a restart that resumes) or starts fresh for good.
    `%gpu restore` in the fresh kernel takes the state over in place, cell numbers and
    generators included."""
    a, b = nodes
    first = serve(a, shared, "first")
    try:
        for name in ("asked", "inplace", "declined"):
            nb = first.open_notebook(f"{name}.ipynb")
            nb.ok(f"import random\nrandom.seed(4)\nwhich = {name!r}\nrandom.random()")
            nb.close()
        sigterm(first)
    finally:
        stop_server(first)
    second = serve(b, shared, "second", "c.GpuFrac.resume = 'ask'\n")
    try:
        asked = second.open_notebook("asked.ipynb")
        question = wait_for(lambda: events_of(second, asked.kernel_id, "resumable"), 30,
                            "the question")[-1]
        assert "its Jupyter server on node-a was stopped at" in question["message"], question
        assert "holds 2 variables" in question["message"], question
        view = second.kernel_status(asked.kernel_id)["resumable"]
        assert view["cell"] == 1 and view["message"] == question["message"], view
        status, error = second.api(f"/api/gpufrac/kernels/{asked.kernel_id}/resume", "POST",
                                   {"choice": "maybe"})
        assert status == 400 and error["field"] == "choice", (status, error)
        assert "gpufrac: this notebook's earlier kernel left its state" in asked.ok("1")
        status, _ = second.api(f"/api/gpufrac/kernels/{asked.kernel_id}/resume", "POST",
                               {"choice": "restore"})
        assert status == 200
        assert restored(second, asked.kernel_id)["ok"] is True
        assert asked.ok("print(which)").strip().endswith("asked")
        assert second.kernel_status(asked.kernel_id)["resumable"] is None

        inplace = second.open_notebook("inplace.ipynb")
        reply = inplace.run("%gpu restore")
        assert reply.status == "ok", reply.error
        assert "This notebook was resumed from the last checkpoint of its earlier kernel" \
            in reply.stdout, reply.stdout
        assert reply.execution_count == 2, reply  # the earlier kernel ran cell [1]
        after = inplace.run("print(which, random.random(), In[1][:13])")
        import random

        random.seed(4)
        random.random()
        assert after.stdout.split() == ["inplace", str(random.random()), "import", "random"], \
            after.stdout
        assert after.execution_count == 3

        declined = second.open_notebook("declined.ipynb")
        wait_for(lambda: events_of(second, declined.kernel_id, "resumable"), 30, "the question")
        status, _ = second.api(f"/api/gpufrac/kernels/{declined.kernel_id}/resume", "POST",
                               {"choice": "fresh"})
        assert status == 200
        assert second.kernel_status(declined.kernel_id)["resumable"] is None
        status, error = second.api(f"/api/gpufrac/kernels/{declined.kernel_id}/resume", "POST",
                                   {"choice": "restore"})
        assert status == 409, (status, error)
        assert declined.ok("print('which' in globals())").strip().endswith("False")
    finally:
        stop_server(second)
