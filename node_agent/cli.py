"""gpufrac-agent: serve | status | run | demo."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import fcntl
import functools
import grp
import json
import logging
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from node_agent.caps import framework_caps
from node_agent.client import (
    AgentClient,
    AgentError,
    AgentUnavailable,
    default_socket_path,
    personal_socket_folders,
    serve_command,
    socket_folder_problem,
)
from node_agent.quantities import QuantityError, parse_quantity
from node_agent.status import render_status, status_document

log = logging.getLogger("gpufrac.agent")


def default_state_dir() -> str:
    if os.getuid() == 0:
        return "/var/lib/gpufrac"
    base = os.environ.get("XDG_STATE_HOME") or os.path.expanduser("~/.local/state")
    return os.path.join(base, "gpufrac")


# --- serve ------------------------------------------------------------------------------
def _lock_state_dir(state_dir: str) -> int:
    os.makedirs(state_dir, mode=0o700, exist_ok=True)
    fd = os.open(os.path.join(state_dir, "agent.lock"), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise SystemExit(
            f"gpufrac-agent: another agent holds the state directory {state_dir}; "
            "stop it first or pass --state-dir"
        ) from None
    return fd


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number of at least 1, got {text}")
    return value


def _make_socket_folder(socket_path: str) -> None:
    """Create the socket's folder if missing: open to all for root's (system) agent, else
    the user's own (0700, whatever the umask)."""
    folder = os.path.dirname(os.path.abspath(socket_path))
    if os.path.isdir(folder):
        return
    mode = 0o755 if os.geteuid() == 0 and folder not in personal_socket_folders() else 0o700
    os.makedirs(folder, mode=mode, exist_ok=True)
    os.chmod(folder, mode)


def cmd_serve(args: argparse.Namespace) -> int:
    # Imported here: `status` and `run` should start fast and need none of this.
    from node_agent.api import listen_unix, make_app
    from node_agent.devices import BackendUnavailable, open_backend
    from node_agent.ledger import Ledger
    from node_agent.service import Agent, AgentConfig

    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    state_dir = args.state_dir or default_state_dir()
    _make_socket_folder(args.socket)
    problem = socket_folder_problem(args.socket)
    if problem:
        print(f"gpufrac-agent: refusing --socket {args.socket}: {problem}", file=sys.stderr)
        return 2
    if AgentClient(args.socket, timeout=2).ping():
        print(f"gpufrac-agent: an agent already answers at {args.socket}", file=sys.stderr)
        return 1
    admin_gid = None
    if args.admin_group:
        try:
            admin_gid = grp.getgrnam(args.admin_group).gr_gid
        except KeyError:
            print(f"gpufrac-agent: --admin-group: no group {args.admin_group!r}", file=sys.stderr)
            return 2
    token = None
    if args.tcp:
        if not args.token_file:
            print("gpufrac-agent: --tcp needs --token-file: TCP is never served without a token",
                  file=sys.stderr)
            return 2
        token = Path(args.token_file).read_text().strip()
        if len(token) < 16:
            print("gpufrac-agent: --token-file: the token must be at least 16 characters",
                  file=sys.stderr)
            return 2
    try:
        backend = open_backend(args.simulate, args.fallback_simulate)
    except BackendUnavailable as exc:
        print(f"gpufrac-agent: {exc}: "
              f"`{serve_command(args.socket, state_dir)} --simulate 2x16GiB`", file=sys.stderr)
        return 2
    except QuantityError as exc:
        print(f"gpufrac-agent: {exc}", file=sys.stderr)
        return 2
    context_size = None
    if args.context_size is not None:
        try:
            context_size = parse_quantity(args.context_size, "context-size").nbytes
        except QuantityError as exc:
            print(f"gpufrac-agent: {exc}", file=sys.stderr)
            return 2
        if context_size is None:
            print("gpufrac-agent: --context-size must be a memory size such as 500Mi, got "
                  f"{args.context_size!r}", file=sys.stderr)
            return 2
    lock = _lock_state_dir(state_dir)
    ledger = Ledger(state_dir)
    config = AgentConfig(
        poll_interval=args.poll_interval, reclaim_grace=args.reclaim_grace,
        migrate_grace=args.migrate_grace, orphan_grace=args.orphan_grace, headroom=args.headroom,
        restore_grace=args.restore_grace, kill_window=args.kill_window, context_size=context_size,
        enforce_limits=args.enforce_limits, max_leases_per_user=args.max_leases_per_user,
        node_scheduler=args.node_scheduler, max_workloads_per_gpu=args.max_workloads_per_gpu,
    )
    agent = Agent(backend, ledger, config)

    async def main() -> None:
        await agent.start()
        app = make_app(agent, admin_gid, token)
        server = listen_unix(app, args.socket)
        if args.tcp:
            host, _, port = args.tcp.rpartition(":")
            server.listen(int(port), host or "127.0.0.1")
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        kind = "simulated node " + getattr(backend, "spec", "") if backend.simulated else "NVML"
        log.info("serving %d GPU(s) (%s) on %s, state in %s, %d lease(s) re-adopted",
                 len(agent.gpus), kind, args.socket, state_dir, len(ledger.leases))
        print(f"gpufrac-agent: ready on {args.socket}", flush=True)
        await stop.wait()
        server.stop()
        await agent.stop()

    try:
        asyncio.run(main())
    finally:
        ledger.close()
        backend.close()
        os.close(lock)
        with contextlib.suppress(OSError):
            os.unlink(args.socket)
    return 0


# --- status -----------------------------------------------------------------------------
def cmd_status(args: argparse.Namespace) -> int:
    client = AgentClient(args.socket, state_dir=args.state_dir)
    if args.json:
        print(json.dumps(status_document(client), indent=2))
    else:
        print(render_status(client.node(), client.leases()))
    return 0


# --- run --------------------------------------------------------------------------------
class _Stopped(Exception):
    """SIGINT, SIGTERM or SIGHUP reached `run` while no command of its own was running."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class _Progress:
    """Progress lines on stderr, stamped with the seconds since `run` started."""

    def __init__(self) -> None:
        self.started = time.monotonic()
        self._key = ""
        self._said = 0.0

    def say(self, text: str) -> None:
        print(f"gpufrac-agent run: [{time.monotonic() - self.started:4.1f}s] {text}",
              file=sys.stderr, flush=True)

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

    def __init__(self, client: AgentClient, args: argparse.Namespace, request: str,
                 name: str) -> None:
        self.client = client
        self.args = args
        self.request = request
        self.name = name
        self.id: str | None = None
        self.progress = _Progress()
        self.deadline = time.monotonic() + args.timeout

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
                limit=self.args.limit, devices=self.args.gpus, name=self.name,
                compute_request=self.args.compute),
                "asking for a lease")
            self.id = lease_id = str(lease["id"])
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
                    f"{time.monotonic() - down:.0f}s; waiting for it to come back: lease "
                    f"{self.id} is kept in its ledger", every=10)
            except AgentError as exc:
                if exc.status != 404:
                    raise
                self.progress.say(f"the agent no longer has lease {self.id}; asking again")
                self.ask()
                continue
            if lease is not None:
                down = 0.0
                if lease["state"] == "active":
                    return lease
                self.progress.note(lease["reason"], lease["reason"])
            now = time.monotonic()
            if now >= self.deadline:
                raise TimeoutError(f"lease {self.id} not granted within {self.args.timeout:g}s")
            time.sleep(min(delay, self.deadline - now))
            delay = 0.1 if lease is not None else min(delay * 2, _MAX_DELAY)

    def release(self) -> None:
        """Give the lease back, retrying through an agent restart until --release-timeout; if
        it cannot, say which lease is left and the exact command that releases it."""
        if self.id is None:
            return
        deadline = time.monotonic() + self.args.release_timeout
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
                                       f"{self.args.release_timeout:g}s", every=10)
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


def cmd_run(args: argparse.Namespace) -> int:
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        print("gpufrac-agent run: give the command after --, e.g. run --gpus 1 -- python train.py",
              file=sys.stderr)
        return 2
    request = args.request if args.request is not None else "1"
    for field, value in (("request", request), ("limit", args.limit)):
        if value is not None:
            try:
                parse_quantity(value, f"--{field}")
            except QuantityError as exc:
                print(f"gpufrac-agent run: {exc}", file=sys.stderr)
                return 2
    job = _Lease(AgentClient(args.socket, state_dir=args.state_dir), args, request,
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
        print(f"gpufrac-agent run: lease {lease_id} on {gpus}", file=sys.stderr, flush=True)
        env = dict(os.environ, CUDA_VISIBLE_DEVICES=gpus, GPUFRAC_LEASE_ID=lease_id,
                   GPUFRAC_REQUEST=str(lease["request"]), GPUFRAC_LIMIT=str(lease["limit"]))
        env.update(_caps(job.client, lease))
        gate_r, gate_w = os.pipe()
        child = subprocess.Popen([sys.executable, "-c", _GATE, str(gate_r), *command], env=env,
                                 pass_fds=(gate_r,))
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
        print(f"gpufrac-agent run: {exc}", file=sys.stderr)
        return 1
    finally:
        job.release()


def cmd_release(args: argparse.Namespace) -> int:
    AgentClient(args.socket, state_dir=args.state_dir).release(args.lease)
    print(f"gpufrac-agent: released {args.lease}")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from node_agent.demo import run_demo

    return run_demo(args.simulate)


# --- main -------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gpufrac-agent", description=__doc__)
    parser.add_argument("--socket", default=default_socket_path(),
                        help="the agent's Unix socket (default: %(default)s)")
    parser.add_argument("--state-dir", default=None,
                        help="the agent's state directory, named in hints to start it "
                        f"(serve's default: {default_state_dir()})")
    sub = parser.add_subparsers(dest="cmd", required=True)

    serve = sub.add_parser("serve", help="run the node agent")
    serve.add_argument("--socket", default=argparse.SUPPRESS, help="Unix socket to listen on")
    serve.add_argument("--state-dir", default=argparse.SUPPRESS,
                       help=f"where the ledger lives (default: {default_state_dir()})")
    serve.add_argument("--simulate", metavar="SPEC",
                       help="a simulated node instead of NVML, e.g. 2x16GiB or 4xH100-80GB")
    serve.add_argument("--fallback-simulate", metavar="SPEC",
                       help="use NVML when it starts, else this simulated node")
    serve.add_argument("--poll-interval", type=float, default=1.0, help="seconds between polls")
    serve.add_argument("--reclaim-grace", type=float, default=30.0,
                       help="seconds a borrower has to shrink before it is killed")
    serve.add_argument("--migrate-grace", type=float, default=120.0,
                       help="seconds a client has to move a kernel before it is killed")
    serve.add_argument("--orphan-grace", type=float, default=60.0,
                       help="seconds a lease may have no live process before it is released")
    serve.add_argument("--restore-grace", type=float, default=60.0,
                       help="seconds after a kernel comes back (restart, move) during which it is "
                       "not shrunk or killed, and afterwards reclaimed from last")
    serve.add_argument("--kill-window", type=float, default=600.0,
                       help="a lease stopped 3 or more times within this many seconds is told "
                       "so, with what to do (default %(default)s)")
    serve.add_argument("--headroom", type=float, default=0.05,
                       help="reclaim when free memory on a GPU falls below this share of it while "
                       "a lease is under its request (default %(default)s)")
    serve.add_argument("--context-size", metavar="SIZE",
                       help="what one process's CUDA context takes (a share counts it, as NVML "
                       "does); default: the simulated board's, or an estimate of 500Mi with NVML")
    serve.add_argument("--enforce-limits", action=argparse.BooleanOptionalAction, default=None,
                       help="ask a lease above its limit to shrink, then stop it (default: with "
                       "NVML; not on a simulated node, where resident memory counts)")
    serve.add_argument("--node-scheduler", action=argparse.BooleanOptionalAction, default=True,
                       help="spread burstable notebooks (limit > request) over idle GPUs and "
                            "move them back when room is needed (default on; reclaim works "
                            "either way)")
    serve.add_argument("--max-workloads-per-gpu", type=_positive_int, metavar="N",
                       help="how many leases one GPU may run at once (default: not enforced)")
    serve.add_argument("--max-leases-per-user", type=_positive_int, default=64, metavar="N",
                       help="leases one user (not an admin) may hold at once")
    serve.add_argument("--admin-group", help="members of this group see and manage all leases")
    serve.add_argument("--tcp", metavar="HOST:PORT", help="also serve TCP (needs --token-file)")
    serve.add_argument("--token-file", help="file holding the TCP token")
    serve.add_argument("--log-level", default="info", choices=["debug", "info", "warning"])
    serve.set_defaults(func=cmd_serve)

    status = sub.add_parser("status", help="GPUs and leases")
    status.add_argument("--json", action="store_true", help="the stable JSON document for scripts")
    status.set_defaults(func=cmd_status)

    run = sub.add_parser("run", help="run a command on GPUs leased for it")
    run.add_argument("--gpus", type=int, default=1, help="how many GPUs (default 1)")
    run.add_argument("--request", help="per-GPU request for a fractional job (default: whole GPU)")
    run.add_argument("--limit", help="per-GPU limit (default: the request)")
    run.add_argument("--compute", metavar="FRACTION",
                     help="share of each GPU's compute (held by CUDA MPS where it runs)")
    run.add_argument("--timeout", type=float, default=600.0,
                     help="seconds to wait for the GPUs, through agent restarts "
                     "(default %(default)s)")
    run.add_argument("--release-timeout", type=float, default=30.0,
                     help="seconds to retry giving the lease back while the agent does not "
                     "answer (default %(default)s)")
    run.add_argument("command", nargs=argparse.REMAINDER, help="-- CMD [ARGS...]")
    run.set_defaults(func=cmd_run)

    release = sub.add_parser("release", help="give a lease back (yours; root: anyone's)")
    release.add_argument("lease", help="the lease id, e.g. l-3f9a0c1b2d4e")
    release.set_defaults(func=cmd_release)

    demo = sub.add_parser("demo", help="watch placing, spreading and compacting on a simulated node")
    demo.add_argument("--simulate", default="2x16GiB", help="the simulated node (default %(default)s)")
    demo.set_defaults(func=cmd_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except AgentUnavailable as exc:
        print(f"gpufrac-agent: {exc}", file=sys.stderr)
        return 1
    except AgentError as exc:
        print(f"gpufrac-agent: {exc}", file=sys.stderr)
        return 1
