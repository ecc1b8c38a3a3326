"""Which GPUs of this node each container holds whole, from what the kubelet lists."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from node_agent.kubelet.podresources import ContainerDevices

GPU_RESOURCE = "nvidia.com/gpu"
# Where KAI (and Run:ai before it) runs the pods that reserve a GPU for the fractional pods
# sharing it: bookkeeping of the cluster's plan, not workloads.
RESERVATION_NAMESPACES = ("kai-resource-reservation", "runai-reservation")


@dataclass(frozen=True)
class WholeGpus:
    """A container that holds whole GPUs: a job lease pinned to exactly them."""

    namespace: str
    pod: str
    container: str
    gpus: tuple[str, ...]

    @property
    def key(self) -> str:
        """``namespace/pod/container``: the name its lease carries."""
        return f"{self.namespace}/{self.pod}/{self.container}"


def whole_gpu_claims(listed: Iterable[ContainerDevices], resources: Iterable[str],
                     index_to_uuid: Mapping[int, str],
                     reservations: Iterable[str] = RESERVATION_NAMESPACES,
                     ) -> tuple[dict[str, WholeGpus], list[str]]:
    """(claims by key, device ids that name no GPU of this node) for the whole-GPU resources.

    The NVIDIA device plugin names a GPU by its UUID, or by its index where it was set up
    with ``DEVICE_ID_STRATEGY=index``; a MIG device (``MIG-…``) is not a whole GPU. Pods in
    the ``reservations`` namespaces hold a GPU for the notebooks that share it: not jobs.
    """
    wanted = set(resources)
    skipped = set(reservations)
    uuids = set(index_to_uuid.values())
    claims: dict[str, WholeGpus] = {}
    unknown: list[str] = []
    for entry in listed:
        if entry.resource not in wanted or entry.namespace in skipped:
            continue
        gpus: list[str] = []
        for device in entry.device_ids:
            uuid = device if device in uuids else (
                index_to_uuid.get(int(device)) if device.isascii() and device.isdigit() else None)
            if uuid is None:
                unknown.append(device)
            elif uuid not in gpus:
                gpus.append(uuid)
        if gpus:
            claim = WholeGpus(entry.namespace, entry.pod, entry.container, tuple(gpus))
            before = claims.get(claim.key)
            if before is not None:  # two whole-GPU resources in one container
                claim = WholeGpus(claim.namespace, claim.pod, claim.container,
                                  tuple(dict.fromkeys(before.gpus + claim.gpus)))
            claims[claim.key] = claim
    return claims, unknown
