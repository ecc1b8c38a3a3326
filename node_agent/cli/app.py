"""The gpufrac-agent command: which subcommand runs, with the options given around it, and its exit status."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from node_agent.cli.command import CONFIG_NAME, SYSTEM_CONFIG_DIR, Command, GpuFracAgent, UsageError
from node_agent.cli.demo import DemoApp
from node_agent.cli.install_service import InstallServiceApp
from node_agent.cli.release import ReleaseApp
from node_agent.cli.run import RunApp
from node_agent.cli.serve import ServeApp
from node_agent.cli.simulate import SimulateApp
from node_agent.cli.status import StatusApp
from node_agent.client import AgentError

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
