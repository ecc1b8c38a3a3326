"""gpufrac-agent simulate: the trace simulator (node_agent.simulator) under the agent's command."""

from __future__ import annotations

from node_agent.cli.command import Command


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
