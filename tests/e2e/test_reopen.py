"""A notebook outlives its server and its node: reopened on another one, it carries on exactly.

Two simulated nodes, each its own agent and server, share one notebook folder and one checkpoint
folder (a volume both mount). The reference for "exactly" is a stock kernel that runs the same
completed cells undisturbed on the surviving node (tests/e2e/test_sequences.py's fingerprint).
"""

from __future__ import annotations

import os
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
        server_a.process.send_signal(signal.SIGTERM)
        try:
            server_a.process.wait(30)
        finally:
            kill_tree(server_a.process)
        log = server_a.log_text()
        assert f"gpufrac: stopping: kernel {subject.kernel_id} (train.ipynb): durable, after " \
            f"cell [{last}]" in log, log[-3000:]
        assert "gpufrac: stopping: 1 of 1 kernels' checkpoints durable" in log, log[-3000:]

        moved = server_b.open_notebook("train.ipynb")
        event = restored(server_b, moved.kernel_id)
        assert event["ok"] is True, event
        said = event["message"]
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
        for code in MUTATIONS[:5]:
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

        reopened = server_b.open_notebook("killed.ipynb")
        event = restored(server_b, reopened.kernel_id)
        said = event["message"]
        assert "its kernel on node-a ended without being stopped: its server or node went away" \
            in said, said
        assert event["ok"] is False and event["interrupted_cell"].startswith("[3] lost = "), event
        output = reopened.ok("print(kept, 'lost' in globals(), random.random())")
        import random

        random.seed(3)
        assert f"[0, 1, 2, 3, 4] False {random.random()}" in output, output
    finally:
        stop_server(server_b)
        kill_tree(server_a.process)
