"""Trace-driven simulation of site policies over the agent's own policy functions (issues 12 and 15)."""

from node_agent.simulator.cli import main
from node_agent.simulator.engine import Engine, Timing, nodes_needed, simulate

__all__ = ["Engine", "Timing", "main", "nodes_needed", "simulate"]
