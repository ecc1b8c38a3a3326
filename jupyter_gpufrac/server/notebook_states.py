"""Earlier kernels' states of a notebook in the user's checkpoints, as any of their servers finds them."""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import socket
import stat
import time
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from jupyter_gpufrac import contract
from jupyter_gpufrac.checkpoint_disk import DIR_FLAGS, read_marker
from jupyter_gpufrac.kernel import store
from jupyter_gpufrac.kernel.state_file import CheckpointError, current_header, header_generation
from jupyter_gpufrac.notebook_record import Notebook, read_record
from jupyter_gpufrac.server.retention import listening
from node_agent.quantities import format_bytes, format_duration

# How often a server says in each of its kernels' records that it still runs them.
HEARTBEAT_S = 30.0
# A record of a server on another machine counts as a running kernel's until that server has
# been silent this long (a server on this machine is asked directly, by its pid).
SILENT_AFTER_S = 120.0
# A server process counts as the record's when it started within this of the recorded time.
START_SLACK_S = 1.0
# How a kernel's record says it ended (no "how": it did not end, as far as anyone said).
ENDED_STOPPED = "server-stopped"
ENDED_CULLED = "culled"


def current_user() -> str:
    """Whose checkpoints these are: the JupyterHub user (pods of many users share one uid),
    else the login name of this process's user."""
    hub_user = os.environ.get("JUPYTERHUB_USER", "").strip()
    if hub_user:
        return hub_user
    try:
        return pwd.getpwuid(os.geteuid()).pw_name
    except KeyError:
        return f"uid {os.geteuid()}"


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as fh:
            return fh.read().strip()
    except OSError:
        return ""


@dataclass(frozen=True)
class ServerInfo:
    """The server that runs a kernel, as its record names it: the node for people, and what
    tells whether it still runs (its pid on this boot of this machine)."""

    node: str
    host: str
    boot: str
    pid: int
    started: float

    @classmethod
    def here(cls) -> ServerInfo:
        host = socket.gethostname()
        node = os.environ.get(contract.NODE_NAME, "").strip()[:253] or host
        return cls(node, host, _boot_id(), os.getpid(), psutil.Process().create_time())

    def to_json(self) -> dict[str, Any]:
        return {"node": self.node, "host": self.host, "boot": self.boot, "pid": self.pid,
                "started": self.started}

    def runs(self, recorded: Mapping[str, Any]) -> bool:
        """Whether the server a record names still runs (on this machine since its boot)."""
        pid, started = recorded.get("pid"), recorded.get("started")
        if not isinstance(pid, int) or not isinstance(started, int | float):
            return False
        if pid == self.pid and abs(started - self.started) <= START_SLACK_S:
            return True
        try:
            return abs(psutil.Process(pid).create_time() - started) <= START_SLACK_S
        except (psutil.Error, OSError):
            return False


@dataclass(frozen=True)
class EarlierState:
    """One earlier kernel's state of a notebook, as found in the checkpoint root."""

    folder: str
    record: dict[str, Any]
    launched: float
    cell: int | None
    time: float | None
    generation: int
    names: list[str] = field(default_factory=list)
    # Left out of the checkpoint (over a budget, or not picklable): name -> why.
    unprotected: dict[str, str] = field(default_factory=dict)
    # When its user shut its kernel down (then nothing resumes it), or None.
    shut_down: float | None = None
    # Why it counts as still in use by a running kernel, or None.
    live: str | None = None

    @property
    def empty(self) -> bool:
        """Whether it holds nothing to come back (a kernel that ran no cell, or restarted)."""
        return not self.names and not self.unprotected

    @property
    def recorded_generation(self) -> int:
        """The newest generation any server recorded for it (a state older than that is
        named so when restored)."""
        found = self.record.get("generation")
        recorded = found if isinstance(found, int) and not isinstance(found, bool) else 0
        return max(recorded, 0)


def states_of(root: str, notebook: Notebook, running: Collection[str], here: ServerInfo,
              now: float | None = None) -> list[EarlierState]:
    """Every earlier kernel's state of ``notebook`` under checkpoint root ``root``, newest kernel
    first: the user's own folders only, never one of ``running`` (this server's kernels), and
    never another user's notebook (file I/O: call it in a thread)."""
    now = time.time() if now is None else now
    found: list[EarlierState] = []
    try:
        root_fd = store.open_private_dir(Path(root))
    except (OSError, store.UnsafeCheckpointError):
        return found
    try:
        for name in os.listdir(root_fd):
            if name in running or name.startswith("."):
                continue
            state = _state(root, root_fd, name, notebook, here, now)
            if state is not None:
                found.append(state)
    finally:
        os.close(root_fd)
    found.sort(key=lambda s: s.launched, reverse=True)
    return found


def _state(root: str, root_fd: int, name: str, notebook: Notebook, here: ServerInfo,
           now: float) -> EarlierState | None:
    try:
        st = os.stat(name, dir_fd=root_fd, follow_symlinks=False)
    except FileNotFoundError:
        return None
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
        return None
    folder = Path(root) / name
    record = read_record(folder) or {}
    try:
        with store.CheckpointDir.open(folder) as opened:
            header = current_header(opened) if opened.exists(store.STATE_FILE) else {}
    except (OSError, ValueError, CheckpointError, store.UnsafeCheckpointError):
        return None
    # The record follows renames; a state without one still says whose notebook it was.
    named = Notebook.from_json(record.get("notebook") or header.get("notebook"))
    if named != notebook:
        return None
    record = record or {"notebook": notebook.to_json()}
    when = header.get("time")
    cell = header.get("execution_count")
    launched = record.get("launched")
    unprotected = {str(k): "not protected" for k in (header.get("unprotected") or {})}
    unprotected.update({str(k): str(v)[:200] for k, v in (header.get("lost") or {}).items()})
    marker = read_marker(folder)
    return EarlierState(
        folder=name, record=record,
        launched=float(launched if isinstance(launched, int | float) else when or 0.0),
        cell=cell if isinstance(cell, int) and not isinstance(cell, bool) else None,
        time=float(when) if isinstance(when, int | float) else None,
        generation=header_generation(header),
        names=[str(n) for n in [*(header.get("names") or []), *(header.get("modules") or {})]],
        unprotected=unprotected,
        shut_down=marker.time if marker is not None else None,
        live=_live(root_fd, name, record, here, now),
    )


def _live(root_fd: int, name: str, record: Mapping[str, Any], here: ServerInfo,
          now: float) -> str | None:
    """Why the folder's kernel still runs, or None when nothing says it does."""
    with contextlib.suppress(OSError):
        fd = os.open(name, DIR_FLAGS, dir_fd=root_fd)
        try:
            if listening(fd):
                return "its kernel still runs on this machine"
        finally:
            os.close(fd)
    ended = record.get("ended")
    if isinstance(ended, dict) and ended.get("how"):
        return None
    server = record.get("server") if isinstance(record.get("server"), dict) else {}
    assert isinstance(server, dict)
    if server.get("boot") and server.get("boot") == here.boot:
        same = server.get("pid") == here.pid
        return f"its server (pid {server.get('pid')}) still runs" if (
            not same and here.runs(server)) else None
    heard = record.get("heartbeat")
    if isinstance(heard, int | float) and 0 <= now - heard < SILENT_AFTER_S:
        return (f"its server on {server.get('node') or 'another machine'} was heard from "
                f"{format_duration(now - heard)} ago")
    return None


def latest(states: list[EarlierState]) -> tuple[EarlierState | None, str]:
    """The state a new kernel of the notebook resumes, or None and why not (for the log).

    The newest kernel decides: shut down by its user, or still running, nothing resumes; an
    empty state (a kernel restarted by its user, or one that ran nothing) resumes nothing,
    unless that kernel itself was offered an older state it did not take.
    """
    for state in states:
        if state.live is not None:
            return None, f"the state in {state.folder} is in use: {state.live}"
        if state.shut_down is not None:
            return None, f"its last kernel ({state.folder}) was shut down by its user"
        if not state.empty:
            return state, ""
        if not state.record.get("offered"):
            return None, f"its last kernel ({state.folder}) left nothing to resume"
    return None, "no earlier kernel of it left a state"


def clock(when: object) -> str:
    """``05:52:24`` today, ``2025-03-01 05:52`` on another day; ``an unknown time``."""
    if not isinstance(when, int | float) or when <= 0:
        return "an unknown time"
    if time.strftime("%Y-%m-%d", time.localtime(when)) == time.strftime("%Y-%m-%d"):
        return time.strftime("%H:%M:%S", time.localtime(when))
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(when))


def gpu_words(gpu: Mapping[str, Any], *, size: bool = True) -> str:
    """``GPU 0 (NVIDIA A100-SXM4-40GB, 40.0 GiB)`` (without ``size``: its model alone)."""
    index = gpu.get("index")
    label = f"GPU {index}" if isinstance(index, int) else str(gpu.get("uuid") or "a GPU")
    facts = [str(gpu["name"])[:100]] if gpu.get("name") else []
    if size and isinstance(gpu.get("memory_total"), int):
        facts.append(format_bytes(int(gpu["memory_total"])))
    return f"{label} ({', '.join(facts)})" if facts else label


def how_it_ended(state: EarlierState) -> str:
    """Why the notebook's earlier kernel is gone, as its record says and no more."""
    record = state.record
    server = record.get("server") if isinstance(record.get("server"), dict) else {}
    assert isinstance(server, dict)
    node = str(server.get("node") or "another node")[:253]
    ended = record.get("ended") if isinstance(record.get("ended"), dict) else {}
    assert isinstance(ended, dict)
    if ended.get("how") == ENDED_STOPPED:
        return f"its Jupyter server on {node} was stopped at {clock(ended.get('time'))}"
    if ended.get("how") == ENDED_CULLED:
        return (f"the Jupyter server on {node} stopped its kernel at {clock(ended.get('time'))} "
                "for being idle (cull_idle_timeout)")
    return (f"its kernel on {node} ended without being stopped: its server or node went away "
            f"(last heard from at {clock(record.get('heartbeat') or state.time)})")


def resume_reason(state: EarlierState, here: str | None) -> dict[str, Any]:
    """The restart reason of a kernel that resumes ``state``; ``here``: the GPU it runs on now
    (None: none). ``from_where`` is the short of it, for notifications: from when and where."""
    gpu = state.record.get("gpu") if isinstance(state.record.get("gpu"), dict) else None
    server = state.record.get("server") if isinstance(state.record.get("server"), dict) else {}
    assert isinstance(server, dict)
    cell = f"cell [{state.cell}] at " if state.cell else ""
    on_gpu = f", {gpu_words(gpu, size=False)}" if gpu else ""
    ran = f"ran on {gpu_words(gpu)}" if gpu else "ran without a GPU"
    runs = f"runs on {here}" if here else "runs without a GPU"
    return {
        "from_where": f"{cell}{clock(state.time)} on {str(server.get('node') or '?')[:253]}"
                      f"{on_gpu}",
        "cause": contract.CAUSE_RESUMED,
        "message": f"Resumed from the last checkpoint of its earlier kernel: "
                   f"{how_it_ended(state)}; it {ran} there, and {runs} here.",
        "from_gpu": (gpu or {}).get("uuid"), "to_gpu": None,
    }


def owner_problem(root: str, user: str) -> str | None:
    """Why checkpoint root ``root`` holds another user's checkpoints, with the fix; None when it
    is ``user``'s (it is marked so the first time). Pods of several users share one uid, so
    the folder's owner alone cannot tell a volume shared by several users."""
    folder = Path(root)
    try:
        found = json.loads(store.read_file(folder, contract.OWNER_FILE, blobs=False))
    except FileNotFoundError:
        store.write_file(folder, contract.OWNER_FILE, json.dumps({"user": user}).encode(),
                         blobs=False)
        return None
    except (OSError, ValueError, store.UnsafeCheckpointError) as exc:
        return f"{folder / contract.OWNER_FILE} cannot be read ({exc}); fix: remove it"
    owner = found.get("user") if isinstance(found, dict) else None
    if owner == user:
        return None
    shown = json.dumps(str(owner)[:100]) if owner else "no user"
    return (f"{folder} holds the checkpoints of {shown}, not yours ({json.dumps(user)}): one "
            f"volume shared by several users, where a notebook could restore another user's "
            f"state; fix: give each user a checkpoint folder of their own (on Kubernetes a "
            f"per-user volume, with KubeSpawner a per-user claim; on a JupyterHub of several "
            f"hosts a folder in each user's home) or set c.GpuFrac.checkpoint_dir to one")

