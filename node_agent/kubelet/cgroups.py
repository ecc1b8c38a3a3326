"""Which pod and container a process runs in: its cgroup names both, the kubelet's log links name them."""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from dataclasses import dataclass

# Where the kubelet links each container's log as <pod>_<namespace>_<container>-<id>.log.
CONTAINER_LOGS = "/var/log/containers"

# The pod's UID in a kubepods cgroup: pod<uid> (cgroupfs) or ...-pod<uid with _>.slice (systemd).
_POD_UID = re.compile(r"pod([0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12})")
# The container's id ends its cgroup: <id>, cri-containerd-<id>.scope, crio-<id>.scope, docker-<id>.scope.
_CONTAINER_ID = re.compile(r"(?:^|[-/])([0-9a-f]{64})(?:\.scope)?$")


@dataclass(frozen=True)
class PodContainer:
    """A container of a pod, as Kubernetes names it."""

    namespace: str
    pod: str
    container: str


def pod_of_cgroup(cgroup: str) -> tuple[str, str] | None:
    """(pod UID, container id) from ``/proc/<pid>/cgroup``; None outside a pod. The container
    id is "" where the path stops at the pod (a process of the pod's sandbox)."""
    for line in cgroup.splitlines():
        path = line.split(":", 2)[-1].rstrip("/")
        if "kubepods" not in path:
            continue
        uid = _POD_UID.search(path)
        if uid is None:
            continue
        container = _CONTAINER_ID.search(path)
        return uid.group(1).replace("_", "-"), container.group(1) if container else ""
    return None


def containers_by_id(names: Iterable[str]) -> dict[str, PodContainer]:
    """Container id -> the container, from the file names of the kubelet's log links (pod and
    namespace names hold no ``_``; a container's name no ``-`` before its 64-digit id)."""
    out: dict[str, PodContainer] = {}
    for name in names:
        if not name.endswith(".log"):
            continue
        parts = name[: -len(".log")].split("_")
        if len(parts) != 3:
            continue
        pod, namespace, rest = parts
        container, _, container_id = rest.rpartition("-")
        if container and len(container_id) == 64:
            out[container_id] = PodContainer(namespace, pod, container)
    return out


def container_of(pid: int, log_dir: str = CONTAINER_LOGS) -> PodContainer | None:
    """The pod container process ``pid`` runs in, where its cgroup and the kubelet's log links
    say; None outside Kubernetes or where the links cannot be read."""
    try:
        with open(f"/proc/{pid}/cgroup") as f:
            found = pod_of_cgroup(f.read())
        if found is None or not found[1]:
            return None
        return containers_by_id(os.listdir(log_dir)).get(found[1])
    except OSError:
        return None
