"""The kubelet's PodResources v1 ``List`` over its Unix socket: which devices each container holds."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from typing import Any

# The messages the agent reads, built from their descriptors at run time: no generated code to
# keep in step with the protobuf runtime. Field numbers are podresources.proto's; fields the
# agent does not read (CPUs, memory, topology, dynamic resources) are skipped as unknown.
_STRING, _MESSAGE = 9, 11
_OPTIONAL, _REPEATED = 1, 3
_MESSAGES: dict[str, tuple[tuple[str, int, int, int, str], ...]] = {
    # name: ((field, number, label, type, message type), ...)
    "ListPodResourcesRequest": (),
    "ListPodResourcesResponse": (("pod_resources", 1, _REPEATED, _MESSAGE, "PodResources"),),
    "PodResources": (("name", 1, _OPTIONAL, _STRING, ""), ("namespace", 2, _OPTIONAL, _STRING, ""),
                     ("containers", 3, _REPEATED, _MESSAGE, "ContainerResources")),
    "ContainerResources": (("name", 1, _OPTIONAL, _STRING, ""),
                           ("devices", 2, _REPEATED, _MESSAGE, "ContainerDevices")),
    "ContainerDevices": (("resource_name", 1, _OPTIONAL, _STRING, ""),
                         ("device_ids", 2, _REPEATED, _STRING, "")),
}
PACKAGE = "v1"
LIST_METHOD = f"/{PACKAGE}.PodResourcesLister/List"


class KubeletError(Exception):
    """The kubelet could not be asked (no socket, not serving, an error answer)."""


@dataclass(frozen=True)
class ContainerDevices:
    """The devices of one resource that the kubelet gave one container."""

    namespace: str
    pod: str
    container: str
    resource: str
    device_ids: tuple[str, ...]


@cache
def _classes() -> dict[str, Any]:
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

    proto = descriptor_pb2.FileDescriptorProto(
        name="gpufrac/podresources_v1.proto", package=PACKAGE, syntax="proto3")
    for name, fields in _MESSAGES.items():
        message = proto.message_type.add(name=name)
        for field, number, label, kind, of in fields:
            added = message.field.add(name=field, number=number, label=label, type=kind)
            if of:
                added.type_name = f".{PACKAGE}.{of}"
    # A pool of our own: the kubelet's names must not clash with another copy of them (a
    # generated module) in the default pool.
    pool = descriptor_pool.DescriptorPool()
    pool.Add(proto)
    return {name: message_factory.GetMessageClass(pool.FindMessageTypeByName(f"{PACKAGE}.{name}"))
            for name in _MESSAGES}


def container_devices(answer: bytes) -> list[ContainerDevices]:
    """Every (container, resource) with devices in a serialised ``ListPodResourcesResponse``."""
    response = _classes()["ListPodResourcesResponse"].FromString(answer)
    return [
        ContainerDevices(pod.namespace, pod.name, container.name, devices.resource_name,
                         tuple(devices.device_ids))
        for pod in response.pod_resources
        for container in pod.containers
        for devices in container.devices
        if devices.device_ids
    ]


class PodResourcesClient:
    """The kubelet's PodResources API on its socket, over one channel kept between calls
    (gRPC reconnects it when the kubelet restarts)."""

    def __init__(self, socket_path: str, timeout: float = 5.0) -> None:
        self.socket_path = socket_path
        self.timeout = timeout
        self._channel: Any = None
        self._list: Any = None

    async def list_devices(self) -> list[ContainerDevices]:
        """Which devices each container on the node holds (``List``)."""
        try:
            import grpc
            from grpc import aio
        except ImportError as exc:  # the agent's Kubernetes mode is an extra
            raise KubeletError("the kubelet's API needs grpcio: pip install "
                               "'jupyter-gpufrac[kubernetes]'") from exc
        if self._channel is None:
            # Reconnect soon after the kubelet is back: gRPC's default backoff grows to 2 min.
            self._channel = aio.insecure_channel(
                f"unix://{self.socket_path}",
                options=[("grpc.initial_reconnect_backoff_ms", 500),
                         ("grpc.max_reconnect_backoff_ms", 5000)])
            self._list = self._channel.unary_unary(
                LIST_METHOD, request_serializer=lambda m: m.SerializeToString(),
                response_deserializer=bytes)
        try:
            answer = await self._list(_classes()["ListPodResourcesRequest"](), timeout=self.timeout)
        except grpc.RpcError as exc:
            code = exc.code() if isinstance(exc, grpc.Call) else None
            details = exc.details() if isinstance(exc, grpc.Call) else str(exc)
            raise KubeletError(f"PodResources List on {self.socket_path}: {code}: {details}") from exc
        return container_devices(answer)

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
            self._channel = self._list = None
