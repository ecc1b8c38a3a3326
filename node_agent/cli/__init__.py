"""gpufrac-agent: serve | status | run | release | demo, a traitlets Application with config files."""

from node_agent.cli.app import COMMANDS, GpuFracAgentApp, main
from node_agent.cli.command import Command, GpuFracAgent, UsageError
from node_agent.cli.demo import DemoApp
from node_agent.cli.install_service import InstallServiceApp
from node_agent.cli.release import ReleaseApp
from node_agent.cli.run import RunApp
from node_agent.cli.serve import ServeApp
from node_agent.cli.simulate import SimulateApp
from node_agent.cli.status import StatusApp

__all__ = ["COMMANDS", "Command", "DemoApp", "GpuFracAgent", "GpuFracAgentApp", "InstallServiceApp",
           "ReleaseApp", "RunApp", "ServeApp", "SimulateApp", "StatusApp", "UsageError", "main"]
