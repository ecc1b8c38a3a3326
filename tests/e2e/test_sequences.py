"""Randomized sequences of what happens to a notebook, checked after every step against a reference.

The subject is a notebook kernel with a GPU lease on a real agent (simulated node); the
reference is a stock kernel of the same server that runs the same completed cells and is
never disturbed. After every step both print a fingerprint of their state (values, shared
references, cell classes and functions, random generators), and the two must be equal.
A cell a move cuts off is not completed: the reference never runs it, and afterwards both
run its change again.

``make test`` runs a few fixed seeds; ``make soak`` sets GPUFRAC_SOAK_STEPS for a long run
and prints its figures.
"""

from __future__ import annotations

import collections
import contextlib
import os
import random
import signal
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import websocket
from support import AgentProcess, wait_for

from .jupyter_process import Notebook, Server, running_server
from .sequence_cells import (
    BURST,
    CUT_OFF,
    CUT_OFF_DONE,
    FINGERPRINT,
    MUTATIONS,
    UNBURST,
    fingerprint,
)

pytestmark = pytest.mark.e2e

EVENTS = ("mutate", "idle_move", "busy_move", "oom_kill", "kernel_sigkill", "resize",
          "agent_restart", "user_restart")
# How often each event is drawn after every kind has had its turn.
WEIGHTS = (8, 2, 1, 1, 2, 1, 1, 1)
SETTLED = ("guaranteed", "bursting", "restored", "restore-incomplete")
KERNELSPECS = {
    # The subject: a lease of 0.3 of a 2 GiB GPU, so 900 MiB held is a burst.
    "subject": {"gpufrac": {"request": "0.3", "limit": "1"}},
    # The reference: jupyter_client's own provisioner, no lease, no kernel hook.
    "reference": {"kernel_provisioner": {"provisioner_name": "local-provisioner"}},
}
CONFIG = (
    "c.GpuFrac.migrate_grace_period = 1\n"
    "c.GpuFrac.lease_poll_interval = 0.5\n"
    "c.GpuFrac.agent_check_interval = 0.5\n"
)


class Sequence:
    """One subject, one reference, the agent and what it takes to disturb the subject."""

    def __init__(self, agent: AgentProcess, server: Server, rng: random.Random) -> None:
        self.agent = agent
        self.server = server
        self.rng = rng
        self.subject = server.open_notebook("subject.ipynb", kernel="subject")
        self.reference = server.open_notebook("reference.ipynb", kernel="reference")
        self.restores = 0
        self.last_restore = 0.0
        self.counts: collections.Counter[str] = collections.Counter()
        self.seconds: list[float] = []

    # -- observing ---------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        return self.server.kernel_status(self.subject.kernel_id)

    def lease(self) -> dict[str, Any]:
        lease = self.status()["lease"]
        assert lease is not None, "the subject has a lease"
        return dict(lease)

    def restored_events(self) -> list[dict[str, Any]]:
        return [e for e in self.status()["events"] if e["event"] == "restored"]

    def wait_restored(self, what: str) -> dict[str, Any]:
        """The next restore of the subject, once its kernel answers and its state settled."""
        # The server keeps a kernel's last 50 events: follow them by time, not by count.
        def newer() -> dict[str, Any] | None:
            found = [e for e in self.restored_events() if e["time"] > self.last_restore]
            return found[-1] if found else None

        try:
            event = wait_for(newer, 120, f"the restore after {what}", interval=0.2)
        except AssertionError as err:
            events = [(e["event"], e["message"][:120]) for e in self.status()["events"][-6:]]
            raise AssertionError(f"{err}; last events {events}; server log:\n"
                                 f"{self.server.log_text()[-4000:]}") from None
        self.last_restore = event["time"]
        self.restores += 1
        wait_for(lambda: self.status()["state"] in SETTLED, 60, f"{what} to settle", interval=0.2)
        return event

    def check(self, step: str) -> None:
        """Both kernels' fingerprints are equal: the subject lost nothing the reference has."""
        mine = fingerprint(self.subject.ok(FINGERPRINT))
        theirs = fingerprint(self.reference.ok(FINGERPRINT))
        assert mine == theirs, f"after {step}:\nsubject:   {mine}\nreference: {theirs}"

    # -- doing -------------------------------------------------------------------------

    def seed_both(self) -> None:
        """The same generator seeds in both kernels: from here on their draws must agree."""
        seed = self.rng.randrange(2**31)
        self.both(f"import random, numpy, torch\nrandom.seed({seed})\n"
                  f"numpy.random.seed({seed})\ntorch.manual_seed({seed})")

    def both(self, code: str) -> None:
        """A completed cell: run in the subject and the reference alike."""
        self.subject.ok(code)
        self.reference.ok(code)

    def job_lease(self, request: str) -> dict[str, Any]:
        """A job without processes: placed (bin-packed) beside the subject, it is owed memory."""
        lease = self.agent.client().create_lease(client="sequence", kind="job", request=request)
        return dict(lease)

    def move(self) -> str:
        """Make the agent move the subject: a job fills its GPU, then the subject grows."""
        before = self.lease()
        job = self.job_lease("0.6")
        try:
            assert job["physical_gpu"] == before["physical_gpu"], "the job packs beside the subject"
            moved = self.agent.client().resize(before["id"], request="0.45")
            assert moved["state"] == "migrating", moved
            return str(before["physical_gpu"])
        finally:
            self.agent.client().release(job["id"])

    def settle_share(self) -> None:
        """Back to the subject's own share once it runs again (in place, no move)."""
        lease = self.lease()
        if lease["request_spec"] != "0.3":
            self.agent.client().resize(lease["id"], request="0.3")

    def step(self, event: str) -> None:
        started = time.monotonic()
        getattr(self, f"do_{event}")()
        self.check(event)
        self.seconds.append(time.monotonic() - started)
        self.counts[event] += 1

    def do_mutate(self) -> None:
        self.both(self.rng.choice(MUTATIONS))

    def do_idle_move(self) -> None:
        source = self.move()
        event = self.wait_restored("an idle move")
        assert event["ok"] is True and self.status()["gpu"]["uuid"] != source, event
        self.settle_share()

    def do_busy_move(self) -> None:
        cell = self.subject.send(CUT_OFF)
        wait_for(lambda: self.server.get("/api/kernels/" + self.subject.kernel_id)
                 ["execution_state"] == "busy", 10, "the cell to run", interval=0.05)
        source = self.move()
        reply = self.subject.wait(cell, timeout=60)
        assert reply.status == "error" and "cut off" in reply.error, reply
        event = self.wait_restored("a move during a running cell")
        assert event["ok"] is False and event["interrupted_cell"], event
        assert self.status()["gpu"]["uuid"] != source
        self.settle_share()
        # The state is as before the cut-off cell; now it runs to its end in both.
        self.check("the cut-off cell")
        self.both(CUT_OFF_DONE)

    def do_oom_kill(self) -> None:
        self.both(BURST)
        # A job packed beside the subject is owed its request: the subject's loan is reclaimed.
        owner = self.job_lease("0.65")
        try:
            event = self.wait_restored("a reclaim kill")
            kinds = [e["event"] for e in self.status()["events"]]
            assert "oom_killed" in kinds and event["ok"] is True, event
        finally:
            self.agent.client().release(owner["id"])
        self.both(UNBURST)

    def do_kernel_sigkill(self) -> None:
        pid = int(self.subject.ok("import os\nprint(os.getpid())").split()[-1])
        self.reference.ok("import os\nprint(os.getpid())")
        os.kill(pid, signal.SIGKILL)
        event = self.wait_restored("a SIGKILL of the kernel")
        assert event["ok"] is True, event

    def do_resize(self) -> None:
        assert "request is now" in self.subject.ok("%gpu request 0.3 --limit 0.9")
        self.subject.ok("%gpu request 0.3 --limit 1")

    def do_agent_restart(self) -> None:
        self.agent.kill()
        wait_for(lambda: self.status()["state"] == "agent-unreachable", 5,
                 "the lost agent to show", interval=0.1)
        self.agent.start()
        wait_for(lambda: self.status()["state"] in SETTLED, 30, "the agent to be back",
                 interval=0.2)

    def do_user_restart(self) -> None:
        # As in stock Jupyter, a restart the user asks for clears the state: both restart.
        for nb in (self.subject, self.reference):
            status, _ = self.server.api(f"/api/kernels/{nb.kernel_id}/restart", "POST")
            assert status == 200
        for nb in (self.subject, self.reference):
            wait_for(lambda nb=nb: self._answers(nb), 60, "the restarted kernel", interval=0.2)
        # Fresh kernels seed their generators from the OS: seed both again, as a notebook would.
        self.seed_both()

    @staticmethod
    def _answers(nb: Notebook) -> bool:
        try:
            return nb.run("pass", timeout=5).status == "ok"
        except (AssertionError, websocket.WebSocketTimeoutException):
            return False


def plan(rng: random.Random, steps: int) -> list[str]:
    """Every kind of event once, in a random order, then random draws by weight."""
    first = list(EVENTS)
    rng.shuffle(first)
    more = rng.choices(EVENTS, weights=WEIGHTS, k=max(0, steps - len(first)))
    # A mutation between disturbances, so each one has state to lose.
    return [e for event in first + more for e in ("mutate", event)]


@contextlib.contextmanager
def disturbable_node(tmp: Path) -> Iterator[tuple[AgentProcess, Server]]:
    """An agent that reclaims fast (a job without processes is owed, so it triggers a reclaim)
    and keeps such jobs, and a server with the subject and reference kernelspecs."""
    args = ["--poll-interval", "0.2", "--reclaim-grace", "1", "--headroom", "0.9",
            "--orphan-grace", "3600"]
    with AgentProcess(tmp / "agent", "2x2GiB", args) as agent, \
            running_server(tmp / "server", agent.socket, CONFIG, KERNELSPECS) as server:
        yield agent, server


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[AgentProcess, Server]]:
    with disturbable_node(tmp_path_factory.mktemp("sequences")) as pair:
        yield pair


def run_sequence(node: tuple[AgentProcess, Server], seed: int, steps: int,
                 report: Callable[[Sequence], None] | None = None) -> Sequence:
    agent, server = node
    seq = Sequence(agent, server, random.Random(seed))
    seq.seed_both()
    events = plan(seq.rng, steps)
    try:
        for number, event in enumerate(events, 1):
            try:
                seq.step(event)
            except BaseException as err:
                raise AssertionError(f"seed {seed}, step {number} ({event}) of "
                                     f"{events[:number]}: {err}") from err
            if report is not None and number % 50 == 0:
                report(seq)
    finally:
        for nb in (seq.subject, seq.reference):
            nb.close()
            server.api(f"/api/kernels/{nb.kernel_id}", "DELETE")
    return seq


@pytest.mark.parametrize("seed", [1, 2])
def test_random_sequences_keep_the_notebook_whole(
    node: tuple[AgentProcess, Server], seed: int
) -> None:
    seq = run_sequence(node, seed, steps=len(EVENTS))
    assert set(seq.counts) == set(EVENTS), seq.counts


def soak_figures(seq: Sequence, seed: int, seconds: float) -> str:
    """The lines `make soak` prints (and writes), from what the run measured so far."""
    total = sum(seq.counts.values())
    p90 = statistics.quantiles(seq.seconds, n=10)[-1] if len(seq.seconds) > 1 else 0.0
    return "\n".join([
        f"soak: seed {seed}, {total} steps, 0 failures, {seconds:.0f} s",
        f"soak: median step {statistics.median(seq.seconds):.2f} s, p90 {p90:.2f} s",
        "soak: " + ", ".join(f"{event} {seq.counts[event]}" for event in EVENTS),
    ]) + "\n"


@pytest.mark.skipif(not os.environ.get("GPUFRAC_SOAK_STEPS"), reason="make soak runs it")
def test_soak(node: tuple[AgentProcess, Server]) -> None:
    steps = int(os.environ["GPUFRAC_SOAK_STEPS"])
    seed = int(os.environ.get("GPUFRAC_SOAK_SEED", "1000"))
    figures = os.environ.get("GPUFRAC_SOAK_FIGURES")
    started = time.monotonic()

    def progress(seq: Sequence) -> None:
        text = soak_figures(seq, seed, time.monotonic() - started)
        print(text, file=sys.stderr, end="")
        if figures:
            Path(figures).write_text(text)  # a long run that is stopped still says how far it got

    progress(run_sequence(node, seed, steps, report=progress))
