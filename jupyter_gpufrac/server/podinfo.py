"""What Kubernetes tells a notebook pod of itself: KAI's share in its annotations, the GPUs it got."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from jupyter_gpufrac import contract
from node_agent.quantities import Quantity, QuantityError, parse_kai_gpu_memory, parse_quantity

# KAI's annotations (and Run:ai's, which KAI keeps).
FRACTION = "gpu-fraction"
MEMORY = "gpu-memory"
DEVICES = "gpu-fraction-num-devices"
FRACTION_CONTAINER = "gpu-fraction-container-name"
# KAI's per-container form: nvidia.com/container.<name>.gpu-memory.request / .limit, and the
# devices it granted the container.
CONTAINER_MEMORY = "nvidia.com/container.{container}.gpu-memory.{which}"
CONTAINER_DEVICES = "nvidia.com/container.{container}.gpus.devices"
# What KAI's binder (and the device plugin) set: the GPUs the container was given.
VISIBLE_DEVICES = "NVIDIA_VISIBLE_DEVICES"


@dataclass(frozen=True)
class PodShare:
    """The share the cluster gave the pod, and where it was read (for logs and the panel)."""

    request: Quantity
    limit: Quantity | None
    devices: int
    source: str


@dataclass(frozen=True)
class PodInfo:
    """The downward API's files of the pod (``GPUFRAC_PODINFO``) and its container's name."""

    annotations: Mapping[str, str]
    namespace: str
    name: str
    container: str

    def share(self) -> PodShare | None:
        """KAI's share for this container: the per-container annotations, else the pod's
        ``gpu-fraction`` or ``gpu-memory`` (unless ``gpu-fraction-container-name`` gives it to
        another container); None when the pod has none."""
        notes = self.annotations
        devices = _devices(notes)
        request_key = CONTAINER_MEMORY.format(container=self.container, which="request")
        limit_key = CONTAINER_MEMORY.format(container=self.container, which="limit")
        if request_key in notes:
            limit = notes.get(limit_key)
            return PodShare(_container_memory(notes[request_key], request_key),
                            None if limit is None else _container_memory(limit, limit_key),
                            devices, f"pod annotation {request_key}")
        if limit_key in notes:
            raise QuantityError(limit_key, f"needs {request_key} beside it (a limit of what request?)")
        owner = notes.get(FRACTION_CONTAINER)
        if owner and owner != self.container:
            return None
        if FRACTION in notes and MEMORY in notes:
            raise QuantityError(FRACTION, f"the pod has both {FRACTION} and {MEMORY}; KAI takes one")
        if FRACTION in notes:
            quantity = parse_quantity(notes[FRACTION], f"pod annotation {FRACTION}")
            if quantity.fraction is None:
                raise QuantityError(f"pod annotation {FRACTION}",
                                    f"expected a fraction 0 < f <= 1 of one GPU, got {notes[FRACTION]!r}")
            return PodShare(quantity, None, devices, f"pod annotation {FRACTION}")
        if MEMORY in notes:
            return PodShare(parse_kai_gpu_memory(notes[MEMORY], f"pod annotation {MEMORY}"), None,
                            devices, f"pod annotation {MEMORY}")
        return None


def _devices(notes: Mapping[str, str]) -> int:
    value = notes.get(DEVICES, "1")
    if not value.isdigit() or int(value) < 1:
        raise QuantityError(f"pod annotation {DEVICES}", f"expected a whole number of GPUs, got {value!r}")
    return int(value)


def _container_memory(value: str, field: str) -> Quantity:
    """A whole number is MiB, as KAI's ``gpu-memory``; otherwise a size such as 4Gi."""
    if value.isdigit():
        return parse_kai_gpu_memory(value, f"pod annotation {field}")
    quantity = parse_quantity(value, f"pod annotation {field}")
    if quantity.nbytes is None:
        raise QuantityError(f"pod annotation {field}", f"expected a memory size, got {value!r}")
    return quantity


def read_podinfo(environ: Mapping[str, str]) -> PodInfo | None:
    """The pod's downward API files, where ``GPUFRAC_PODINFO`` names their folder; else None."""
    folder = environ.get(contract.PODINFO)
    if not folder:
        return None

    def text(name: str) -> str:
        try:
            return (Path(folder) / name).read_text(encoding="utf-8")
        except FileNotFoundError:
            return ""

    return PodInfo(parse_annotations(text("annotations")), text("namespace").strip(),
                   text("name").strip(), environ.get(contract.CONTAINER) or "notebook")


_LINE = re.compile(r'^([^=]+)="(.*)"$')
_ESCAPES = {"a": b"\a", "b": b"\b", "f": b"\f", "n": b"\n", "r": b"\r", "t": b"\t", "v": b"\v",
            "\\": b"\\", '"': b'"', "'": b"'"}


def parse_annotations(text: str) -> dict[str, str]:
    """The downward API's ``annotations`` file: one ``key="value"`` per line, the value quoted
    as Go's ``strconv.Quote`` does."""
    out: dict[str, str] = {}
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        match = _LINE.match(line)
        if match is None:
            raise QuantityError(contract.PODINFO, f"annotations line {number}: expected "
                                f'key="value", got {line[:80]!r}')
        out[match.group(1)] = _unquote(match.group(2), number)
    return out


def _unquote(quoted: str, number: int) -> str:
    out = bytearray()
    i = 0
    while i < len(quoted):
        char = quoted[i]
        if char != "\\":
            out += char.encode()
            i += 1
            continue
        kind = quoted[i + 1: i + 2]
        width = {"x": 2, "u": 4, "U": 8}.get(kind)
        if kind in _ESCAPES:
            out += _ESCAPES[kind]
            i += 2
        elif width and re.fullmatch(f"[0-9a-fA-F]{{{width}}}", quoted[i + 2: i + 2 + width]):
            code = int(quoted[i + 2: i + 2 + width], 16)
            try:
                out += bytes([code]) if kind == "x" else chr(code).encode()
            except (ValueError, OverflowError, UnicodeEncodeError):
                raise QuantityError(contract.PODINFO, f"annotations line {number}: no character "
                                    f"{quoted[i:i + 2 + width]!r}") from None
            i += 2 + width
        else:
            raise QuantityError(contract.PODINFO, f"annotations line {number}: bad escape "
                                f"{quoted[i:i + 2]!r}")
    return out.decode("utf-8", "replace")


def cluster_gpus(environ: Mapping[str, str], pod: PodInfo | None = None) -> tuple[str, ...] | None:
    """The GPUs the cluster gave the container: KAI's per-container ``gpus.devices`` annotation,
    else ``NVIDIA_VISIBLE_DEVICES``, when they name them by UUID, plain or as CDI devices
    (``k8s.device-plugin.nvidia.com/gpu=GPU-…``); None when they name none, all, or indexes (no
    plan to take)."""
    value = environ.get(VISIBLE_DEVICES, "")
    if pod is not None:
        value = pod.annotations.get(CONTAINER_DEVICES.format(container=pod.container), value)
    uuids = tuple(dict.fromkeys(u.rpartition("=")[2].strip()
                                for u in value.strip().split(",") if u.strip()))
    if not uuids or not all(u.startswith("GPU-") for u in uuids):
        return None
    return uuids


def reachable_gpus(environ: Mapping[str, str], planned: tuple[str, ...] | None
                   ) -> tuple[str, ...] | None:
    """The GPUs the kernels of this container can run on: every GPU of the node where the
    admin says the container sees them all (``GPUFRAC_REACHABLE_GPUS=all``), the ones listed
    there, else those the cluster gave it (None: any)."""
    value = environ.get(contract.REACHABLE_GPUS, "").strip()
    if value == "all":
        return None
    if value:
        return tuple(u.strip() for u in value.split(",") if u.strip())
    return planned
