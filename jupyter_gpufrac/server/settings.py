"""What a provisioner needs from the server extension, and stand-in values when there is none."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shlex
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jupyter_gpufrac import contract
from jupyter_gpufrac.checkpoint_disk import adopt_root
from jupyter_gpufrac.kernel import store
from jupyter_gpufrac.server.events import KernelEventLog
from jupyter_gpufrac.server.notebook_states import ServerInfo
from node_agent.quantities import QuantityError, parse_quantity, stored_spec


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
    # Bytes one kernel's checkpoint and all the user's may take (c.GpuFrac, resolved at start).
    checkpoint_kernel_budget: int | None = None
    checkpoint_user_budget: int | None = None
    checkpoint_staging_budget: int | None = None
    # Those of the two disk budgets set as shares of the space free for checkpoints ("kernel",
    # "user"): each kernel measures the disk again as it changes (their bytes above are None).
    checkpoint_disk_shares: dict[str, float] = field(default_factory=dict)
    # Set as the server stops: the kernels it shuts down then were not shut down by their users.
    server_stopping: bool = False
    # Whose checkpoints these are, and the folder the server serves notebooks from: with a
    # notebook's path they name it to every server of the user (jupyter_gpufrac.notebook_record).
    user: str = ""
    notebook_root: str = ""
    # This server, as its kernels' records name it (None outside a server: no records).
    server: ServerInfo | None = None
    # What a new kernel of a notebook does with its earlier kernel's state (c.GpuFrac.resume).
    resume: str = contract.RESUME_ALWAYS

    # Why the checkpoint folders may not be used (a folder another user can write): kernels
    # then start without checkpoints, and are told so. None: they are fine.
    folder_problem: str | None = None
    log: logging.Logger = field(default_factory=lambda: logging.getLogger(__name__))

    @property
    def remembered_request_path(self) -> str:
        """The user's remembered ``%gpu request`` for this server's environment."""
        return os.path.join(self.checkpoint_root, self.remembered_request_name)

    @property
    def remembered_request_name(self) -> str:
        """The file name of :attr:`remembered_request_path` in the checkpoint root."""
        key = hashlib.sha256(sys.prefix.encode()).hexdigest()[:12]
        return contract.LAST_REQUEST_FILE.format(environment=key)

    def last_request(self) -> dict[str, Any] | None:
        """The user's last ``%gpu request`` here (request/limit specs), remembered across
        kernels and server restarts in this environment; None when there is none, or it is
        not the user's alone or not a request the agent would take (said in the log)."""
        if self.folder_problem:
            return None
        path = self.remembered_request_path
        try:
            data = json.loads(store.read_file(Path(self.checkpoint_root),
                                              self.remembered_request_name, blobs=False))
        except FileNotFoundError:
            return None
        except (OSError, ValueError, store.UnsafeCheckpointError) as exc:
            self.log.warning("gpufrac: ignoring the remembered %%gpu request %s: %s", path, exc)
            return None
        problem = _request_problem(data)
        if problem is not None:
            self.log.warning("gpufrac: ignoring the remembered %%gpu request %s: %s", path,
                             problem)
            return None
        limit = data.get("limit")
        return {"request": stored_spec(str(data["request"])),
                "limit": None if limit is None else stored_spec(str(limit))}


def _request_problem(data: object) -> str | None:
    """What is wrong with a remembered request as read (None: a request and limit the agent
    parses)."""
    if not isinstance(data, dict):
        return f"expected a JSON object, got {type(data).__name__}"
    for key in ("request", "limit"):
        value = data.get(key)
        if value is None and key == "limit":
            continue
        if not isinstance(value, str | int | float) or isinstance(value, bool):
            return f"{key}: expected a quantity, got {value!r}"[:200]
        try:
            parse_quantity(stored_spec(str(value)), key)
        except QuantityError as err:
            return str(err)[:200]
    return None


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
        log=log,
    )


def checkpoint_folder_problem(checkpoint_root: str) -> str | None:
    """Why the checkpoint root (and the gpufrac data folder above it, when it is the default
    one's) may not be used, with the fix; None when they are the user's alone. Missing ones
    are created 0700."""
    root = Path(checkpoint_root)
    data_root = Path(default_checkpoint_root()).parent
    folders = [data_root, root] if root.parent == data_root else [root]
    for folder in folders:
        # A component above the last that is a link (a home on another disk) is the user's.
        problem = store.folder_problem(folder)
        if problem is not None:
            return problem
        try:
            if folder != root:
                os.close(store.open_private_dir(folder, create=True))
                continue
            fd = store.open_root(folder)
            try:
                # A root an earlier version made is marked now, when it holds only what this
                # project puts there; else the retention sweep leaves it alone.
                adopt_root(fd, folder)
            finally:
                os.close(fd)
        except (OSError, store.UnsafeCheckpointError) as exc:
            return f"{folder} cannot be used ({exc})"
    return None


def agent_command(socket_path: str | None, state_dir: str | None) -> str:
    """``gpufrac-agent serve --socket S --state-dir D``: what to run, exactly, to bring it back."""
    words = ["gpufrac-agent", "serve"]
    if socket_path:
        words += ["--socket", socket_path]
    if state_dir:
        words += ["--state-dir", state_dir]
    return shlex.join(words)
