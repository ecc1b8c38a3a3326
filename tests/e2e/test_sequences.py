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
from typing import Any, NamedTuple

import pytest
import websocket

from harness.agent import AgentProcess, wait_for
from harness.jupyter import Notebook, Server, running_server
from harness.kubelet import FakeKubelet

from .sequence_cells import (
    BURST,
    CUT_OFF,
    CUT_OFF_DONE,
    FINGERPRINT,
    FINISHES,
    MUTATIONS,
    UNBURST,
    fingerprint,
)

pytestmark = pytest.mark.e2e

EVENTS = ("mutate", "idle_move", "busy_move", "finishing_move", "oom_kill", "kernel_sigkill",
          "resize", "resize_move", "agent_restart", "user_restart", "park", "pod_takes_gpu")
# How often each event is drawn after every kind has had its turn.
WEIGHTS = (8, 2, 1, 1, 1, 2, 1, 1, 1, 1, 1, 1)
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


# Waits in the kernel for the checkpoints written in the background (prints nothing).
WRITTEN = "__import__('jupyter_gpufrac.kernel', fromlist=['x'])._hook.checkpointer.flush(120)"

class Node(NamedTuple):
    """The agent, the server, and the kubelet the agent follows (as on Kubernetes); whether
    the agent freezes (a park and a reclaim keep the process) or restarts kernels."""

    agent: AgentProcess
    server: Server
    kubelet: FakeKubelet
    freezing: bool = True


class Sequence:
    """One subject, one reference, the agent and what it takes to disturb the subject."""

    def __init__(self, node: Node, rng: random.Random, label: str = "") -> None:
        self.agent, self.server, self.kubelet, self.freezing = node
        self.rng = rng
        # Notebooks of its own: a notebook's state outlives its kernel (docs/survival.md), so
        # two sequences on one node must never open the same one.
        self.subject = self.server.open_notebook(f"subject{label}.ipynb", kernel="subject")
        self.reference = self.server.open_notebook(f"reference{label}.ipynb", kernel="reference")
        self.restores = 0
        self.counts: collections.Counter[str] = collections.Counter()
        self.failures: list[tuple[int, str, str]] = []
        self.seconds: list[float] = []

    # -- observing ---------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        return self.server.kernel_status(self.subject.kernel_id)

    def lease(self) -> dict[str, Any]:
        lease = self.status()["lease"]
        assert lease is not None, "the subject has a lease"
        return dict(lease)

    def events_since(self, since: float, kind: str | None = None) -> list[dict[str, Any]]:
        """The subject's events after ``since`` (epoch seconds; server and tests share a clock)."""
        return [e for e in self.status()["events"]
                if e["time"] > since and (kind is None or e["event"] == kind)]

    def wait_restored(self, what: str, since: float, cause: str) -> dict[str, Any]:
        """The restore that follows this step's ``cause`` event, once the subject has settled.

        A step makes exactly one restart: a second ``cause`` (a kernel killed again while it
        restores, say) fails the step rather than being mistaken for the one that was meant.
        """
        def restored() -> dict[str, Any] | None:
            causes = self.events_since(since, cause)
            if not causes:
                return None
            if cause == "restored":  # a crash has no event of its own: its restore names it
                return causes[0]
            found = self.events_since(causes[0]["time"], "restored")
            return found[0] if found else None

        try:
            event = wait_for(restored, 120, f"the restore after {what}", interval=0.2)
            wait_for(lambda: self.status()["state"] in SETTLED, 60, f"{what} to settle",
                     interval=0.2)
        except AssertionError as err:
            raise AssertionError(f"{err} (no '{cause}' then 'restored' event)") from None
        again = self.events_since(since, cause)
        assert len(again) == 1, (
            f"{what}: {len(again)} '{cause}' events in one step, expected one: "
            + " | ".join(e["message"] for e in again))
        self.restores += 1
        return event

    def check(self, step: str) -> None:
        """Both kernels' fingerprints are equal: the subject lost nothing the reference has."""
        mine = fingerprint(self.subject.ok(FINGERPRINT))
        theirs = fingerprint(self.reference.ok(FINGERPRINT))
        assert mine == theirs, f"after {step}:\nsubject:   {mine}\nreference: {theirs}"

    def diagnose(self) -> str:
        """What a failure message needs: the subject's last events in full, and both logs' tails."""
        try:
            events = "\n".join(f"  {e['event']}: {e['message']}" for e in self.status()["events"][-8:])
        except Exception as err:  # a failure report must not fail itself
            events = f"  (no status: {err})"
        return (f"\nlast events of the subject:\n{events}\n--- agent log (tail) ---\n"
                f"{self.agent.log_text()[-3000:]}\n--- server log (tail) ---\n"
                f"{self.server.log_text()[-5000:]}")

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
        """A job without processes beside the subject, on the GPU the cluster planned for it (as
        KAI's would be): it is owed memory there. Bin-packing would put it there on an empty
        node; naming the GPU keeps what an earlier test left on the node out of the sequence."""
        lease = self.agent.client().create_lease(
            client="sequence", kind="job", request=request,
            logical_gpus=[self.lease()["physical_gpu"]])
        return dict(lease)

    def move(self) -> str:
        """Make the agent move the subject: a job fills its GPU, then the subject grows."""
        before = self.lease()
        job = self.job_lease("0.6")
        try:
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
        since = time.time()
        source = self.move()
        event = self.wait_restored("an idle move", since, "migrated")
        assert event["ok"] is True and self.status()["gpu"]["uuid"] != source, event
        self.settle_share()

    def do_busy_move(self) -> None:
        since = time.time()
        cell = self.subject.send(CUT_OFF)
        wait_for(lambda: self.server.get("/api/kernels/" + self.subject.kernel_id)
                 ["execution_state"] == "busy", 10, "the cell to run", interval=0.05)
        source = self.move()
        reply = self.subject.wait(cell, timeout=60)
        # Why the cell stopped comes first, before its traceback.
        assert reply.status == "error" and "cut off" in reply.traceback[0], reply
        event = self.wait_restored("a move during a running cell", since, "migrated")
        assert event["ok"] is False and event.get("interrupted_cell"), event
        assert self.status()["gpu"]["uuid"] != source
        self.settle_share()
        # The state is as before the cut-off cell; now it runs to its end in both.
        self.check("the cut-off cell")
        self.both(CUT_OFF_DONE)

    def do_park(self) -> None:
        """Parked (`%gpu park`): no GPU held; the check's cell then gets one first. Frozen,
        the very process waits; restarted, a new one restores the checkpoint."""
        since = time.time()
        assert "parking once this cell ends" in self.subject.ok("%gpu park")
        wait_for(lambda: self.lease()["state"] == "parked", 60, "the park", interval=0.1)
        assert self.lease()["physical_gpus"] == [] and self.status()["state"] == "parked"
        if self.freezing:
            pids = self.lease()["pids"]
            assert self.lease()["frozen"] and self.status()["protection"] == "frozen in host memory"
            back = self.subject.ok("pass")
            assert ", thawed (" in back and "Nothing was restarted" in back, back
            assert self.lease()["pids"] == pids and not self.lease()["frozen"]
            assert (self.status()["restore"] or {}).get("time", 0) < since, "nothing restored"
            self.settle_share()
            return
        wait_for(lambda: (self.status()["restore"] or {}).get("time", 0) > since, 60,
                 "the parked kernel's restore", interval=0.1)
        restore = self.status()["restore"]
        assert restore["ok"] is True, restore
        back = self.subject.ok("pass")
        assert "gpufrac: back on GPU" in back, back
        self.settle_share()

    def do_finishing_move(self) -> None:
        """A cell that ends within the grace period is completed: the move keeps its change."""
        since = time.time()
        cell = self.subject.send(FINISHES)
        wait_for(lambda: self.server.get("/api/kernels/" + self.subject.kernel_id)
                 ["execution_state"] == "busy", 10, "the cell to run", interval=0.05)
        source = self.move()
        reply = self.subject.wait(cell, timeout=60)
        assert reply.status == "ok", f"a cell that ends within the grace period failed: {reply}"
        self.reference.ok(FINISHES)
        event = self.wait_restored("a move while a short cell runs", since, "migrated")
        assert event["ok"] is True and not event.get("interrupted_cell"), event
        assert self.status()["gpu"]["uuid"] != source
        self.settle_share()

    def checkpoint_written(self) -> None:
        """Wait until the subject's checkpoints are on disk: they are written in the background,
        and a kill right after a cell restores the one before it (said, not silent)."""
        self.subject.ok(WRITTEN)

    def do_oom_kill(self) -> None:
        self.both(BURST)
        self.checkpoint_written()
        since = time.time()
        # A job packed beside the subject is owed its request: the subject's loan is reclaimed.
        owner = self.job_lease("0.65")
        if self.freezing:
            self._reclaim_by_freezing(since, owner)
            return
        try:
            event = self.wait_restored("a reclaim kill", since, "oom_killed")
            # While the owner holds its share, loading the loan again would only be stopped
            # again: it waits on disk, named, and nothing else is missing.
            assert event["ok"] is False and event["lost"] == [], event
            assert set(event["deferred"]) == {"big"}, event
            assert self.status()["state"] == "restore-incomplete"
        finally:
            self.agent.client().release(owner["id"])
        assert "loaded big from disk" in self.subject.ok("%gpu restore")
        self.both(UNBURST)

    def _reclaim_by_freezing(self, since: float, owner: dict[str, Any]) -> None:
        """The reclaim's last rung freezes the borrower: it waits in host memory on its own
        GPU, and thaws by itself, with everything, once the owner is gone."""
        try:
            frozen = wait_for(lambda: self.events_since(since, "frozen"), 60, "the freeze",
                              interval=0.1)[0]
            assert "Frozen to return" in frozen["message"], frozen
            assert self.lease()["frozen"] and self.status()["state"] == "waiting-for-gpu"
        finally:
            self.agent.client().release(owner["id"])
        thawed = wait_for(lambda: self.events_since(since, "unparked"), 60, "the thaw",
                          interval=0.1)[0]
        assert "thawed after" in thawed["message"], thawed
        assert not self.events_since(since, "oom_killed") and not self.events_since(
            since, "restored")
        self.both(UNBURST)

    def do_kernel_sigkill(self) -> None:
        pid = int(self.subject.ok("import os\nprint(os.getpid())").split()[-1])
        self.reference.ok("import os\nprint(os.getpid())")
        self.checkpoint_written()
        since = time.time()
        os.kill(pid, signal.SIGKILL)
        event = self.wait_restored("a SIGKILL of the kernel", since, "restored")
        assert event["ok"] is True, event

    def do_resize(self) -> None:
        """``%gpu request`` from a cell that fits: applied in place."""
        assert "guaranteed, up to" in self.subject.ok("%gpu request 0.3 --limit 0.9")
        self.subject.ok("%gpu request 0.3 --limit 1")

    def do_resize_move(self) -> None:
        """``%gpu request`` from a cell that does not fit: a move, with the variables."""
        since = time.time()
        source = self.lease()["physical_gpu"]
        job = self.job_lease("0.6")
        try:
            out = self.subject.ok("%gpu request 0.45 --limit 1")
            assert "does not fit" in out, out
            event = self.wait_restored("a %gpu request that moves the kernel", since, "migrated")
        finally:
            self.agent.client().release(job["id"])
        assert event["ok"] is True and self.status()["gpu"]["uuid"] != source, event
        assert "guaranteed, up to" in self.subject.ok("%gpu request 0.3 --limit 1")

    def do_pod_takes_gpu(self) -> None:
        """The kubelet lists a pod given the subject's GPU whole: the subject moves off with
        its variables; then the pod ends and its lease goes."""
        since = time.time()
        source = self.lease()["physical_gpu"]
        self.kubelet.hold("team", "train", [source])
        try:
            event = self.wait_restored("a pod given the subject's GPU", since, "migrated")
            assert event["ok"] is True and self.status()["gpu"]["uuid"] != source, event
            assert "team/train/main" in self.events_since(since, "migrating")[0]["message"]
        finally:
            self.kubelet.end("train")
        wait_for(lambda: not any(lease["planned_by"] == "kubelet"
                                 for lease in self.agent.client().leases()), 10,
                 "the pod's lease to go", interval=0.1)

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

    def resync(self) -> None:
        """After a failure (soak only): both kernels start again from nothing, as after a
        restart the user asks for, and the agent is back if a step left it down."""
        if self.agent.process is None or self.agent.process.poll() is not None:
            self.agent.start()
        for lease in self.agent.client().leases():
            if lease["kind"] == "job":
                self.agent.client().release(lease["id"])
        self.settle_share()
        self.do_user_restart()
        self.check("the restart after a failure")

    def close(self, *, check: bool) -> None:
        """Shut both kernels down; with ``check``, the subject's lease must go with its kernel
        (a lease left behind would skew every later placement on this node)."""
        for nb in (self.subject, self.reference):
            nb.close()
            self.server.api(f"/api/kernels/{nb.kernel_id}", "DELETE")
        if check:
            wait_for(lambda: not [x for x in self.agent.client().leases()
                                  if x["kind"] == "notebook"],
                     30, "the subject's lease to be released with its kernel", interval=0.2)

    @staticmethod
    def _answers(nb: Notebook) -> bool:
        try:
            return nb.run("pass", timeout=5).status == "ok"
        except (AssertionError, websocket.WebSocketTimeoutException):
            return False


def plan(rng: random.Random, steps: int) -> list[str]:
    """``steps`` steps: every kind of event once, in a random order, then random draws by
    weight; a mutation before each disturbance, so each one has state to lose."""
    disturbances = [e for e in EVENTS if e != "mutate"]
    first = list(disturbances)
    rng.shuffle(first)
    more = rng.choices(EVENTS, weights=WEIGHTS, k=max(0, steps // 2 - len(first)))
    return [e for event in first + more for e in ("mutate", event)]


@contextlib.contextmanager
def disturbable_node(tmp: Path, *, freezing: bool = True) -> Iterator[Node]:
    """An agent that reclaims fast (a job without processes is owed, so it triggers a reclaim)
    and keeps such jobs, following a kubelet, freezing or not; and a server with the subject
    and reference kernelspecs."""
    tmp.mkdir(parents=True, exist_ok=True)
    with FakeKubelet(tmp / "kubelet.sock") as kubelet:
        args = ["--poll-interval", "0.2", "--reclaim-grace", "1", "--headroom", "0.9",
                "--orphan-grace", "3600", "--kubelet-socket", kubelet.socket_path,
                "--kubelet-interval", "0.2", *([] if freezing else ["--no-freeze"])]
        with AgentProcess(tmp / "agent", "2x2GiB", args) as agent, \
                running_server(tmp / "server", agent.socket, CONFIG, KERNELSPECS) as server:
            yield Node(agent, server, kubelet, freezing)


# Both ways of taking a GPU from a notebook: freezing (the default where the driver can) and
# the checkpoint and restart that stands in where it cannot.
@pytest.fixture(scope="module", params=[True, False], ids=["frozen", "restarted"])
def node(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
         ) -> Iterator[Node]:
    with disturbable_node(tmp_path_factory.mktemp("sequences"), freezing=request.param) as found:
        yield found


def run_sequence(node: Node, seed: int, steps: int,
                 report: Callable[[Sequence], None] | None = None,
                 keep_going: bool = False) -> Sequence:
    """Run a planned sequence. The first failure raises, unless ``keep_going`` (the soak): then
    it is recorded in ``seq.failures``, both kernels restart from nothing and the run goes on."""
    seq = Sequence(node, random.Random(seed), label=f"-{seed}")
    seq.seed_both()
    events = plan(seq.rng, steps)
    passed = False
    try:
        for number, event in enumerate(events, 1):
            try:
                seq.step(event)
            except Exception as err:
                recent = events[max(0, number - 12):number]
                message = (f"seed {seed}, step {number} ({event}), after ...{recent}: "
                           f"{err}{seq.diagnose()}")
                if not keep_going:
                    raise AssertionError(message) from err
                seq.failures.append((number, event, str(err).splitlines()[0][:300]))
                print(f"\nFAILURE {message}\n", file=sys.stderr)
                seq.resync()
            if report is not None and number % 50 == 0:
                report(seq)
        passed = True
    finally:
        seq.close(check=passed)
    return seq


@pytest.mark.parametrize("seed", [1, 2])
def test_random_sequences_keep_the_notebook_whole(
    node: Node, seed: int
) -> None:
    seq = run_sequence(node, seed, steps=2 * len(EVENTS))
    assert set(seq.counts) == set(EVENTS), seq.counts


def soak_figures(seq: Sequence, seed: int, seconds: float) -> str:
    """The lines `make soak` prints (and writes), from what the run measured so far."""
    total = sum(seq.counts.values()) + len(seq.failures)
    times = seq.seconds or [0.0]
    p90 = statistics.quantiles(times, n=10)[-1] if len(times) > 1 else times[0]
    lines = [
        f"soak: seed {seed}, {total} steps, {len(seq.failures)} failures, {seconds:.0f} s",
        f"soak: median step {statistics.median(times):.2f} s, p90 {p90:.2f} s",
        "soak: " + ", ".join(f"{event} {seq.counts[event]}" for event in EVENTS),
    ]
    lines += [f"soak: failed step {n} ({event}): {why}" for n, event, why in seq.failures]
    return "\n".join(lines) + "\n"


@pytest.mark.skipif(not os.environ.get("GPUFRAC_SOAK_STEPS"), reason="make soak runs it")
def test_soak(node: Node) -> None:
    steps = int(os.environ["GPUFRAC_SOAK_STEPS"])
    seed = int(os.environ.get("GPUFRAC_SOAK_SEED", "1000"))
    figures = os.environ.get("GPUFRAC_SOAK_FIGURES")
    started = time.monotonic()

    def progress(seq: Sequence) -> None:
        text = soak_figures(seq, seed, time.monotonic() - started)
        print(text, file=sys.stderr, end="")
        if figures:
            Path(figures).write_text(text)  # a long run that is stopped still says how far it got

    seq = run_sequence(node, seed, steps, report=progress, keep_going=True)
    progress(seq)
    assert not seq.failures, soak_figures(seq, seed, time.monotonic() - started)
