"""gpufrac-agent demo: placing, spreading and compacting on a simulated node."""

from __future__ import annotations

from traitlets import Unicode

from node_agent.cli.command import GpuFracAgent


class DemoApp(GpuFracAgent):
    name = "gpufrac-agent demo"
    description = "Watch placing, spreading and compacting on a simulated node."

    simulate = Unicode("2x16GiB", help="The simulated node.").tag(config=True)

    aliases = {**GpuFracAgent.aliases, "simulate": "DemoApp.simulate"}

    def execute(self) -> int:
        from node_agent.demo import run_demo

        self.no_arguments()
        return run_demo(self.simulate)
