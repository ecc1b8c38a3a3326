"""The node agent's socket the server uses: the usual one, or the user's own if that is taken."""

from __future__ import annotations

import os
from typing import Any

from jupyter_gpufrac import contract


def default_agent_socket(log: Any) -> str:
    """$GPUFRAC_AGENT_SOCKET, else the rule every part follows (``default_socket_path``);
    where that names the per-user folder under /tmp and another user made it first (to
    listen in, or by mistake), a folder of the user's own instead, named in the log with the
    squatter's for an administrator, and given to kernels and terminals in the environment."""
    from node_agent.client import (
        default_socket_path,
        own_socket_path,
        personal_socket_folders,
        socket_folder_problem,
    )

    chosen = os.environ.get(contract.AGENT_SOCKET) or default_socket_path()
    folder = os.path.dirname(chosen)
    problem = socket_folder_problem(chosen)
    if os.environ.get(contract.AGENT_SOCKET) or problem is None or \
            folder not in personal_socket_folders():
        return chosen
    instead = own_socket_path(chosen)
    log.warning("gpufrac: the agent's usual socket folder %s cannot be used: %s. Using %s "
                "instead; an administrator should remove %s.", folder, problem, instead, folder)
    os.environ[contract.AGENT_SOCKET] = instead
    return instead
