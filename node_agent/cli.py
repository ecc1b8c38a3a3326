"""gpufrac-agent: serve | status | run | release | demo, a traitlets Application with config files."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import fcntl
import functools
import grp
import json
import logging
import math
import os
import shlex
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from importlib import resources
from typing import Any, TypeVar

from traitlets import (
    Bool,
    CaselessStrEnum,
    Container,
    Dict,
    Enum,
    Float,
    Int,
    List,
    TraitError,
    TraitType,
    Unicode,
    Union,
    default,
)
from traitlets.config import Application, Config, boolean_flag
from traitlets.config.loader import DeferredConfig, DeferredConfigList, KVArgParseConfigLoader

from node_agent import __version__
from node_agent.caps import framework_caps
from node_agent.client import (
    SYSTEM_SOCKET,
    AgentClient,
    AgentError,
    AgentUnavailable,
    UnsafeSocket,
    default_socket_path,
    personal_socket_folders,
    serve_command,
    socket_folder_problem,
)
from node_agent.devices.freezing import FREEZERS
from node_agent.kubelet.claims import GPU_RESOURCE, RESERVATION_NAMESPACES
from node_agent.quantities import QuantityError, parse_quantity
from node_agent.service import AgentConfig
from node_agent.status import render_status, status_document
from node_agent.waiting import waiting_key, waiting_words

log = logging.getLogger("gpufrac.agent")

# Config files, lowest precedence first: the node's, then the user's; then --config, then flags.
CONFIG_NAME = "gpufrac_agent_config"
UNIT_NAME = "gpufrac-agent.service"
SYSTEM_CONFIG_DIR = "/etc/gpufrac"

# The agent's settings are AgentConfig's; its defaults are the only ones.
_AGENT = AgentConfig()


def default_state_dir() -> str:
    if os.getuid() == 0:
        return "/var/lib/gpufrac"
    base = os.environ.get("XDG_STATE_HOME") or os.path.expanduser("~/.local/state")
    return os.path.join(base, "gpufrac")


def user_config_dir() -> str:
    """``$XDG_CONFIG_HOME/gpufrac``, by default ``~/.config/gpufrac``."""
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.expanduser("~/.config")
    return os.path.join(base, "gpufrac")


class UsageError(Exception):
    """A bad command line or setting: the message names it and what it expects (exit status 2)."""


class _BadValue(Exception):
    """A value its trait refuses; the caller says where it came from (a flag, a config file)."""

    def __init__(self, section: str, name: str, value: object, expected: str) -> None:
        super().__init__(f"{section}.{name}")
        self.section, self.name, self.value, self.expected = section, name, value, expected


def _expected(trait: TraitType[Any, Any]) -> str:
    """What a trait takes, in words: its ``expect`` tag, else from its type and bounds."""
    said = trait.metadata.get("expect")
    if said:
        return str(said)
    if isinstance(trait, Union):
        return " or ".join(_expected(t) for t in trait.trait_types)
    if isinstance(trait, Bool):
        return "true or false"
    if isinstance(trait, Enum):
        return "one of " + ", ".join(str(v) for v in trait.values or ())
    if isinstance(trait, (Int, Float)):
        what = "a whole number" if isinstance(trait, Int) else "a number"
        # Float's open ends are infinities, Int's None.
        low = None if trait.min in (None, -math.inf) else trait.min
        high = None if trait.max in (None, math.inf) else trait.max
        if low is not None and high is not None:
            return f"{what} from {low:g} to {high:g}"
        if low is not None:
            return f"{what} of at least {low:g}"
        if high is not None:
            return f"{what} of at most {high:g}"
        return what
    return "text"


def _untrusted(path: str) -> str | None:
    """Why a config file (or its folder) may not be read, or None.

    A config file is Python run by the agent, which runs as root: it must be this user's or
    root's, and writable by its owner only (sudo may keep a user's $HOME or $XDG_CONFIG_HOME).
    """
    st = os.stat(path)
    if st.st_uid not in (os.geteuid(), 0):
        return f"{path} belongs to uid {st.st_uid}, neither you (uid {os.geteuid()}) nor root"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"{path} is writable by group or others (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


# --- what every subcommand shares ----------------------------------------------------------
class Command(Application):
    """One subcommand: ``execute()`` does its work and says the exit status.

    A new subcommand is a subclass with ``name`` ("gpufrac-agent NAME"), ``description`` and
    ``execute``, listed in COMMANDS; one that parses its own arguments (e.g. ``simulate``
    calling ``node_agent.simulator.main``) overrides ``initialize`` to keep ``argv`` as is.
    """

    name = "gpufrac-agent"
    version = __version__
    exit_status = 0

    def execute(self) -> int:
        raise NotImplementedError

    def start(self) -> None:
        self.exit_status = self.execute()

    def _create_loader(self, argv: list[str] | None, aliases: dict[str, Any],
                       flags: dict[str, Any], classes: Any) -> KVArgParseConfigLoader:
        # argparse's own errors (an unknown flag) name the subcommand, not __main__.py.
        return _Loader(argv, aliases, flags, classes=classes, log=self.log,
                       subcommands=self.subcommands, prog=self.name,
                       usage=f"{self.name} [options] (--help lists them)")


class _Loader(KVArgParseConfigLoader):
    def _handle_unrecognized_alias(self, arg: str) -> None:
        # A mistyped option stops the command (exit status 2); traitlets would only warn.
        self.parser.error(f"unrecognized option --{arg}")

    def _exec_config_str(self, lhs: Any, rhs: Any,
                         trait: TraitType[Any, Any] | None = None) -> None:
        # An option given twice keeps its last value, as with argparse: scripts add to a
        # command line (`serve ... --orphan-grace 0.2`) rather than edit it.
        if (isinstance(rhs, DeferredConfigList) and len(rhs) > 1 and trait is not None
                and not isinstance(trait, (Container, Dict))):
            rhs = DeferredConfigList(rhs[-1:])
        super()._exec_config_str(lhs, rhs, trait)


class GpuFracAgent(Command):
    """Which agent (its socket and state directory), and where settings come from."""

    socket = Unicode(
        help="The agent's Unix socket. Default: $GPUFRAC_AGENT_SOCKET, else the system agent's "
        f"{SYSTEM_SOCKET} when root's agent made it, else $XDG_RUNTIME_DIR/gpufrac/agent.sock "
        "(or /tmp/gpufrac-UID/agent.sock).",
    ).tag(config=True)

    @default("socket")
    def _default_socket(self) -> str:
        return default_socket_path()

    state_dir = Unicode(
        None, allow_none=True,
        help="The agent's state directory: where `serve` keeps its ledger (default "
        "/var/lib/gpufrac for root, else $XDG_STATE_HOME/gpufrac), and what status, run and "
        "release name in their hint to start an agent.",
    ).tag(config=True)

    config_file = Unicode(
        "",
        help=f"A config file (.py or .json) read after {SYSTEM_CONFIG_DIR}/{CONFIG_NAME}.py and "
        f"$XDG_CONFIG_HOME/gpufrac/{CONFIG_NAME}.py (~/.config/gpufrac/...); flags win over "
        "all of them.",
    ).tag(config=True, expect="a .py or .json file")

    aliases = {
        "socket": "GpuFracAgent.socket",
        "state-dir": "GpuFracAgent.state_dir",
        "config": "GpuFracAgent.config_file",
    }
    flags = {name: Application.flags[name] for name in ("show-config", "show-config-json")}

    @default("raise_config_file_errors")
    def _raise_config_file_errors_default(self) -> bool:
        return True  # a broken config file stops the command; we say which file

    def initialize(self, argv: list[str] | None = None) -> None:
        try:
            self.parse_command_line(argv)
        except _BadValue as bad:
            raise UsageError(f"{self._option(bad.name)}: expected {bad.expected}, "
                             f"got {bad.value!r}") from None
        for folder in (SYSTEM_CONFIG_DIR, user_config_dir()):
            self._load(folder, CONFIG_NAME, f"{os.path.join(folder, CONFIG_NAME)}.py")
        if self.config_file:
            path = os.path.abspath(os.path.expanduser(self.config_file))
            stem, ext = os.path.splitext(os.path.basename(path))
            if ext not in (".py", ".json") or not os.path.isfile(path):
                raise UsageError(f"--config: expected an existing .py or .json file, got "
                                 f"{self.config_file!r}")
            self._load(os.path.dirname(path), stem, path)

    def _load(self, folder: str, stem: str, shown: str) -> None:
        """``folder/stem.py`` and ``.json`` where they exist, over what is loaded, under flags."""
        found = [p for p in (os.path.join(folder, stem + ext) for ext in (".py", ".json"))
                 if os.path.isfile(p)]
        for path in (folder, *found) if found else ():
            problem = _untrusted(path)
            if problem:
                raise UsageError(f"refusing the config file {shown}: {problem}")
        if not found:
            return
        try:
            self.load_config_file(stem, path=folder)
        except _BadValue as bad:
            raise UsageError(f"{shown}: c.{bad.section}.{bad.name}: expected {bad.expected}, "
                             f"got {bad.value!r}") from None
        except Exception as exc:
            raise UsageError(f"cannot read the config file {shown}: "
                             f"{type(exc).__name__}: {exc}") from None

    def update_config(self, config: Config) -> None:
        # Each value is tried on its own first, to say which flag or key is wrong and what it
        # takes; traitlets alone names only the trait, and exits with status 1.
        traits = self.traits(config=True)
        for section in self.section_names():
            if section not in config:
                continue
            for name, given in config[section].items():
                trait = traits.get(name)
                if trait is None:
                    continue  # traitlets warns of unknown names
                value = given.get_value(trait) if isinstance(given, DeferredConfig) else given
                try:
                    self.set_trait(name, value)
                except TraitError:
                    shown = str(given) if isinstance(given, DeferredConfig) else given
                    raise _BadValue(section, name, shown, _expected(trait)) from None
        super().update_config(config)

    def _option(self, name: str) -> str:
        """How the command line names trait ``name``: its alias, else --Class.name."""
        for alias, target in self.aliases.items():
            if target.rpartition(".")[2] == name:
                return f"--{alias}"
        return f"--{type(self).__name__}.{name}"

    def socket_note(self) -> str:
        """Which socket this command used and why, for people told that nothing answers."""
        def chosen(config: Config) -> bool:
            return any(s in config and "socket" in config[s] for s in self.section_names())

        if chosen(self.cli_config):
            why = "given with --socket"
        elif chosen(self.config):
            why = "from " + " and ".join(self.loaded_config_files)
        elif os.environ.get("GPUFRAC_AGENT_SOCKET"):
            why = "from $GPUFRAC_AGENT_SOCKET"
        else:
            which = "the system agent's" if self.socket == SYSTEM_SOCKET else "this user's"
            why = (f"{which} default; --socket, $GPUFRAC_AGENT_SOCKET or "
                   "c.GpuFracAgent.socket in a config file names another")
        return f"{self.name}: used the socket {self.socket} ({why})"

    def unreachable(self, exc: AgentError) -> None:
        """Say why the agent could not be asked, and which socket that was."""
        print(f"{self.name}: {exc}", file=sys.stderr)
        if isinstance(exc, (AgentUnavailable, UnsafeSocket)):
            print(self.socket_note(), file=sys.stderr)

    def no_arguments(self) -> None:
        if self.extra_args:
            raise UsageError(f"unexpected argument {self.extra_args[0]!r} (--help lists the "
                             "options)")


# --- serve ------------------------------------------------------------------------------
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
        nbytes = parse_quantity(size, flag).nbytes
    except QuantityError as exc:
        raise UsageError(str(exc)) from None
    if nbytes is None:
        raise UsageError(f"{flag}: expected a memory size such as 500Mi, got {size!r}")
    return nbytes


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
    poll_interval = Float(_AGENT.poll_interval, min=0.01,
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
    kubelet_interval = Float(2.0, min=0.01, help="Seconds between looks at the kubelet's list of "
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
            "freeze-budget-share", "freezer", "thaw-wait")},
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
                              "max_bytes_per_user": _size(self.max_bytes_per_user,
                                                          "--max-bytes-per-user")})

    def execute(self) -> int:
        # Imported here: status and run should start fast and need none of this.
        from node_agent.api import listen_tcp, listen_unix, make_app
        from node_agent.devices import BackendUnavailable, open_backend
        from node_agent.devices.freezing import open_freezer
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
            if tcp:
                listen_tcp(server, *tcp)
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


# --- status -----------------------------------------------------------------------------
class StatusApp(GpuFracAgent):
    name = "gpufrac-agent status"
    description = "Show the node's GPUs and the leases you may see (root and admins: all)."

    json = Bool(False, help="The stable JSON document for scripts.").tag(config=True)

    flags = {**GpuFracAgent.flags,
             "json": ({"StatusApp": {"json": True}}, "The stable JSON document for scripts.")}

    def execute(self) -> int:
        self.no_arguments()
        client = AgentClient(self.socket, state_dir=self.state_dir)
        try:
            if self.json:
                print(json.dumps(status_document(client), indent=2))
            else:
                print(render_status(client.node(), client.leases()))
        except AgentError as exc:
            self.unreachable(exc)
            return 1
        return 0


# --- run --------------------------------------------------------------------------------
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
                    self.progress.done()
                    return lease
                making_room = lease.get("waiting_for") or []
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
                    parse_quantity(value, f"--{field}")
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
            # GPUs named as the panel and `status` name them, the UUIDs after.
            index = {g.get("uuid"): g.get("index") for g in job.client.node().get("gpus", [])}
            named = ", ".join(f"GPU {index[u]}" if index.get(u) is not None else u
                              for u in lease["physical_gpus"])
            print(f"gpufrac-agent run: lease {lease_id} on {named} ({gpus})", file=sys.stderr,
                  flush=True)
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


# --- release, demo ----------------------------------------------------------------------
class ReleaseApp(GpuFracAgent):
    name = "gpufrac-agent release"
    description = """Give a lease back (yours; root and admins: anyone's).

    gpufrac-agent release LEASE"""
    examples = "gpufrac-agent release l-3f9a0c1b2d4e"

    def execute(self) -> int:
        if len(self.extra_args) != 1:
            raise UsageError("expected one lease id, e.g. release l-3f9a0c1b2d4e, got "
                             f"{len(self.extra_args)} arguments")
        lease_id = self.extra_args[0]
        try:
            AgentClient(self.socket, state_dir=self.state_dir).release(lease_id)
        except AgentError as exc:
            self.unreachable(exc)
            return 1
        print(f"gpufrac-agent: released {lease_id}")
        return 0


class DemoApp(GpuFracAgent):
    name = "gpufrac-agent demo"
    description = "Watch placing, spreading and compacting on a simulated node."

    simulate = Unicode("2x16GiB", help="The simulated node.").tag(config=True)

    aliases = {**GpuFracAgent.aliases, "simulate": "DemoApp.simulate"}

    def execute(self) -> int:
        from node_agent.demo import run_demo

        self.no_arguments()
        return run_demo(self.simulate)


class InstallServiceApp(GpuFracAgent):
    name = "gpufrac-agent install-service"
    description = f"""Write the systemd unit that runs the system agent (as root, on
    {SYSTEM_SOCKET} with its state in /var/lib/gpufrac), and say how to start it.

    gpufrac-agent install-service [--admin-group G] [--unit-dir DIR]"""
    examples = "gpufrac-agent install-service --admin-group gpu-admins"

    unit_dir = Unicode("/etc/systemd/system", help="Where the unit file goes.").tag(config=True)
    admin_group = Unicode("", help="Members of this group see and manage every lease "
                          "(serve's --admin-group).").tag(config=True)

    aliases = {**GpuFracAgent.aliases, "unit-dir": "InstallServiceApp.unit_dir",
               "admin-group": "InstallServiceApp.admin_group"}

    def execute(self) -> int:
        self.no_arguments()
        if os.geteuid() != 0 and self.unit_dir == "/etc/systemd/system":
            raise UsageError("the system unit is root's to install: run it with sudo (or give "
                             "--unit-dir to write the unit elsewhere)")
        if self.admin_group:
            try:
                grp.getgrnam(self.admin_group)
            except KeyError:
                raise UsageError(f"--admin-group: no group {self.admin_group!r}") from None
        command = [sys.executable, "-m", "node_agent", "serve", "--socket", SYSTEM_SOCKET,
                   "--state-dir", "/var/lib/gpufrac"]
        if self.admin_group:
            command += ["--admin-group", self.admin_group]
        template = resources.files("node_agent").joinpath("systemd", UNIT_NAME).read_text()
        unit = template.replace("@EXEC_START@", shlex.join(command))
        os.makedirs(self.unit_dir, exist_ok=True)
        path = os.path.join(self.unit_dir, UNIT_NAME)
        with open(path, "w") as out:
            out.write(unit)
        os.chmod(path, 0o644)
        print(f"gpufrac-agent: wrote {path}\n"
              "Start it now and at every boot:\n"
              "  systemctl daemon-reload && systemctl enable --now gpufrac-agent\n"
              f"Node settings go in {SYSTEM_CONFIG_DIR}/{CONFIG_NAME}.py; every user's Jupyter "
              f"server, kernels and CLI find the agent at {SYSTEM_SOCKET}.")
        return 0


class SimulateApp(Command):
    name = "gpufrac-agent simulate"
    description = """Replay notebook and job traces under the policies a site could run, with
    the agent's own policy functions (`simulate --help` lists its options)."""

    def initialize(self, argv: list[str] | None = None) -> None:
        self.argv = list(argv or [])  # the simulator parses its own options

    def execute(self) -> int:
        from node_agent.simulator import main as simulate

        try:
            return simulate(self.argv, prog=self.name)
        except SystemExit as done:  # its --help (0) and argparse's errors (2)
            return done.code if isinstance(done.code, int) else 2


# --- the command ------------------------------------------------------------------------
# The subcommands, in the order --help lists them.
COMMANDS: tuple[type[Command], ...] = (ServeApp, StatusApp, RunApp, ReleaseApp, DemoApp,
                                       InstallServiceApp, SimulateApp)


class GpuFracAgentApp(GpuFracAgent):
    description = f"""The jupyter-gpufrac node agent, and its clients: leases of fractional
    GPU shares for notebook kernels and jobs on this node.

    Settings come from, lowest precedence first: {SYSTEM_CONFIG_DIR}/{CONFIG_NAME}.py (the
    node's), $XDG_CONFIG_HOME/gpufrac/{CONFIG_NAME}.py (default ~/.config/gpufrac; the
    user's), the file named by --config (.json files alike), then the command line. A config
    file (and its folder) must be yours or root's, writable by its owner only. In one,
    `c.GpuFracAgent.socket = ...` applies to every subcommand, `c.ServeApp.headroom = ...` to
    one. --socket, --state-dir and --config may come before or after the subcommand."""
    examples = """
gpufrac-agent serve --simulate 2x16GiB
gpufrac-agent --socket /run/gpufrac/agent.sock status --json
gpufrac-agent run --gpus 1 -- python train.py
gpufrac-agent serve --help-all
"""
    subcommands = {command.name.rpartition(" ")[2]: (command, str(command.description).split("\n")[0])
                   for command in COMMANDS}
    classes = [GpuFracAgent, *COMMANDS]

    # Options before the subcommand that take a value: that value is not the subcommand.
    _TAKES_VALUE = frozenset(f"--{alias}" for alias in GpuFracAgent.aliases)

    def initialize(self, argv: list[str] | None = None) -> None:
        argv = list(sys.argv[1:] if argv is None else argv)
        if argv[:1] == ["help"]:
            argv = [*argv[1:], "--help"]
        at = self._subcommand_at(argv)
        if at is None:
            super().parse_command_line(argv)  # --help, --help-all, --version exit here
            given = [a for a in argv if not a.startswith("-")]
            what = f"no subcommand {given[0]!r}" if given else "give a subcommand"
            raise UsageError(f"{what}: one of {', '.join(self.subcommands)} (--help says more)")
        # Options given before the subcommand are its own, as if given after it.
        self.initialize_subcommand(argv[at], [*argv[:at], *argv[at + 1:]])

    def _subcommand_at(self, argv: list[str]) -> int | None:
        skip = False
        for i, arg in enumerate(argv):
            if skip:
                skip = False
            elif arg == "--":
                return None
            elif arg in self._TAKES_VALUE:
                skip = True
            elif not arg.startswith("-"):
                return i if arg in self.subcommands else None
        return None

    def start(self) -> None:
        assert isinstance(self.subapp, Command)
        self.subapp.start()

    def initialize_subcommand(self, subc: str, argv: list[str] | None = None) -> None:
        # A new instance each time, not traitlets' singleton: main() may run more than once
        # in a process.
        command = self.subcommands[subc][0]
        self.subapp = command(parent=self)
        self.subapp.initialize(argv)


def main(argv: Sequence[str] | None = None) -> int:
    app = GpuFracAgentApp()
    try:
        app.initialize(None if argv is None else list(argv))
    except UsageError as exc:
        print(f"{getattr(app.subapp, 'name', app.name)}: {exc}", file=sys.stderr)
        return 2
    except SystemExit as done:  # --help and --version (0), argparse's own errors (2)
        return 2 if isinstance(done.code, str) else int(done.code or 0)
    command = app.subapp
    assert isinstance(command, Command)
    try:
        app.start()
    except UsageError as exc:
        print(f"{command.name}: {exc}", file=sys.stderr)
        return 2
    except AgentError as exc:
        print(f"{command.name}: {exc}", file=sys.stderr)
        return 1
    return command.exit_status
