"""Which Freezer a backend gets: the driver's checkpoint API on a real node, else the simulation."""

from __future__ import annotations

from node_agent.devices.base import Freezer, GpuBackend
from node_agent.devices.simulated import SimulatedBackend, SimulatedFreezer


def open_freezer(backend: GpuBackend) -> Freezer:
    """The freezer for ``backend``; the driver's is probed on first use, not here."""
    if isinstance(backend, SimulatedBackend):
        return SimulatedFreezer(backend)
    from node_agent.devices.cuda import DriverFreezer

    return DriverFreezer()
