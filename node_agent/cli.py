"""gpufrac-agent: serve | status | run | demo."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import fcntl
import grp
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from node_agent.client import AgentClient, AgentError, AgentUnavailable, default_socket_path
from node_agent.quantities import QuantityError, format_bytes, parse_quantity

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


def cmd_serve(args: argparse.Namespace) -> int:
    # Imported here: `status` and `run` should start fast and need none of this.
    from node_agent.api import listen_unix, make_app
    from node_agent.devices import BackendUnavailable, open_backend
    from node_agent.ledger import Ledger
    from node_agent.service import Agent, AgentConfig

    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
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
    except (BackendUnavailable, QuantityError) as exc:
        print(f"gpufrac-agent: {exc}", file=sys.stderr)
        return 2
    lock = _lock_state_dir(args.state_dir)
    ledger = Ledger(args.state_dir)
    config = AgentConfig(
        poll_interval=args.poll_interval, reclaim_grace=args.reclaim_grace,
        migrate_grace=args.migrate_grace, orphan_grace=args.orphan_grace, headroom=args.headroom,
        restore_grace=args.restore_grace, kill_window=args.kill_window,
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
                 len(agent.gpus), kind, args.socket, args.state_dir, len(ledger.leases))
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
STATUS_GPU_KEYS = ("uuid", "index", "name", "memory_total", "memory_used")
STATUS_LEASE_KEYS = ("id", "kind", "owner_uid", "request", "limit", "usage", "logical_gpu",
                     "physical_gpu", "state")


def status_document(client: AgentClient) -> dict[str, Any]:
    """The stable `status --json` document: only the documented keys, bytes as integers."""
    node = client.node()
    leases = client.leases()
    return {
        "gpus": [{k: g[k] for k in STATUS_GPU_KEYS} for g in node["gpus"]],
        "leases": [{k: lease[k] for k in STATUS_LEASE_KEYS} for lease in leases],
    }


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
                     for r in rows)


def render_status(node: dict[str, Any], leases: list[dict[str, Any]]) -> str:
    index = {g["uuid"]: g["index"] for g in node["gpus"]}

    def gpu(uuid: str | None) -> str:
        return "-" if uuid is None else str(index.get(uuid, uuid))

    title = "simulated node" if node["simulated"] else "node (NVML)"
    gpu_rows = [["GPU", "NAME", "USED", "TOTAL", "UUID"]] + [
        [str(g["index"]), g["name"], format_bytes(g["memory_used"]),
         format_bytes(g["memory_total"]), g["uuid"] + ("" if g["healthy"] else f"  ({g['error']})")]
        for g in node["gpus"]
    ]
    out = [f"{title}: {len(node['gpus'])} GPU(s)", _table(gpu_rows), ""]
    if not leases:
        out.append("no leases")
        return "\n".join(out)
    lease_rows = [["LEASE", "OWNER", "KIND", "REQUEST", "LIMIT", "USAGE", "LOGICAL", "PHYSICAL",
                   "STATE"]]
    for lease in leases:
        state = lease["state"]
        if state == "active" and lease["bursting"]:
            state = "active, bursting"
        physical = ",".join(gpu(u) for u in lease["physical_gpus"])
        if lease["target_gpus"]:
            physical += " -> " + ",".join(gpu(u) for u in lease["target_gpus"])
        lease_rows.append([
            lease["id"], str(lease["owner_uid"]), lease["kind"], format_bytes(lease["request"]),
            format_bytes(lease["limit"]), format_bytes(lease["usage"]),
            ",".join(gpu(u) for u in lease["logical_gpus"]), physical, state,
        ])
    out.append(_table(lease_rows))
    return "\n".join(out)


def cmd_status(args: argparse.Namespace) -> int:
    client = AgentClient(args.socket)
    if args.json:
        print(json.dumps(status_document(client), indent=2))
    else:
        print(render_status(client.node(), client.leases()))
    return 0


# --- run --------------------------------------------------------------------------------
def _say(started: float, text: str) -> None:
    print(f"gpufrac-agent run: [{time.monotonic() - started:4.1f}s] {text}", file=sys.stderr,
          flush=True)


T = TypeVar("T")


def _through_restarts(call: Callable[[], T], what: str, timeout: float = 60.0) -> T:
    """``call()``, waiting out an agent that restarts meanwhile (its ledger keeps the leases)."""
    deadline = time.monotonic() + timeout
    delay = 0.1
    while True:
        try:
            return call()
        except AgentUnavailable as exc:
            if time.monotonic() >= deadline:
                raise
            if delay == 0.1:
                print(f"gpufrac-agent run: the agent does not answer ({exc.reason}) while "
                      f"{what}; waiting for it", file=sys.stderr, flush=True)
            time.sleep(delay)
            delay = min(delay * 2, 2.0)


def _ask(client: AgentClient, args: argparse.Namespace, request: str, name: str) -> str:
    """A job lease with this process registered to it (if we die, the agent frees it).

    A lease created just before the agent died, whose answer was lost, has no process and is
    released by the agent after its orphan grace.
    """
    lease = _through_restarts(lambda: client.create_lease(
        client=f"gpufrac-run-{os.getpid()}", kind="job", request=request, limit=args.limit,
        devices=args.gpus, name=name), "asking for the lease")
    _through_restarts(lambda: client.register_pid(lease["id"], os.getpid()),
                      "registering this process")
    return str(lease["id"])


def _wait_active(
    client: AgentClient, lease_id: str, timeout: float, again: Callable[[], str]
) -> dict[str, Any]:
    """Poll the lease until it is active, printing each change of reason; deadline ``timeout``.

    An agent that restarts meanwhile is waited for (the lease is in its ledger); a lease it no
    longer has (released while it was away) is asked for again with ``again``.
    """
    deadline = time.monotonic() + timeout
    started = time.monotonic()
    shown = ""
    delay = 0.1
    while True:
        lease: dict[str, Any] | None = None
        try:
            lease = client.lease(lease_id)
        except AgentUnavailable as exc:
            if shown != "unavailable":
                shown = "unavailable"
                _say(started, f"the agent does not answer ({exc.reason}); waiting for it to come "
                     f"back: lease {lease_id} is kept in its ledger")
        except AgentError as exc:
            if exc.status != 404:
                raise
            lease_id = again()
            _say(started, f"the agent no longer had the lease; asked again: {lease_id}")
        if lease is not None:
            if lease["state"] == "active":
                return lease
            if lease["reason"] != shown:
                shown = lease["reason"]
                _say(started, shown)
        if time.monotonic() >= deadline:
            raise TimeoutError(f"lease {lease_id} not granted within {timeout:.0f}s: {shown}")
        time.sleep(delay)
        delay = 0.1 if lease is not None else min(delay * 2, 2.0)


def _release(client: AgentClient, lease_id: str, deadline_s: float = 30.0) -> None:
    """Give the lease back, waiting out an agent restart; say exactly what is left if not."""
    deadline = time.monotonic() + deadline_s
    delay = 0.2
    while True:
        try:
            client.release(lease_id)
            return
        except AgentUnavailable as exc:
            if time.monotonic() >= deadline:
                print(f"gpufrac-agent run: could not release lease {lease_id}: {exc.reason}. The "
                      "agent frees it by itself once it sees this command gone (--orphan-grace); "
                      f"or run `gpufrac-agent --socket {client.socket_path} release {lease_id}` "
                      "when it answers.", file=sys.stderr)
                return
        except AgentError as exc:
            if exc.status != 404:  # already gone is what we wanted
                print(f"gpufrac-agent run: could not release {lease_id}: {exc}", file=sys.stderr)
            return
        time.sleep(delay)
        delay = min(delay * 2, 2.0)


_GATE = (
    "import os, sys\n"
    "fd = int(sys.argv[1])\n"
    "os.read(fd, 1)\n"
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
    client = AgentClient(args.socket)
    request = args.request if args.request is not None else "1"
    for field, value in (("request", request), ("limit", args.limit)):
        if value is not None:
            try:
                parse_quantity(value, f"--{field}")
            except QuantityError as exc:
                print(f"gpufrac-agent run: {exc}", file=sys.stderr)
                return 2
    name = " ".join(command)[:200]
    lease_id = _ask(client, args, request, name)

    def again() -> str:
        nonlocal lease_id
        lease_id = _ask(client, args, request, name)
        return lease_id
    child: subprocess.Popen[bytes] | None = None

    def forward(signum: int, _frame: Any) -> None:
        if child is not None and child.poll() is None:
            child.send_signal(signum)
        else:
            raise KeyboardInterrupt

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, forward)
    try:
        lease = _wait_active(client, lease_id, args.timeout, again)
        gpus = ",".join(lease["physical_gpus"])
        print(f"gpufrac-agent run: lease {lease_id} on {gpus}", file=sys.stderr, flush=True)
        env = dict(os.environ, CUDA_VISIBLE_DEVICES=gpus, GPUFRAC_LEASE_ID=lease_id,
                   GPUFRAC_REQUEST=str(lease["request"]), GPUFRAC_LIMIT=str(lease["limit"]))
        # The command waits (in sh, before exec) until its pid is registered: one that exits
        # at once still registers, and a simulated GPU's baseline precedes its allocations.
        gate_r, gate_w = os.pipe()
        child = subprocess.Popen([sys.executable, "-c", _GATE, str(gate_r), *command], env=env,
                                 pass_fds=(gate_r,))
        os.close(gate_r)
        try:
            _through_restarts(lambda: client.register_pid(lease_id, child.pid),
                              "registering the command")
        finally:
            os.write(gate_w, b"x")
            os.close(gate_w)
        code = child.wait()
        return 128 - code if code < 0 else code
    except KeyboardInterrupt:
        return 130
    except (AgentError, TimeoutError) as exc:
        print(f"gpufrac-agent run: {exc}", file=sys.stderr)
        return 1
    finally:
        _release(client, lease_id)


def cmd_release(args: argparse.Namespace) -> int:
    AgentClient(args.socket).release(args.lease)
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
    sub = parser.add_subparsers(dest="cmd", required=True)

    serve = sub.add_parser("serve", help="run the node agent")
    serve.add_argument("--socket", default=argparse.SUPPRESS, help="Unix socket to listen on")
    serve.add_argument("--state-dir", default=default_state_dir(),
                       help="where the ledger lives (default: %(default)s)")
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
    run.add_argument("--timeout", type=float, default=600.0,
                     help="seconds to wait for the GPUs (default %(default)s)")
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
