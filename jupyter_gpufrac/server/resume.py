"""A new kernel of a notebook and the state its earlier kernel left: found, offered or taken over."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

from jupyter_gpufrac import contract
from jupyter_gpufrac.kernel import store
from jupyter_gpufrac.notebook_record import (
    Notebook,
    adopt,
    read_record,
    session_notebook,
    write_record,
)
from jupyter_gpufrac.server.kernels import KernelGpu
from jupyter_gpufrac.server.launch import checkpoint_dir_of, lease_gpus
from jupyter_gpufrac.server.notebook_states import (
    HEARTBEAT_S,
    EarlierState,
    gpu_words,
    latest,
    resume_reason,
    states_of,
)
from jupyter_gpufrac.server.settings import KernelSettings

RECORD_VERSION = 1


async def plan(gpu: KernelGpu, env: Mapping[str, str], cwd: str | None,
               running: Collection[str]) -> None:
    """At a kernel's first launch: the notebook it serves (from the session that starts it), and
    the state an earlier kernel of that notebook left, to take over now (c.GpuFrac.resume
    "always") or to offer ("ask", "never": `%gpu restore` takes it)."""
    settings = gpu.settings()
    gpu.first_launch = time.time()
    gpu.notebook = session_notebook(env.get("JPY_SESSION_NAME"), cwd, settings.user,
                                    settings.notebook_root)
    if (gpu.notebook is None or settings.server is None or settings.folder_problem
            or not gpu.hooked):
        return
    states = await asyncio.to_thread(states_of, settings.checkpoint_root, gpu.notebook,
                                     {*running, gpu.kernel_id}, settings.server)
    state, why = latest(states)
    if state is None:
        if states:
            gpu.log.info("kernel %s: starts fresh: %s", gpu.kernel_id, why)
        return
    if settings.resume == contract.RESUME_ALWAYS:
        gpu.resume_next = state
    else:
        gpu.resumable = state
        gpu.log.info("kernel %s: an earlier state of notebook %s waits in %s (c.GpuFrac.resume "
                     "= %r)", gpu.kernel_id, gpu.notebook.path, state.folder, settings.resume)


def here(gpu: KernelGpu) -> str | None:
    """Where the kernel runs now, for people: ``GPU 1 (NVIDIA H100 80GB HBM3, 79.6 GiB)``;
    None without a GPU."""
    uuids = lease_gpus(gpu.lease) if gpu.lease is not None else []
    return gpu_words(gpu.gpus.get(uuids[0]) or {"uuid": uuids[0]}) if uuids else None


async def take_over(gpu: KernelGpu) -> None:
    """Before a launch that resumes (``gpu.resume_next``): the earlier kernel's folder becomes
    this kernel's, and the launch restores it, saying why. If the folder is gone (another
    server took it first) the kernel starts fresh and the log says why."""
    state, gpu.resume_next = gpu.resume_next, None
    if state is None:
        return
    settings = gpu.settings()
    try:
        await asyncio.to_thread(adopt, Path(settings.checkpoint_root), state.folder,
                                gpu.kernel_id, (contract.WAKE_SOCKET,))
    except (OSError, store.UnsafeCheckpointError) as exc:
        gpu.log.warning("kernel %s: could not take over the state in %s: %s; it starts fresh",
                        gpu.kernel_id, Path(settings.checkpoint_root) / state.folder, exc)
        return
    gpu.resumable = None
    gpu.saw_generation(state.recorded_generation)
    gpu.last_launch_reason = resume_reason(state, here(gpu))
    gpu.log.info("kernel %s: resumes notebook %s from the state of kernel %s (after cell [%s])",
                 gpu.kernel_id, gpu.notebook.path if gpu.notebook else "?", state.folder,
                 state.cell)


def offer(gpu: KernelGpu) -> dict[str, Any] | None:
    """What the kernel is told of a state it may take over (contract.RESUMABLE), or None."""
    state = gpu.resumable
    if state is None:
        return None
    return {"folder": state.folder, "generation": state.recorded_generation,
            "cell": state.cell, "time": state.time, "variables": len(state.names),
            "reason": resume_reason(state, here(gpu))}


def offered(gpu: KernelGpu) -> EarlierState | None:
    """The state offered to the user, while its folder is still there (``%gpu restore`` in the
    kernel, or another server, may have taken it since)."""
    state = gpu.resumable
    if state is None:
        return None
    folder = Path(gpu.settings().checkpoint_root) / state.folder
    if not folder.is_dir():
        gpu.resumable = None
        return None
    return state


def record(gpu: KernelGpu, ended: Mapping[str, Any] | None = None) -> dict[str, Any] | None:
    """The kernel's record (contract.NOTEBOOK_RECORD) as of now; None for a kernel of no notebook."""
    settings = gpu.settings()
    if gpu.notebook is None or settings.server is None:
        return None
    uuids = lease_gpus(gpu.lease) if gpu.lease is not None else []
    device = gpu.gpus.get(uuids[0]) if uuids else None
    return {
        "version": RECORD_VERSION,
        "notebook": gpu.notebook.to_json(),
        "kernel_id": gpu.kernel_id,
        "launched": gpu.first_launch,
        "server": settings.server.to_json(),
        "heartbeat": time.time(),
        "gpu": ({key: device.get(key) for key in ("uuid", "index", "name", "memory_total")}
                if device else None),
        "simulated": gpu.simulated,
        "generation": gpu.checkpoint_generation,
        "offered": gpu.resumable.folder if gpu.resumable is not None else None,
        "ended": dict(ended) if ended else None,
    }


def leave_record(gpu: KernelGpu, ended: Mapping[str, Any] | None = None, *,
                 durable: bool = False) -> bool:
    """Write the kernel's record into its folder (file I/O: in a thread); False when it has none
    or it could not be written (said in the log)."""
    settings = gpu.settings()
    data = record(gpu, ended)
    if data is None or settings.folder_problem or gpu.checkpoints_off:
        return False
    folder = Path(checkpoint_dir_of(settings.checkpoint_root, gpu.kernel_id))
    try:
        write_record(folder, data, durable=durable)
    except (OSError, store.UnsafeCheckpointError) as exc:
        gpu.log.info("kernel %s: its notebook record was not written: %s", gpu.kernel_id, exc)
        return False
    gpu.record_written = time.monotonic()
    return True


def heartbeat(gpu: KernelGpu) -> None:
    """Say again, every HEARTBEAT_S, that this server runs the kernel (file I/O: in a thread)."""
    if gpu.notebook is not None and time.monotonic() - gpu.record_written >= HEARTBEAT_S:
        leave_record(gpu)


def follow_rename(running: list[KernelGpu], settings: KernelSettings, source: str,
                  target: str) -> int:
    """``source`` (a notebook, or a folder of them) was renamed to ``target``: the records of
    running kernels and of earlier kernels' states follow (file I/O: in a thread); how many."""
    moved = 0
    folders = set()
    for gpu in running:
        folders.add(gpu.kernel_id)
        renamed = gpu.notebook.moved(source, target) if gpu.notebook is not None else None
        if renamed is not None:
            gpu.notebook = renamed
            moved += leave_record(gpu)
    root = Path(settings.checkpoint_root)
    try:
        names = os.listdir(root)
    except OSError:
        return moved
    for name in names:
        if name in folders or name.startswith("."):
            continue
        found = read_record(root / name)
        notebook = Notebook.from_json((found or {}).get("notebook"))
        if (found is None or notebook is None or notebook.user != settings.user
                or notebook.root != settings.notebook_root):
            continue
        renamed = notebook.moved(source, target)
        if renamed is None:
            continue
        try:
            write_record(root / name, {**found, "notebook": renamed.to_json()}, durable=True)
        except (OSError, store.UnsafeCheckpointError) as exc:
            settings.log.info("gpufrac: the record in %s does not follow the rename: %s",
                              root / name, exc)
            continue
        moved += 1
    return moved
