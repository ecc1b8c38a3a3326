"""gpufrac-agent serve: run the node agent on its socket (and TCP), with its settings as options."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import fcntl
import grp
import logging
import os
import signal
import stat
import sys

from traitlets import Bool, CaselessStrEnum, Enum, Float, Int, List, Unicode, Union
from traitlets.config import boolean_flag

from node_agent.cli.command import GpuFracAgent, UsageError, default_state_dir
from node_agent.client import AgentClient, personal_socket_folders, serve_command, socket_folder_problem
from node_agent.devices.freezing import FREEZERS
from node_agent.kubelet.claims import GPU_RESOURCE, RESERVATION_NAMESPACES
from node_agent.quantities import QuantityError, parse_size
from node_agent.service import AgentConfig

log = logging.getLogger("gpufrac.agent")


# The agent's settings are AgentConfig's; its defaults are the only ones.
_AGENT = AgentConfig()


async def _stop_without_parent(parent: int, stop: asyncio.Event) -> None:
    """Set ``stop`` once the parent is gone (the child is then re-parented), however it ended:
    a server killed, or stopped before it could stop us."""
    while not stop.is_set():
        if os.getppid() != parent:
            log.info("the process that started this agent (pid %d) is gone: stopping", parent)
            stop.set()
            return
        await asyncio.sleep(1.0)


def _size(size: int | str | None, flag: str) -> int | None:
    """A size option given as bytes or a quantity such as 500Mi."""
    if size is None or isinstance(size, int):
        return size
    try:
        return parse_size(size, flag)
    except QuantityError as exc:
        raise UsageError(str(exc)) from None


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


def _make_socket_folder(socket_path: str) -> None:
    """Create the socket's folder if missing: open to all for root's (system) agent, else
    the user's own (0700, whatever the umask)."""
    folder = os.path.dirname(os.path.abspath(socket_path))
    if os.path.isdir(folder):
        return
    mode = 0o755 if os.geteuid() == 0 and folder not in personal_socket_folders() else 0o700
    os.makedirs(folder, mode=mode, exist_ok=True)
    os.chmod(folder, mode)


def read_token_file(path: str) -> tuple[str, str | None]:
    """The TCP token in ``path``, and what is wrong with the file (None: nothing): it must be
    a regular file, not a link, of the agent's own user, that nobody else may read or write."""
    fix = f"it must be a regular file of uid {os.geteuid()} that only it can read: `chmod 600 {path}`"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return "", f"it is a symbolic link; {fix} (not a link to one)"
        return "", f"cannot open it ({exc.strerror}); {fix}"
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            return "", f"it is not a regular file; {fix}"
        if info.st_uid != os.geteuid():
            return "", f"it belongs to uid {info.st_uid}, not the agent's; {fix} after " \
                       f"`chown {os.geteuid()} {path}`"
        if info.st_mode & 0o077:
            return "", f"its mode {stat.S_IMODE(info.st_mode):04o} lets others read or change it; {fix}"
        with os.fdopen(os.dup(fd), "rb") as f:
            return f.read(4096).decode("utf-8", "replace").strip(), None
    finally:
        os.close(fd)


def _tcp_address(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    if not port.isdigit() or int(port) > 65535:
        raise UsageError(f"--tcp: expected HOST:PORT such as 127.0.0.1:9410, got {text!r}")
    return host or "127.0.0.1", int(port)


class ServeApp(GpuFracAgent):
    name = "gpufrac-agent serve"
    description = """Run the node agent: it leases GPU shares over its Unix socket.

    It uses NVML when that starts (run it as root on a real node); --simulate describes a node
    without one."""
    examples = """
gpufrac-agent serve --simulate 2x16GiB
gpufrac-agent serve --socket /run/gpufrac/agent.sock --admin-group gpu-admins
"""

    simulate = Unicode(None, allow_none=True,
                       help="A simulated node instead of NVML, e.g. 2x16GiB or 4xH100-80GB.",
                       ).tag(config=True)
    fallback_simulate = Unicode(None, allow_none=True,
                                help="Use NVML when it starts, else this simulated node.",
                                ).tag(config=True)
    poll_interval = Float(_AGENT.poll_interval, min=0.01, max=3600,
                          help="Seconds between polls of the GPUs.").tag(config=True)
    reclaim_grace = Float(_AGENT.reclaim_grace, min=0,
                          help="Seconds a borrower has to shrink before it is killed.",
                          ).tag(config=True)
    migrate_grace = Float(_AGENT.migrate_grace, min=0,
                          help="Seconds a client has to move a kernel before it is killed.",
                          ).tag(config=True)
    orphan_grace = Float(_AGENT.orphan_grace, min=0,
                         help="Seconds a lease may have no live process before it is released.",
                         ).tag(config=True)
    restore_grace = Float(_AGENT.restore_grace, min=0,
                          help="Seconds after a kernel comes back (restart, move) during which "
                          "it is not shrunk or killed, and afterwards reclaimed from last.",
                          ).tag(config=True)
    kill_window = Float(_AGENT.kill_window, min=0,
                        help="A lease stopped 3 or more times within this many seconds is told "
                        "so, with what to do.").tag(config=True)
    headroom = Float(_AGENT.headroom, min=0, max=1,
                     help="Reclaim when free memory on a GPU falls below this share of it while "
                     "a lease is under its request.").tag(config=True)
    context_size = Union(
        [Int(min=0), Unicode()], default_value=_AGENT.context_size, allow_none=True,
        help="What one process's CUDA context takes (a share counts it, as NVML does), as a "
        "size such as 500Mi or bytes. Default: the simulated board's, or an estimate of "
        "500Mi with NVML.",
    ).tag(config=True, expect="a memory size such as 500Mi")
    enforce_limits = Bool(
        _AGENT.enforce_limits, allow_none=True,
        help="Ask a lease above its limit to shrink, then stop it. Default (None): with NVML; "
        "not on a simulated node, where resident memory counts.",
    ).tag(config=True)
    node_scheduler = Bool(
        _AGENT.node_scheduler,
        help="Spread burstable notebooks (limit > request) over idle GPUs and move them back "
        "when room is needed (reclaim works either way).",
    ).tag(config=True)
    max_workloads_per_gpu = Int(
        _AGENT.max_workloads_per_gpu, allow_none=True, min=1,
        help="How many leases one GPU may run at once (None: not enforced).",
    ).tag(config=True)
    freeze = Bool(
        _AGENT.freeze,
        help="Freeze a notebook's processes (the CUDA driver keeps their GPU memory and context "
        "in their host memory; nothing restarts) to park it, reclaim from it or make room for "
        "a job, wherever the driver can (r570+); elsewhere kernels are checkpointed and "
        "restarted.",
    ).tag(config=True)
    freezer = CaselessStrEnum(
        FREEZERS, default_value="auto",
        help="How processes are frozen: auto (the CUDA driver's checkpoint API with NVML, the "
        "simulation on a simulated node), driver (the driver's, also beside a simulated node: "
        "for testing a real driver or a stand-in libcuda) or simulated.",
    ).tag(config=True)
    freeze_remap = Bool(
        _AGENT.freeze_remap,
        help="Move a notebook to another GPU by freezing it and thawing it there (driver r580+, "
        "GPUs of the same model): nothing restarts. Off by default: a process restricted by "
        "CUDA_VISIBLE_DEVICES, as every kernel is, has been reported to fail such a thaw; a "
        "frozen kernel then restarts on the other GPU from its checkpoint.",
    ).tag(config=True)
    thaw_wait = Float(
        _AGENT.thaw_wait, min=0,
        help="Seconds a cell may wait for its frozen kernel's GPU to have room for everything "
        "it froze; then the kernel restarts from its checkpoint within its request instead "
        "(what does not fit waits on disk).",
    ).tag(config=True)
    freeze_lock_timeout = Float(
        _AGENT.freeze_lock_timeout, min=0.1,
        help="Seconds a freeze waits for a kernel's submitted GPU work before it is tried "
        "again (--freeze-attempts in all), then given up for the fallback.",
    ).tag(config=True)
    freeze_attempts = Int(_AGENT.freeze_attempts, min=1,
                          help="Tries of a freeze whose lock timed out.").tag(config=True)
    freeze_budget = Union(
        [Int(min=0), Unicode()], default_value=_AGENT.freeze_budget, allow_none=True,
        help="Host memory frozen GPU state may take on this node, as a size such as 64Gi or "
        "bytes. Default: --freeze-budget-share of the node's RAM. Past it kernels fall back to "
        "a checkpoint and restart.",
    ).tag(config=True, expect="a memory size such as 64Gi")
    freeze_budget_per_user = Union(
        [Int(min=0), Unicode()], default_value=_AGENT.freeze_budget_per_user, allow_none=True,
        help="Host memory one user's frozen GPU state may take on this node, as a size such as "
        "16Gi or bytes. Default: half of the node's budget. Past it that user's kernels fall "
        "back to a checkpoint and restart; others' still freeze.",
    ).tag(config=True, expect="a memory size such as 16Gi")
    freeze_call_timeout = Float(
        _AGENT.freeze_call_timeout, min=0.1,
        help="Seconds a driver call may take beyond its copy (4 s per GiB it moves) and a "
        "lock's own timeout. A call that takes longer turns freezing off on this node until it "
        "returns; the agent goes on answering meanwhile.",
    ).tag(config=True)
    freeze_budget_share = Float(
        _AGENT.freeze_budget_share, min=0, max=1,
        help="The share of the node's RAM frozen GPU state may take (without --freeze-budget).",
    ).tag(config=True)
    max_leases_per_user = Int(_AGENT.max_leases_per_user, min=1,
                              help="Leases one user (not an admin) may hold at once.",
                              ).tag(config=True)
    max_bytes_per_user = Union(
        [Int(min=1), Unicode()], default_value=_AGENT.max_bytes_per_user, allow_none=True,
        help="GPU memory one user (not an admin) may reserve at once, requests summed over "
        "devices, as a size such as 160Gi or bytes. Default: no cap.",
    ).tag(config=True, expect="a memory size such as 160Gi")
    max_gpus_per_user = Int(_AGENT.max_gpus_per_user, min=1, allow_none=True,
                            help="GPUs one user (not an admin) may reserve at once, a share "
                            "counting as its part of a GPU (as Run:ai and KAI quotas count). "
                            "Default: no cap.").tag(config=True)
    admin_group = Unicode(None, allow_none=True,
                          help="Members of this group see and manage all leases.",
                          ).tag(config=True)
    tcp = Unicode(None, allow_none=True,
                  help="Also serve TCP on HOST:PORT (needs --token-file).").tag(config=True)
    exit_with_parent = Bool(False, help="Stop when the process that started the agent is gone "
                            "(a Jupyter server's embedded agent must not outlive it).",
                            ).tag(config=True)
    token_file = Unicode(None, allow_none=True,
                         help="The file holding the TCP token (16 characters or more).",
                         ).tag(config=True)
    kubelet_socket = Unicode(
        None, allow_none=True,
        help="On Kubernetes: the kubelet's PodResources socket (usually "
        "/var/lib/kubelet/pod-resources/kubelet.sock). Each container holding whole GPUs then "
        "gets a job lease pinned to them, and notebooks there move off.",
    ).tag(config=True)
    gpu_resource = List(
        Unicode(), default_value=[GPU_RESOURCE],
        help="The kubelet resources that are whole GPUs (with --kubelet-socket).",
    ).tag(config=True)
    container_logs = Unicode(
        _AGENT.container_logs,
        help="Where the kubelet links containers' logs (<pod>_<namespace>_<container>-<id>.log): "
        "with a process's cgroup they name the pod container it runs in, for /metrics and "
        "status. Absent off Kubernetes.",
    ).tag(config=True)
    reservation_namespace = List(
        Unicode(), default_value=list(RESERVATION_NAMESPACES),
        help="Namespaces of the pods that reserve a GPU for the fractional pods sharing it (KAI's "
        "binder --resource-reservation-namespace): their GPUs are not whole-GPU jobs.",
    ).tag(config=True)
    kubelet_interval = Float(2.0, min=0.01, max=3600, help="Seconds between looks at the kubelet's list of "
                             "pods' devices (its API has no watch).").tag(config=True)
    # Application's own trait, made to take lower-case names as well (traitlets turns names
    # into numbers as it applies them).
    log_level = Union(
        [CaselessStrEnum(("DEBUG", "INFO", "WARNING", "ERROR")), Enum((10, 20, 30, 40))],
        default_value="INFO", help="How much the agent logs: debug, info, warning or error.",
    ).tag(config=True, expect="debug, info, warning or error")

    aliases = {
        **GpuFracAgent.aliases,
        **{flag: f"ServeApp.{flag.replace('-', '_')}" for flag in (
            "simulate", "fallback-simulate", "poll-interval", "reclaim-grace", "migrate-grace",
            "orphan-grace", "restore-grace", "kill-window", "headroom", "context-size",
            "max-workloads-per-gpu", "max-leases-per-user", "max-bytes-per-user",
            "max-gpus-per-user", "admin-group", "tcp", "token-file",
            "log-level", "kubelet-socket", "gpu-resource", "kubelet-interval", "container-logs",
            "reservation-namespace", "freeze-lock-timeout", "freeze-attempts", "freeze-budget",
            "freeze-budget-share", "freezer", "thaw-wait", "freeze-budget-per-user",
            "freeze-call-timeout")},
    }
    flags = {
        **GpuFracAgent.flags,
        **boolean_flag("node-scheduler", "ServeApp.node_scheduler",
                       "Spread burstable notebooks over idle GPUs (the default).",
                       "Keep every notebook on its bin-packed GPU."),
        **boolean_flag("freeze", "ServeApp.freeze",
                       "Freeze notebooks' processes where the driver can (the default).",
                       "Never freeze: park and reclaim by checkpoint and restart."),
        **boolean_flag("freeze-remap", "ServeApp.freeze_remap",
                       "Move notebooks by freezing and thawing them on the other GPU (r580+).",
                       "Move notebooks by checkpoint and restart (the default)."),
        **boolean_flag("enforce-limits", "ServeApp.enforce_limits",
                       "Stop leases that stay above their limit.",
                       "Never stop a lease for its limit alone."),
        "exit-with-parent": ({"ServeApp": {"exit_with_parent": True}},
                             "Stop when the process that started the agent is gone."),
    }

    def agent_config(self) -> AgentConfig:
        """AgentConfig from these settings: every field is a trait of the same name."""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(AgentConfig)}
        return AgentConfig(**{**values, "context_size": _size(self.context_size, "--context-size"),
                              "freeze_budget": _size(self.freeze_budget, "--freeze-budget"),
                              "freeze_budget_per_user": _size(self.freeze_budget_per_user,
                                                              "--freeze-budget-per-user"),
                              "max_bytes_per_user": _size(self.max_bytes_per_user,
                                                          "--max-bytes-per-user")})

    def execute(self) -> int:
        # Imported here: status and run should start fast and need none of this.
        from node_agent.api import make_app
        from node_agent.devices import BackendUnavailable, open_backend
        from node_agent.devices.freezing import open_freezer
        from node_agent.http_server import listen_tcp, listen_unix
        from node_agent.ledger import Ledger
        from node_agent.service import Agent

        self.no_arguments()
        config = self.agent_config()
        tcp = _tcp_address(self.tcp) if self.tcp else None
        logging.basicConfig(level=self.log_level,
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        socket_path = self.socket
        state_dir = self.state_dir or default_state_dir()
        _make_socket_folder(socket_path)
        problem = socket_folder_problem(socket_path)
        if problem:
            print(f"gpufrac-agent: refusing --socket {socket_path}: {problem}", file=sys.stderr)
            return 2
        if AgentClient(socket_path, timeout=2).ping():
            print(f"gpufrac-agent: an agent already answers at {socket_path}", file=sys.stderr)
            return 1
        admin_gid = None
        if self.admin_group:
            try:
                admin_gid = grp.getgrnam(self.admin_group).gr_gid
            except KeyError:
                print(f"gpufrac-agent: --admin-group: no group {self.admin_group!r}",
                      file=sys.stderr)
                return 2
        token = None
        if tcp:
            if not self.token_file:
                print("gpufrac-agent: --tcp needs --token-file: TCP is never served without a "
                      "token", file=sys.stderr)
                return 2
            token, problem = read_token_file(self.token_file)
            if problem:
                print(f"gpufrac-agent: refusing --token-file {self.token_file}: {problem}",
                      file=sys.stderr)
                return 2
            if len(token) < 16:
                print("gpufrac-agent: --token-file: the token must be at least 16 characters",
                      file=sys.stderr)
                return 2
        try:
            backend = open_backend(self.simulate, self.fallback_simulate)
        except BackendUnavailable as exc:
            print(f"gpufrac-agent: {exc}: "
                  f"`{serve_command(socket_path, state_dir)} --simulate 2x16GiB`", file=sys.stderr)
            return 2
        except QuantityError as exc:
            print(f"gpufrac-agent: {exc}", file=sys.stderr)
            return 2
        lock = _lock_state_dir(state_dir)
        ledger = Ledger(state_dir)
        agent = Agent(backend, ledger, config, open_freezer(backend, self.freezer))

        async def main() -> None:
            await agent.start()
            kubelet = None
            if self.kubelet_socket:
                from node_agent.kubelet.watch import KubeletWatch

                kubelet = KubeletWatch(agent, self.kubelet_socket, self.gpu_resource,
                                       self.kubelet_interval, self.reservation_namespace)
                await kubelet.look()
                kubelet.start()
            else:
                # Pods' leases live only while a kubelet is followed: nobody would end them.
                agent.sync_cluster({})
            app = make_app(agent, admin_gid, token)
            server = listen_unix(app, socket_path)
            if tcp and token:
                listen_tcp(server, *tcp, token)
            stop = asyncio.Event()
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, stop.set)
            watch = (loop.create_task(_stop_without_parent(os.getppid(), stop))
                     if self.exit_with_parent else None)
            kind = "simulated node " + getattr(backend, "spec", "") if backend.simulated else "NVML"
            log.info("serving %d GPU(s) (%s) on %s, state in %s, %d lease(s) re-adopted",
                     len(agent.gpus), kind, socket_path, state_dir, len(ledger.leases))
            print(f"gpufrac-agent: ready on {socket_path}", flush=True)
            await stop.wait()
            if watch is not None:
                watch.cancel()
            if kubelet is not None:
                await kubelet.stop()
            server.stop()
            await agent.stop()

        try:
            asyncio.run(main())
        finally:
            ledger.close()
            backend.close()
            os.close(lock)
            with contextlib.suppress(OSError):
                os.unlink(socket_path)
        return 0
