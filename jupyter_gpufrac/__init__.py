"""jupyter-gpufrac: notebook kernels as first-class citizens of shared GPUs (server side)."""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"


def _jupyter_server_extension_points() -> list[dict[str, Any]]:
    # Imported here, not at module level: `jupyter server extension list` imports this
    # package, and that must touch neither NVML nor the agent.
    from jupyter_gpufrac.server.app import GpuFrac

    return [{"module": "jupyter_gpufrac", "app": GpuFrac}]
