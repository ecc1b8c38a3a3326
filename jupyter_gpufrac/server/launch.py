"""Pure pieces of a kernel launch: where request/limit come from, the environment, the arguments."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jupyter_gpufrac import contract
from jupyter_gpufrac.kernel import store
from jupyter_gpufrac.server.podinfo import PodShare
from node_agent.caps import framework_caps
from node_agent.quantities import Quantity, QuantityError, parse_kai_gpu_memory, parse_quantity

EXT_ARGUMENT = f"--ext={contract.KERNEL_EXTENSION}"
RUNAI_LIMIT_VARIABLE = "RUNAI_GPU_MEMORY_LIMIT"
DEFAULT_REQUEST = "0.25"


@dataclass(frozen=True)
class ShareSpec:
    """The request and limit a new lease asks for, parsed, and where each came from (for logs)."""

    request: Quantity
    limit: Quantity | None
    request_source: str
    limit_source: str | None
    # A share of the GPU's compute, from the kernelspec only (fractions; None: not asked).
    compute_request: Quantity | None = None
    compute_limit: Quantity | None = None

    def effective_limit(self, smallest_gpu: int | None) -> Quantity | None:
        """The limit to ask for. A default limit from elsewhere (c.GpuFrac, RUNAI) below a
        request whose own source named no limit would be refused: then none (the request)."""
        limit = self.limit
        if limit is None or self.limit_source == self.request_source or smallest_gpu is None:
            return limit
        return None if limit.bytes_of(smallest_gpu) < self.request.bytes_of(smallest_gpu) else limit


# Run:ai's and KAI's names for a share, each family on its own: a fraction with an optional
# fraction limit, or memory (KAI: whole MiB) with an optional memory limit.
OURS = ("request", "limit")
FRACTION = ("gpu-fraction", "gpu-fraction-limit")
MEMORY = ("gpu-memory", "gpu-memory-limit")
COMPUTE = (("compute_request", "compute_limit"), ("gpu-compute-request", "gpu-compute-limit"))


def _fraction(value: object, field: str) -> Quantity:
    quantity = parse_quantity(value, field)
    if quantity.fraction is None:
        raise QuantityError(field, f"expected a fraction 0 < f <= 1 of one GPU, got {value!r}")
    return quantity


def kernelspec_compute(gpufrac: Mapping[str, Any]) -> tuple[Quantity | None, Quantity | None]:
    """(compute request, compute limit) from ``metadata.gpufrac``, ours or Run:ai's names."""
    given = [family for family in COMPUTE if set(family) & set(gpufrac)]
    if len(given) > 1:
        raise QuantityError("metadata.gpufrac", "compute_request/compute_limit and "
                            "gpu-compute-request/gpu-compute-limit may not be mixed")
    if not given:
        return None, None
    request_name, limit_name = given[0]
    if request_name not in gpufrac:
        raise QuantityError(f"metadata.gpufrac.{limit_name}",
                            f"needs {request_name} beside it (a limit of what request?)")
    limit = gpufrac.get(limit_name)
    return (_fraction(gpufrac[request_name], f"metadata.gpufrac.{request_name}"),
            None if limit is None else _fraction(limit, f"metadata.gpufrac.{limit_name}"))


def kernelspec_share(gpufrac: Mapping[str, Any], environ: Mapping[str, str]
                     ) -> tuple[Quantity | None, Quantity | None]:
    """(request, limit) from ``metadata.gpufrac`` in our names or Run:ai's; the families
    cannot be mixed, and a limit said twice (also by RUNAI_GPU_MEMORY_LIMIT) is refused."""
    given = [family for family in (OURS, FRACTION, MEMORY) if set(family) & set(gpufrac)]
    if len(given) > 1:
        names = " and ".join("/".join(family) for family in given)
        raise QuantityError("metadata.gpufrac", f"{names} may not be mixed: use one family")
    if not given or given[0] == OURS:
        return (_optional(gpufrac.get("request"), "metadata.gpufrac.request"),
                _optional(gpufrac.get("limit"), "metadata.gpufrac.limit"))
    request_name, limit_name = given[0]
    field = f"metadata.gpufrac.{request_name}"
    if request_name not in gpufrac:
        raise QuantityError(f"metadata.gpufrac.{limit_name}",
                            f"needs {request_name} beside it (a limit of what request?)")
    if limit_name in gpufrac and environ.get(RUNAI_LIMIT_VARIABLE):
        raise QuantityError(f"metadata.gpufrac.{limit_name}",
                            f"{RUNAI_LIMIT_VARIABLE} also sets the limit; say it once")
    if given[0] == FRACTION:
        limit = gpufrac.get(limit_name)
        return (_fraction(gpufrac[request_name], field),
                None if limit is None else _fraction(limit, f"metadata.gpufrac.{limit_name}"))
    limit = gpufrac.get(limit_name)
    return (parse_kai_gpu_memory(gpufrac[request_name], field),
            None if limit is None else parse_kai_gpu_memory(limit, f"metadata.gpufrac.{limit_name}"))


def resolve_share(
    kernelspec_metadata: Mapping[str, Any] | None,
    last_request: Mapping[str, Any] | None,
    environ: Mapping[str, str],
    default_request: str,
    default_limit: str,
    pod: PodShare | None = None,
) -> ShareSpec:
    """Pick request and limit for a new kernel's lease.

    Sources, first that says wins: the kernelspec's ``metadata.gpufrac``, the share KAI gave
    the pod (its annotations: the cluster's plan counts it there), the user's last ``%gpu
    request``, ``c.GpuFrac``; the environment's ``RUNAI_GPU_MEMORY_LIMIT`` is a limit.
    Every value is checked here so that a typo names its source (raises QuantityError).
    """
    gpufrac = (kernelspec_metadata or {}).get("gpufrac") or {}
    if not isinstance(gpufrac, Mapping):
        raise QuantityError("metadata.gpufrac", f"expected a mapping, got {gpufrac!r}")
    spec_request, spec_limit = kernelspec_share(gpufrac, environ)
    compute = kernelspec_compute(gpufrac)
    last = last_request or {}
    runai_limit = _optional(environ.get(RUNAI_LIMIT_VARIABLE) or None, RUNAI_LIMIT_VARIABLE)
    # (source, request, limit), first wins; each parsed here so that a typo names its field.
    sources: list[tuple[str, Quantity | None, Quantity | None]] = [
        (contract.SOURCE_KERNELSPEC, spec_request, spec_limit),
        *([(pod.source, pod.request, pod.limit)] if pod is not None else []),
        (contract.SOURCE_REMEMBERED, _optional(last.get("request"), "%gpu request"),
         _optional(last.get("limit"), "%gpu request --limit")),
        (contract.SOURCE_CONFIG,
         parse_quantity(default_request or DEFAULT_REQUEST, "c.GpuFrac.default_request"),
         _optional(default_limit or None, "c.GpuFrac.default_limit")),
    ]
    # The last source always has a request, so this finds one.
    at = next(i for i, source in enumerate(sources) if source[1] is not None)
    request_source, request = sources[at][0], sources[at][1]
    assert request is not None
    # The limit: the request's own source, then the platform's RUNAI_GPU_MEMORY_LIMIT, then
    # later sources -- never an earlier one (a kernelspec asking for 0.5 must not inherit a
    # smaller limit from another notebook's last request). The platform's limit beats the
    # config default.
    own = (request_source, sources[at][2])
    runai = (contract.SOURCE_RUNAI, runai_limit)
    later = [(name, limit) for name, _, limit in sources[at + 1 :]]
    limits = [runai, own] if request_source == contract.SOURCE_CONFIG else [own, runai, *later]
    for limit_source, limit in limits:
        if limit is not None:
            return ShareSpec(request, limit, request_source, limit_source, *compute)
    return ShareSpec(request, None, request_source, None, *compute)


def _optional(value: object, field: str) -> Quantity | None:
    return None if value is None else parse_quantity(value, field)


def lease_gpus(lease: Mapping[str, Any]) -> list[str]:
    """UUIDs the kernel should run on: the migration target while migrating, else physical."""
    if lease.get("state") == "migrating" and lease.get("target_gpus"):
        return list(lease["target_gpus"])
    gpus = lease.get("physical_gpus") or []
    if not gpus and lease.get("physical_gpu"):
        gpus = [lease["physical_gpu"]]
    return list(gpus)


def is_ipykernel(argv: Sequence[str], language: str) -> bool:
    """Whether the kernel is IPython's, the only one that can load our extension."""
    return language.lower() == "python" and any("ipykernel" in arg for arg in argv)


def kernel_arguments(extra_arguments: Sequence[str] | None, load_extension: bool) -> list[str]:
    """A NEW extra-argument list with our extension exactly once.

    pre_launch gets a shallow copy of the launch arguments and runs on every restart:
    appending to the list it was given would add one more ``--ext`` per restart.
    """
    arguments = [arg for arg in (extra_arguments or []) if arg != EXT_ARGUMENT]
    if load_extension:
        arguments.append(EXT_ARGUMENT)
    return arguments


def build_kernel_env(
    base: Mapping[str, str],
    *,
    kernel_id: str,
    socket_path: str,
    checkpoint_dir: str,
    lease: Mapping[str, Any] | None,
    gpus: Mapping[str, Mapping[str, Any]],
    simulated: bool,
    restart_reason: Mapping[str, Any] | None,
    hide_gpus: bool,
    share_source: Mapping[str, str | None] | None = None,
    remembered_request: str | None = None,
    checkpoints_off: str | None = None,
    checkpoint_generation: int = 0,
    default_share: Mapping[str, str | None] | None = None,
    no_lease_reason: str | None = None,
    checkpoint_budgets: tuple[int | None, int | None, int | None] = (None, None, None),
    checkpoint_disk_shares: Mapping[str, float] | None = None,
    resumable: Mapping[str, Any] | None = None,
) -> dict[str, str]:
    """A NEW environment for the kernel (docs/agent-api.md, "Kernel environment").

    Without a lease, ``hide_gpus`` says whether to set ``CUDA_VISIBLE_DEVICES=""``: we do
    when the agent answered but gave no lease (the GPUs are leased to others) and leave it
    alone when no agent runs at all (then nothing on this node is managed).
    """
    env = {key: value for key, value in base.items() if key not in contract.LAUNCH_VARIABLES}
    env[contract.AGENT_SOCKET] = socket_path
    env[contract.KERNEL_ID] = kernel_id
    env[contract.CHECKPOINT_DIR] = checkpoint_dir
    if remembered_request:
        env[contract.REMEMBERED_REQUEST] = remembered_request
    if default_share is not None:
        env[contract.DEFAULT_SHARE] = json.dumps(dict(default_share), sort_keys=True)
    if checkpoints_off:
        env[contract.NO_CHECKPOINTS] = checkpoints_off
    if checkpoint_generation:
        # The newest checkpoint the server saw: a restore of an older one says so.
        env[contract.CHECKPOINT_GENERATION] = str(int(checkpoint_generation))
    # Bytes the kernel's checkpoint, and all the user's, may take on disk, and its snapshot in
    # memory (c.GpuFrac): it protects what fits and names the rest.
    for key, budget in zip((contract.CHECKPOINT_KERNEL_BUDGET, contract.CHECKPOINT_USER_BUDGET,
                            contract.CHECKPOINT_STAGING_BUDGET), checkpoint_budgets, strict=True):
        if budget is not None:
            env[key] = str(int(budget))
    if checkpoint_disk_shares:
        # Those set as shares of the free disk: the kernel measures the disk as it changes.
        env[contract.CHECKPOINT_DISK_SHARES] = json.dumps(dict(checkpoint_disk_shares),
                                                          sort_keys=True)
    if resumable is not None:
        env[contract.RESUMABLE] = json.dumps(dict(resumable), sort_keys=True)
    if restart_reason is not None:
        # Without a lease too: a notebook resumed on a node with no GPU share for it.
        env[contract.RESTORE] = "1"
        env[contract.RESTART_REASON] = json.dumps(dict(restart_reason), sort_keys=True)
    if lease is None:
        if hide_gpus:
            env["CUDA_VISIBLE_DEVICES"] = ""
        if no_lease_reason:
            env[contract.NO_LEASE_REASON] = no_lease_reason
        return env
    uuids = lease_gpus(lease)
    env.update(gpu_variables(lease, gpus))
    if lease.get("state") == "parked":
        env[contract.PARKED] = "1"
        # torch.cuda.is_available() then asks NVML, not the CUDA driver: a driver initialised
        # while parked would never see the GPU the kernel gets back.
        env["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"
    env[contract.LEASE_ID] = str(lease["id"])
    env[contract.REQUEST] = str(int(lease["request"]))
    env[contract.LIMIT] = str(int(lease["limit"]))
    if share_source is not None:
        env[contract.SHARE_SOURCE] = json.dumps(dict(share_source), sort_keys=True)
    if uuids:
        gpu = gpus.get(uuids[0], {})
        env[contract.GPU_UUID] = uuids[0]
        if gpu.get("index") is not None:
            env[contract.GPU_INDEX] = str(int(gpu["index"]))
        if gpu.get("name"):
            env[contract.GPU_NAME] = str(gpu["name"])
        if gpu.get("memory_total") is not None:
            env[contract.GPU_TOTAL] = str(int(gpu["memory_total"]))
        if gpu.get("context_size"):
            env[contract.CONTEXT] = str(int(gpu["context_size"]))
    if simulated:
        env[contract.SIMULATED] = "1"
    return env


def gpu_variables(lease: Mapping[str, Any], gpus: Mapping[str, Mapping[str, Any]]
                  ) -> dict[str, str]:
    """What a launch under ``lease`` sets that frameworks read when they first touch a GPU:
    ``CUDA_VISIBLE_DEVICES`` and each framework's cap (a spare kernel made ready for the
    launch is given the same, before it makes CUDA's context)."""
    uuids = lease_gpus(lease)
    env = {"CUDA_VISIBLE_DEVICES": ",".join(uuids)}
    if uuids:
        gpu = gpus.get(uuids[0], {})
        env.update(framework_caps(int(lease["limit"]), int(gpu.get("context_size") or 0),
                                  gpu.get("memory_total"), len(uuids),
                                  lease.get("compute_limit")))
    return env


def checkpoint_dir_of(root: str, kernel_id: str) -> str:
    """The kernel's own checkpoint directory under ``root`` (only the name)."""
    return os.path.join(root, kernel_id)


def kernel_checkpoint_dir(root: str, kernel_id: str) -> str:
    """The kernel's own checkpoint directory, created 0700 (checkpoints are unpickled).

    Both folders are opened without following a link and checked ours alone (a root deleted
    meanwhile is made again, 0700, and marked); raises UnsafeCheckpointError or OSError (the
    caller starts the kernel without checkpoints).
    """
    path = checkpoint_dir_of(root, kernel_id)
    store.ensure_private_dir(Path(path))
    return path
