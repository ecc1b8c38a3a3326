"""gpufrac-agent run: a command on GPUs leased for it, waiting through agent restarts."""

from __future__ import annotations

import contextlib
import functools
import math
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any, TypeVar

from traitlets import Float, Int, Unicode

from node_agent.caps import framework_caps
from node_agent.cli.command import GpuFracAgent
from node_agent.client import AgentClient, AgentError, AgentUnavailable, UnsafeSocket
from node_agent.quantities import QuantityError, parse_quantity
from node_agent.waiting import made_room_words, waiting_key, waiting_words


class _Stopped(Exception):
    """SIGINT, SIGTERM or SIGHUP reached `run` while no command of its own was running."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


# While waiting, a changing line is shown again this often (seconds): on a terminal in place,
# elsewhere as a new line, since a log has room for one only every few seconds.
_REDRAW = 1.0
_REPEAT = 5.0


class _Progress:
    """Progress lines on stderr, stamped with the seconds since `run` started."""

    def __init__(self) -> None:
        self.started = time.monotonic()
        self.tty = sys.stderr.isatty()
        self._key = ""
        self._said = 0.0
        self._live = False  # a line shown in place on the terminal, not yet ended
        self._rows = 1  # the terminal rows it took, wrapped: all are rewritten

    def _stamped(self, text: str) -> str:
        return f"gpufrac-agent run: [{time.monotonic() - self.started:4.1f}s] {text}"

    def done(self) -> None:
        """End the line shown in place, so that what follows starts on a line of its own."""
        if self._live:
            print(file=sys.stderr, flush=True)
            self._live = False

    def say(self, text: str) -> None:
        self.done()
        print(self._stamped(text), file=sys.stderr, flush=True)

    def show(self, key: str, text: str) -> None:
        """A line that changes as time passes (a countdown), and its ``key`` when something
        else changes: on a terminal rewritten in place every second, elsewhere a new line at
        each change of ``key`` and every few seconds."""
        if not self.tty:
            self.note(key, text, every=_REPEAT)
            return
        now = time.monotonic()
        if key == self._key and now - self._said < _REDRAW:
            return
        self._key, self._said = key, now
        line = self._stamped(text)
        # Back to the first of the rows the last one wrapped onto, cleared to the end.
        up = f"\x1b[{self._rows - 1}A" if self._live and self._rows > 1 else ""
        sys.stderr.write(f"\r{up}\x1b[J{line}")
        sys.stderr.flush()
        width = 0
        with contextlib.suppress(OSError):  # no size known: taken as one row
            width = os.get_terminal_size(sys.stderr.fileno()).columns
        self._rows = math.ceil(len(line) / width) if width else 1
        self._live = True

    def note(self, key: str, text: str, every: float | None = None) -> None:
        """Say ``text`` when ``key`` changes, and again every ``every`` s while it does not."""
        now = time.monotonic()
        if key != self._key or (every is not None and now - self._said >= every):
            self._key, self._said = key, now
            self.say(text)


T = TypeVar("T")

# Retries back off from 0.1 s up to this.
_MAX_DELAY = 2.0


class _Lease:
    """The job lease of one `run`: asked for, waited for through agent restarts, and always
    given back."""

    def __init__(self, client: AgentClient, options: RunApp, request: str,
                 name: str) -> None:
        self.client = client
        self.options = options
        self.request = request
        self.name = name
        self.id: str | None = None
        self.progress = _Progress()
        self.deadline = time.monotonic() + options.timeout
        # What the lease waited for when last asked, in words (the agent's reason, or its
        # leases that make room): said again if --timeout passes.
        self.waiting = ""
        # The leases moved, frozen or parked for it, as last seen: said once it runs.
        self.making_room: list[dict[str, Any]] = []

    def through_restarts(self, call: Callable[[], T], what: str) -> T:
        """``call()``, waiting out an agent that is down or restarting until the deadline."""
        delay = 0.1
        down = time.monotonic()
        while True:
            try:
                return call()
            except AgentUnavailable as exc:
                now = time.monotonic()
                if now >= self.deadline:
                    raise
                self.progress.note("down", f"{exc}. Waiting for it while {what} "
                                   f"({now - down:.0f}s so far, up to --timeout)", every=10)
                time.sleep(min(delay, self.deadline - now))
                delay = min(delay * 2, _MAX_DELAY)

    def ask(self) -> None:
        """A job lease with this process registered to it: if `run` dies, the agent frees it.

        A lease created just before the agent died, whose answer was lost (or one that signals
        cut off before its id arrived) has no process: the agent releases it after its orphan
        grace.
        """
        while True:
            lease = self.through_restarts(lambda: self.client.create_lease(
                client=f"gpufrac-run-{os.getpid()}", kind="job", request=self.request,
                limit=self.options.limit, devices=self.options.gpus, name=self.name,
                compute_request=self.options.compute),
                "asking for a lease")
            self.id = lease_id = str(lease["id"])
            # The agent's first answer names what it does to make room; a freeze of a moment
            # may be over by the first poll.
            self.making_room = list(lease.get("waiting_for") or [])
            try:
                self.through_restarts(
                    functools.partial(self.client.register_pid, lease_id, os.getpid()),
                    "registering this process")
                return
            except AgentError as exc:
                # Released while the agent was away (an orphan then): ask again.
                if exc.status != 404 or time.monotonic() >= self.deadline:
                    raise
                self.progress.say(f"the agent no longer has lease {lease_id}; asking again")

    def wait_active(self) -> dict[str, Any]:
        """Poll the lease until it is active, saying each change of reason, until the deadline.

        An agent that restarts meanwhile is waited for (the lease is in its ledger); a lease it
        no longer has (released while it was away) is asked for again.
        """
        assert self.id is not None
        delay = 0.1
        down = 0.0
        while True:
            lease: dict[str, Any] | None = None
            try:
                lease = self.client.lease(self.id)
            except AgentUnavailable as exc:
                down = down or time.monotonic()
                self.progress.note(
                    "down", f"the agent does not answer ({exc.reason}) for "
                    f"{time.monotonic() - down:.0f}s; waiting for it to come back: this "
                    "command's lease is kept in its ledger", every=10)
            except AgentError as exc:
                if exc.status != 404:
                    raise
                self.progress.say(f"the agent no longer has lease {self.id}; asking again")
                self.ask()
                continue
            if lease is not None:
                down = 0.0
                if lease["state"] == "active":
                    if self.making_room:
                        self.progress.say(made_room_words(self.making_room))
                    self.progress.done()
                    return lease
                making_room = lease.get("waiting_for") or []
                if making_room:
                    self.making_room = list(making_room)
                self.waiting = (waiting_words(making_room, time.time()) if making_room
                                else str(lease["reason"]))
                self.progress.show(waiting_key(making_room) if making_room else self.waiting,
                                   self.waiting)
            now = time.monotonic()
            if now >= self.deadline:
                self.progress.done()
                raise TimeoutError(
                    f"lease {self.id} not granted within {self.options.timeout:g}s"
                    + (f"; it was {self.waiting}" if self.waiting else "")
                    + ". Give it longer with --timeout; `gpufrac-agent status` shows the node")
            time.sleep(min(delay, self.deadline - now))
            delay = 0.1 if lease is not None else min(delay * 2, _MAX_DELAY)

    def release(self) -> None:
        """Give the lease back, retrying through an agent restart until --release-timeout; if
        it cannot, say which lease is left and the exact command that releases it."""
        if self.id is None:
            return
        deadline = time.monotonic() + self.options.release_timeout
        delay = 0.2
        try:
            while True:
                try:
                    self.client.release(self.id)
                    return
                except AgentUnavailable as exc:
                    now = time.monotonic()
                    if now >= deadline:
                        self._left(f"the agent does not answer: {exc.reason}")
                        return
                    self.progress.note("down", f"the agent does not answer ({exc.reason}); "
                                       f"retrying to release lease {self.id} for up to "
                                       f"{self.options.release_timeout:g}s", every=10)
                    time.sleep(min(delay, deadline - now))
                    delay = min(delay * 2, _MAX_DELAY)
                except AgentError as exc:
                    if exc.status != 404:  # already gone is what we wanted
                        self._left(str(exc))
                    return
        except _Stopped:
            self._left("stopped while releasing it")

    def _left(self, why: str) -> None:
        command = shlex.join(["gpufrac-agent", "--socket", self.client.socket_path, "release",
                              str(self.id)])
        print(f"gpufrac-agent run: lease {self.id} is left on the agent ({why}). Release it with "
              f"`{command}` once the agent answers; the agent also releases it by itself "
              "--orphan-grace seconds after it sees that this command has ended.",
              file=sys.stderr, flush=True)


def _caps(client: AgentClient, lease: dict[str, Any]) -> dict[str, str]:
    """JAX, CuPy, TensorFlow and MPS capped at the lease's limit, as in a kernel."""
    uuids = list(lease["physical_gpus"])
    gpu: dict[str, Any] = {}
    with contextlib.suppress(AgentError):  # without the GPU's size, fewer caps; it still runs
        gpu = next((g for g in client.node()["gpus"] if g["uuid"] in uuids), {})
    return framework_caps(int(lease["limit"]), int(gpu.get("context_size") or 0),
                          gpu.get("memory_total"), len(uuids), lease.get("compute_limit"))


# The command waits for one byte on a pipe before it execs: its pid is registered first (one
# that exits at once still registers; a simulated GPU's baseline precedes its allocations),
# and it never runs without its lease.
_GATE = (
    "import os, sys\n"
    "fd = int(sys.argv[1])\n"
    "if os.read(fd, 1) != b'x':\n"
    "    os._exit(1)\n"
    "os.close(fd)\n"
    "try:\n"
    "    os.execvp(sys.argv[2], sys.argv[2:])\n"
    "except OSError as exc:\n"
    "    sys.exit(f'gpufrac-agent run: cannot run {sys.argv[2]!r}: {exc.strerror}')\n"
)


class RunApp(GpuFracAgent):
    name = "gpufrac-agent run"
    description = """Run a command on GPUs leased for it.

    gpufrac-agent run [options] -- CMD [ARGS...]

    The lease is asked for (waiting through agent restarts up to --timeout), the command runs
    with CUDA_VISIBLE_DEVICES and the caps of the lease, and the lease is given back when it
    ends. While notebooks are moved, frozen or parked to make room, a progress line names
    them with the seconds left until each move is done at the latest.

    Exit status: the command's once it ran; 1 when it never ran because no lease was granted
    (the agent refused it at once, saying why: nothing it may move, freeze or park makes
    room, or the share cannot fit any GPU; or --timeout passed, saying what it waited for;
    or no agent answered); 2 for a usage error; 128+N when signal N stopped it first."""
    examples = """
gpufrac-agent run --gpus 1 -- python train.py
gpufrac-agent run --request 0.25 --limit 0.5 --compute 0.3 -- python infer.py
"""

    gpus = Int(1, min=1, help="How many GPUs.").tag(config=True)
    request = Unicode(None, allow_none=True,
                      help="Per-GPU request for a fractional job, a fraction or a size such as "
                      "4Gi (default: the whole GPU).").tag(config=True)
    limit = Unicode(None, allow_none=True,
                    help="Per-GPU limit (default: the request).").tag(config=True)
    compute = Unicode(None, allow_none=True,
                      help="Share of each GPU's compute, a fraction (held by CUDA MPS where it "
                      "runs).").tag(config=True)
    timeout = Float(600.0, min=0, help="Seconds to wait for the GPUs, through agent restarts.",
                    ).tag(config=True)
    release_timeout = Float(30.0, min=0,
                            help="Seconds to retry giving the lease back while the agent does "
                            "not answer.").tag(config=True)

    aliases = {**GpuFracAgent.aliases,
               **{flag: f"RunApp.{flag.replace('-', '_')}" for flag in (
                   "gpus", "request", "limit", "compute", "timeout", "release-timeout")}}

    def execute(self) -> int:
        command = self.extra_args
        if not command:
            print("gpufrac-agent run: give the command after --, e.g. run --gpus 1 -- python "
                  "train.py", file=sys.stderr)
            return 2
        request = self.request if self.request is not None else "1"
        for field, value in (("request", request), ("limit", self.limit)):
            if value is not None:
                try:
                    parse_quantity(value, f"--{field}", several="--gpus {n}")
                except QuantityError as exc:
                    print(f"gpufrac-agent run: {exc}", file=sys.stderr)
                    return 2
        job = _Lease(AgentClient(self.socket, state_dir=self.state_dir), self, request,
                     " ".join(command)[:200])
        child: subprocess.Popen[bytes] | None = None

        def on_signal(signum: int, _frame: Any) -> None:
            if child is not None and child.poll() is None:
                child.send_signal(signum)
            else:
                raise _Stopped(signum)

        # Before the lease is asked for: a signal at any point after it leads to its release.
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, on_signal)
        try:
            job.ask()
            lease = job.wait_active()
            lease_id = str(lease["id"])
            gpus = ",".join(lease["physical_gpus"])
            # GPUs named as the panel and `status` name them (the UUIDs are in the command's
            # CUDA_VISIBLE_DEVICES; the lease's id in `status --json`).
            index = {g.get("uuid"): g.get("index") for g in job.client.node().get("gpus", [])}
            named = [f"GPU {index[u]}" if index.get(u) is not None else u
                     for u in lease["physical_gpus"]]
            on = named[0] if len(named) == 1 else f"{', '.join(named[:-1])} and {named[-1]}"
            job.progress.say(f"running on {on}")
            env = dict(os.environ, CUDA_VISIBLE_DEVICES=gpus, GPUFRAC_LEASE_ID=lease_id,
                       GPUFRAC_REQUEST=str(lease["request"]), GPUFRAC_LIMIT=str(lease["limit"]))
            env.update(_caps(job.client, lease))
            gate_r, gate_w = os.pipe()
            child = subprocess.Popen([sys.executable, "-c", _GATE, str(gate_r), *command],
                                     env=env, pass_fds=(gate_r,))
            os.close(gate_r)
            try:
                pid = child.pid
                job.through_restarts(lambda: job.client.register_pid(lease_id, pid),
                                     "registering the command")
                with contextlib.suppress(BrokenPipeError):  # a forwarded signal ended it already
                    os.write(gate_w, b"x")
            finally:
                os.close(gate_w)  # unopened: the command exits without running
            code = child.wait()
            return 128 - code if code < 0 else code
        except _Stopped as stop:
            job.progress.say(f"stopped by {stop}; giving the lease back")
            return 128 + stop.signum
        except (AgentError, TimeoutError) as exc:
            job.progress.done()
            print(f"gpufrac-agent run: {exc}", file=sys.stderr)
            if isinstance(exc, (AgentUnavailable, UnsafeSocket)):
                print(self.socket_note(), file=sys.stderr)
            return 1
        finally:
            job.release()
