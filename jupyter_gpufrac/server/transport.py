"""A kernel's sockets as Unix sockets in a folder of the user's alone, which no one else can take."""

from __future__ import annotations

import atexit
import contextlib
import functools
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

from jupyter_client.localinterfaces import localhost

from jupyter_gpufrac.kernel import store

# The longest path a Unix socket may have (sun_path less its NUL), and room for "-<port>".
MAX_SOCKET_PATH = 107
PORT_ROOM = 6


@functools.cache
def _spare_folder() -> str:
    """A folder of this server's own (0700, a name nobody can guess) for sockets whose path
    would be too long in the runtime folder; removed as the server exits (empty by then:
    jupyter_client removes a kernel's sockets as it shuts it down)."""
    folder = tempfile.mkdtemp(prefix="gpufrac-ipc-")
    atexit.register(_remove_if_empty, folder)
    return folder


def _remove_if_empty(folder: str) -> None:
    with contextlib.suppress(OSError):
        os.rmdir(folder)


def ipc_prefix(connection_file: str, kernel_id: str) -> str:
    """Where kernel ``kernel_id``'s sockets go (each is ``<prefix>-<port>``): beside its
    connection file when that folder is the user's alone and the paths fit, else in a fresh
    folder of the server's own."""
    prefix = os.path.splitext(connection_file)[0] + "-ipc"
    folder = os.path.dirname(os.path.abspath(connection_file))
    if (os.path.isabs(prefix) and len(prefix) + PORT_ROOM <= MAX_SOCKET_PATH
            and store.folder_problem(Path(folder)) is None and os.path.isdir(folder)):
        return prefix
    return os.path.join(_spare_folder(), f"kernel-{kernel_id}-ipc")


def use_private_sockets(km: Any, kernel_id: str, log: logging.Logger) -> None:
    """Before a kernel's first launch: where its manager would put it on localhost TCP ports,
    put it on Unix sockets in a folder of the user's alone instead.

    A restart (a move, a park, a kill's recovery) keeps a kernel's addresses, so that an open
    page keeps its connection. TCP ports are free for anyone to bind between the old process's
    exit and the new one's start, and whoever bound one first got the user's messages; a
    socket in a folder only the user may write is the user's between the two as well. A
    transport or address chosen in config is left as it is.
    """
    if km is None or getattr(km, "transport", None) != "tcp" or getattr(km, "ip", None) != \
            localhost() or not getattr(km, "connection_file", ""):
        return
    if any(getattr(km, f"{name}_port", 0) for name in ("shell", "iopub", "stdin", "control", "hb")):
        return  # ports chosen already (in config, or a kernel launched before): keep them
    prefix = ipc_prefix(str(km.connection_file), kernel_id)
    km.transport = "ipc"
    km.ip = prefix
    km.cache_ports = False  # a port cache is for TCP ports
    log.debug("kernel %s: its sockets are %s-*", kernel_id, prefix)
