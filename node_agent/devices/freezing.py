"""Which Freezer a backend gets: the driver's checkpoint API on a real node, else the simulation."""

from __future__ import annotations

from node_agent.devices.base import Freezer, GpuBackend
from node_agent.devices.simulated import SimulatedBackend, SimulatedFreezer

# auto: the driver's beside NVML, the simulation beside a simulated node.
FREEZERS = ("auto", "driver", "simulated")


def open_freezer(backend: GpuBackend, which: str = "auto") -> Freezer:
    """The freezer for ``backend``; the driver's is probed on first use, not here."""
    if which not in FREEZERS:
        raise ValueError(f"freezer: expected one of {FREEZERS}, got {which!r}")
    if which == "simulated" or (which == "auto" and isinstance(backend, SimulatedBackend)):
        if not isinstance(backend, SimulatedBackend):
            raise ValueError("freezer: the simulated freezer needs a simulated node")
        return SimulatedFreezer(backend)
    from node_agent.devices.cuda import DriverFreezer

    return DriverFreezer()
