"""The GPUFRAC_* environment the provisioner gives the kernel (docs/agent-api.md), parsed purely."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jupyter_gpufrac import contract


@dataclass(frozen=True)
class RestartReason:
    """Why the agent or server restarted this kernel."""

    cause: str
    message: str = ""
    from_gpu: str | None = None
    to_gpu: str | None = None


@dataclass(frozen=True)
class Resumable:
    """An earlier kernel's state of this notebook that ``%gpu restore`` takes over."""

    folder: str
    reason: RestartReason
    # The newest generation recorded for it (an older one is named so when restored).
    generation: int = 0
    cell: int | None = None
    time: float | None = None
    variables: int = 0


@dataclass(frozen=True)
class KernelEnv:
    """Everything the hook reads from its environment; ``problems`` lists what was malformed."""

    lease_id: str | None = None
    agent_socket: str | None = None
    kernel_id: str | None = None
    request: int | None = None
    limit: int | None = None
    gpu_uuid: str | None = None
    gpu_index: int | None = None
    gpu_name: str | None = None
    gpu_total: int | None = None
    # What this process's CUDA context takes of the share (the allocator gets the rest).
    context: int = 0
    simulated: bool = False
    checkpoint_dir: Path = Path(".")
    # Whether checkpoints here can be found again by a restarted kernel (a provisioner said where,
    # or the kernel id names the directory); a pid-named fallback cannot.
    checkpoint_dir_stable: bool = False
    # The launcher named the folder (GPUFRAC_CHECKPOINT_DIR): it wakes the directive thread on
    # the socket there (jupyter_gpufrac.wake).
    checkpoint_dir_given: bool = False
    restore: bool = False
    # Started parked: the lease holds no GPU until the next cell asks for one.
    parked: bool = False
    restart_reason: RestartReason | None = None
    # Where the request and the limit came from ({"request": "kernelspec", ...}), if said.
    share_source: dict[str, str | None] = field(default_factory=dict)
    # The server's file remembering the user's %gpu request here (``--reset`` removes it).
    remembered_request: Path | None = None
    # The share new kernels get when nothing else names one ({"request": "0.25", "limit": ...}).
    default_share: dict[str, str | None] = field(default_factory=dict)
    # Why the server started this kernel without a lease, in its words (None: it said nothing).
    no_lease_why: str | None = None
    # The gpufrac provisioner launched this kernel (it always sets GPUFRAC_KERNEL_ID).
    launched_by_provisioner: bool = False
    problems: tuple[str, ...] = field(default_factory=tuple)
    # Why this kernel takes no checkpoints (its folder is not the user's alone), or None.
    checkpoints_off: str | None = None
    # The newest checkpoint generation of this kernel the server saw (0: none).
    checkpoint_generation: int = 0
    # Bytes one checkpoint of this kernel, and all of its user's, may take (None: unbounded).
    checkpoint_kernel_budget: int | None = None
    checkpoint_user_budget: int | None = None
    # Bytes one snapshot may copy into memory at a cell's end (None: unbounded).
    checkpoint_staging_budget: int | None = None
    # The disk budgets that are shares of the space free for checkpoints ("kernel", "user"):
    # measured again as the disk changes, not fixed at the launch.
    checkpoint_disk_shares: dict[str, float] = field(default_factory=dict)
    # An earlier kernel's state of this notebook, offered to this fresh kernel, or None.
    resumable: Resumable | None = None

    @property
    def has_lease(self) -> bool:
        """True when the provisioner gave this kernel a GPU lease."""
        return bool(self.lease_id)

    def no_lease_reason(self) -> str:
        """Why there is no lease, for ``%gpu``."""
        if self.has_lease:
            return ""
        if self.no_lease_why:
            return self.no_lease_why
        if self.launched_by_provisioner:
            return ("The Jupyter server started this kernel without a GPU lease and did not say "
                    "why (its log may): no GPU memory is reserved for it and nothing limits or "
                    "moves it.")
        return (
            "GPUFRAC_LEASE_ID is not set: this kernel was not started by the gpufrac kernel "
            "provisioner (start it from a Jupyter server with jupyter-gpufrac enabled and a "
            "kernelspec or config that asks for a GPU share), so no GPU memory is reserved for "
            "it and nothing limits or moves it. %gpu checkpoint and %gpu restore still work."
        )


def _int(env: Mapping[str, str], key: str, problems: list[str]) -> int | None:
    raw = env.get(key, "").strip()
    if not raw:
        return None
    try:
        value = int(raw)
    except ValueError:
        problems.append(f"{key}: expected a whole number of bytes, got {raw!r}")
        return None
    if value < 0:
        problems.append(f"{key}: expected a number >= 0, got {raw!r}")
        return None
    return value


def parse_restart_reason(raw: str | dict[str, object]) -> RestartReason:
    """Parse GPUFRAC_RESTART_REASON; text that is not the expected JSON becomes the message."""
    try:
        data = json.loads(raw) if isinstance(raw, str) else raw
    except ValueError:
        return RestartReason(cause="unknown", message=str(raw).strip())
    if not isinstance(data, dict):
        return RestartReason(cause="unknown", message=str(data))

    def text(key: str) -> str | None:
        value = data.get(key)
        return None if value is None else str(value)

    return RestartReason(
        cause=text("cause") or "unknown",
        message=text("message") or "",
        from_gpu=text("from_gpu"),
        to_gpu=text("to_gpu"),
    )


def _resumable(raw: str, problems: list[str]) -> Resumable | None:
    """GPUFRAC_RESUMABLE: the folder (a plain name in the checkpoint root) and what it holds."""

    def plain_folder(d: dict[str, Any]) -> bool:
        folder = d.get("folder")
        return (isinstance(folder, str) and bool(folder) and "/" not in folder
                and not folder.startswith(".") and len(folder) <= 255)

    data = _json_object(raw, contract.RESUMABLE, problems, plain_folder)
    if not data:
        return None
    folder = data["folder"]

    def number(key: str) -> float | None:
        value = data.get(key)
        return value if isinstance(value, int | float) and not isinstance(value, bool) else None

    generation, cell, when, variables = (number(key) for key in (
        "generation", "cell", "time", "variables"))
    reason = data.get("reason")
    return Resumable(
        folder=folder,
        reason=parse_restart_reason(reason if isinstance(reason, dict) else {}),
        generation=max(int(generation or 0), 0),
        cell=int(cell) if cell is not None else None,
        time=when, variables=max(int(variables or 0), 0))


def kernel_id_from_connection_file(path: str | None) -> str | None:
    """``kernel-<id>.json`` is how Jupyter names a kernel's connection file."""
    if not path:
        return None
    match = re.match(r"^kernel-(.+)\.json$", os.path.basename(path))
    return match.group(1) if match else None


def default_checkpoint_dir(kernel_id: str | None, home: Path | None = None) -> Path:
    """Where checkpoints go when the provisioner did not say."""
    base = (home or Path.home()) / ".local" / "share" / "jupyter" / "gpufrac" / "checkpoints"
    return base / (kernel_id or f"pid-{os.getpid()}")


def _json_object(raw: str, variable: str, problems: list[str],
                 fits: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
    """The JSON object in ``variable`` when it ``fits``; else {} (said in ``problems``)."""
    if not raw.strip():
        return {}
    try:
        data = json.loads(raw)
    except ValueError:
        data = None
    if not isinstance(data, dict) or not fits(data):
        problems.append(f"{variable} is not the expected JSON: {raw[:80]!r}")
        return {}
    return data


def _disk_shares(raw: str, problems: list[str]) -> dict[str, float]:
    """``{"kernel": 0.25, "user": 0.5}`` (either may be absent) from CHECKPOINT_DISK_SHARES."""
    data = _json_object(raw, contract.CHECKPOINT_DISK_SHARES, problems, lambda d: all(
        key in ("kernel", "user") and isinstance(value, int | float)
        and not isinstance(value, bool) and 0 <= value <= 1 for key, value in d.items()))
    return {key: float(value) for key, value in data.items()}


def _share_source(raw: str, problems: list[str],
                  variable: str = contract.SHARE_SOURCE) -> dict[str, str | None]:
    """``{"request": text, "limit": text or None}`` from ``variable``'s JSON."""
    data = _json_object(raw, variable, problems, lambda d: all(
        isinstance(d.get(k), str | None) for k in ("request", "limit")))
    return {"request": data.get("request"), "limit": data.get("limit")} if data else {}


def parse(env: Mapping[str, str], connection_file: str | None = None) -> KernelEnv:
    """Read the kernel's environment; never raises (malformed values land in ``problems``)."""
    problems: list[str] = []
    kernel_id = env.get(contract.KERNEL_ID) or kernel_id_from_connection_file(connection_file)
    request = _int(env, contract.REQUEST, problems)
    limit = _int(env, contract.LIMIT, problems)
    if request is not None and limit is not None and limit < request:
        problems.append(f"GPUFRAC_LIMIT ({limit}) is below GPUFRAC_REQUEST ({request}); "
                        "using the request as the limit")
        limit = request
    if limit is None:
        limit = request
    if env.get("PYTORCH_NO_CUDA_MEMORY_CACHING", "").strip() not in ("", "0"):
        problems.append("PYTORCH_NO_CUDA_MEMORY_CACHING is set: PyTorch's allocator cap does not "
                        "apply, so only the agent's measurements enforce the limit")
    raw_dir = env.get(contract.CHECKPOINT_DIR, "").strip()
    checkpoint_dir = Path(raw_dir).expanduser() if raw_dir else default_checkpoint_dir(kernel_id)
    raw_reason = env.get(contract.RESTART_REASON, "").strip()
    restore = env.get(contract.RESTORE, "").strip().lower() not in ("", "0", "false", "no")
    checkpoints_off = env.get(contract.NO_CHECKPOINTS, "").strip()[:1000] or None
    generation = _int(env, contract.CHECKPOINT_GENERATION, problems) or 0
    kernel_budget = _int(env, contract.CHECKPOINT_KERNEL_BUDGET, problems)
    user_budget = _int(env, contract.CHECKPOINT_USER_BUDGET, problems)
    staging_budget = _int(env, contract.CHECKPOINT_STAGING_BUDGET, problems)
    disk_shares = _disk_shares(env.get(contract.CHECKPOINT_DISK_SHARES, ""), problems)
    # Without checkpoints no folder is taken over (it could be anyone's).
    resumable = None if checkpoints_off else _resumable(env.get(contract.RESUMABLE, ""), problems)
    return KernelEnv(
        lease_id=env.get(contract.LEASE_ID, "").strip() or None,
        agent_socket=env.get(contract.AGENT_SOCKET, "").strip() or None,
        kernel_id=kernel_id,
        request=request,
        limit=limit,
        gpu_uuid=env.get(contract.GPU_UUID) or None,
        gpu_index=_int(env, contract.GPU_INDEX, problems),
        gpu_name=env.get(contract.GPU_NAME) or None,
        gpu_total=_int(env, contract.GPU_TOTAL, problems),
        context=_int(env, contract.CONTEXT, problems) or 0,
        simulated=env.get(contract.SIMULATED, "") == "1",
        checkpoint_dir=checkpoint_dir,
        # Without checkpoints nothing is written to (or woken in) a folder others can write.
        checkpoint_dir_stable=bool(raw_dir or kernel_id) and not checkpoints_off,
        checkpoint_dir_given=bool(raw_dir) and not checkpoints_off,
        restore=restore,
        parked=env.get(contract.PARKED, "") == "1",
        restart_reason=parse_restart_reason(raw_reason) if raw_reason else None,
        share_source=_share_source(env.get(contract.SHARE_SOURCE, ""), problems),
        remembered_request=(Path(env[contract.REMEMBERED_REQUEST])
                            if env.get(contract.REMEMBERED_REQUEST, "").strip() else None),
        default_share=_share_source(env.get(contract.DEFAULT_SHARE, ""), problems,
                                    contract.DEFAULT_SHARE),
        no_lease_why=env.get(contract.NO_LEASE_REASON, "").strip()[:2000] or None,
        launched_by_provisioner=bool(env.get(contract.KERNEL_ID, "").strip()),
        problems=tuple(problems),
        checkpoints_off=checkpoints_off,
        checkpoint_generation=max(generation, 0),
        checkpoint_kernel_budget=kernel_budget,
        checkpoint_user_budget=user_budget,
        checkpoint_staging_budget=staging_budget,
        checkpoint_disk_shares=disk_shares,
        resumable=resumable,
    )
