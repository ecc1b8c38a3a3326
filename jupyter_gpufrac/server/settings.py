"""What a provisioner needs from the server extension, and stand-in values when there is none."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shlex
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from jupyter_gpufrac import contract
from jupyter_gpufrac.server.events import KernelEventLog


@dataclass
class KernelSettings:
    """Settings shared by every kernel of one server (built by ``GpuFrac``)."""

    socket_path: str
    client_name: str
    default_request: str
    default_limit: str
    checkpoint_root: str
    events: KernelEventLog
    # Called after each launch so the server can follow the kernel (restore report, bursting).
    on_launched: Callable[[str, dict[str, Any]], None] | None = None
    # The exact command that starts the agent this server expects, for hints to people.
    agent_command: str = "gpufrac-agent serve"
    # Bad c.GpuFrac settings: while there are any, kernels start without a GPU lease.
    config_problems: tuple[str, ...] = ()
    # How long a kernel's checkpoint is kept after its user shut it down (c.GpuFrac).
    checkpoint_keep_seconds: float = 86400.0
    # Set as the server stops: the kernels it shuts down then were not shut down by their users.
    server_stopping: bool = False

    @property
    def remembered_request_path(self) -> str:
        """The user's remembered ``%gpu request`` for this server's environment."""
        key = hashlib.sha256(sys.prefix.encode()).hexdigest()[:12]
        return os.path.join(self.checkpoint_root,
                            contract.LAST_REQUEST_FILE.format(environment=key))

    def last_request(self) -> dict[str, Any] | None:
        """The user's last ``%gpu request`` here (request/limit specs), remembered across
        kernels and server restarts in this environment."""
        path = self.remembered_request_path
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
        except (OSError, ValueError):
            return None
        return data if isinstance(data, dict) and data.get("request") else None

    def remember_request(self, request: str, limit: str | None) -> None:
        """Store a ``%gpu request`` so the user's next kernel asks for the same."""
        os.makedirs(self.checkpoint_root, mode=0o700, exist_ok=True)
        path = self.remembered_request_path
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump({"request": request, "limit": limit}, f)
        os.replace(tmp, path)


def default_checkpoint_root() -> str:
    """``<jupyter data dir>/gpufrac/checkpoints``: the user's own, and it survives reboots."""
    from jupyter_core.paths import jupyter_data_dir

    return os.path.join(jupyter_data_dir(), "gpufrac", "checkpoints")


def standalone_settings(log: logging.Logger) -> KernelSettings:
    """Settings for a provisioner used without the server extension (e.g. ``jupyter console``)."""
    from jupyter_gpufrac.server.agent_link import default_socket_path

    socket_path = os.environ.get(contract.AGENT_SOCKET) or default_socket_path()
    return KernelSettings(
        socket_path=socket_path,
        client_name=f"jupyter-client-{os.getpid()}",
        default_request="0.25",
        default_limit="1",
        checkpoint_root=default_checkpoint_root(),
        events=KernelEventLog(None, log),
        agent_command=agent_command(socket_path, None),
    )


def agent_command(socket_path: str | None, state_dir: str | None) -> str:
    """``gpufrac-agent serve --socket S --state-dir D``: what to run, exactly, to bring it back."""
    words = ["gpufrac-agent", "serve"]
    if socket_path:
        words += ["--socket", socket_path]
    if state_dir:
        words += ["--state-dir", state_dir]
    return shlex.join(words)
