"""What every subcommand shares: the Command base, the agent's socket and state directory, config files."""

from __future__ import annotations

import math
import os
import stat
import sys
from typing import Any

from traitlets import Bool, Container, Dict, Enum, Float, Int, TraitError, TraitType, Unicode, Union, default
from traitlets.config import Application, Config
from traitlets.config.loader import DeferredConfig, DeferredConfigList, KVArgParseConfigLoader

from node_agent import __version__
from node_agent.client import SYSTEM_SOCKET, AgentError, AgentUnavailable, UnsafeSocket, default_socket_path

# Config files, lowest precedence first: the node's, then the user's; then --config, then flags.
CONFIG_NAME = "gpufrac_agent_config"
SYSTEM_CONFIG_DIR = "/etc/gpufrac"

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
        what = "a whole number" if isinstance(trait, Int) else "a finite number"
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


class Command(Application):
    """One subcommand: ``execute()`` does its work and says the exit status.

    A new subcommand is a subclass with ``name`` ("gpufrac-agent NAME"), ``description`` and
    ``execute``, listed in COMMANDS (cli/app.py); one that parses its own arguments (e.g. ``simulate``
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
                    # traitlets lets NaN through any bounds (every comparison with it is
                    # false), and infinities through open ones: neither is a setting.
                    number = getattr(self, name)
                    if isinstance(number, float) and not math.isfinite(number):
                        raise TraitError(name)
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
