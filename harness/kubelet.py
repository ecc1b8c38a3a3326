"""A kubelet's PodResources v1 server, built from the published .proto with grpc_tools, on a Unix socket."""

from __future__ import annotations

import importlib
import sys
import tempfile
import threading
from concurrent import futures
from pathlib import Path
from types import ModuleType, TracebackType
from typing import Any

import grpc
from grpc_tools import protoc

from harness.agent import ROOT

PROTO = ROOT / "node_agent" / "kubelet" / "podresources.proto"
GPU = "nvidia.com/gpu"

_compiled: tuple[ModuleType, ModuleType] | None = None


def compiled() -> tuple[ModuleType, ModuleType]:
    """(messages, services) that protoc generates from the .proto, compiled once per process."""
    global _compiled
    if _compiled is None:
        # Imported, the modules live in memory: their folder goes (one was left per process).
        with tempfile.TemporaryDirectory(prefix="gpufrac-podresources-") as out:
            status = protoc.main(["protoc", f"-I{PROTO.parent}", f"--python_out={out}",
                                  f"--grpc_python_out={out}", PROTO.name])
            if status != 0:
                raise RuntimeError(f"protoc failed on {PROTO} ({status})")
            sys.path.insert(0, out)
            try:
                _compiled = (importlib.import_module("podresources_pb2"),
                             importlib.import_module("podresources_pb2_grpc"))
            finally:
                sys.path.remove(out)
    return _compiled


class FakeKubelet:
    """Serves ``List`` (and ``GetAllocatableResources``) for the pods a test sets, as a kubelet
    does: one entry per container, devices by resource. A context manager."""

    def __init__(self, socket_path: str | Path) -> None:
        self.socket_path = str(socket_path)
        self._pods: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self.lists = 0
        self._server: grpc.Server | None = None

    def set_pods(self, pods: list[dict[str, Any]]) -> None:
        """``[{"namespace", "name", "containers": [{"name", "devices": {resource: [ids]}}]}]``."""
        with self._lock:
            self._pods = pods

    def hold(self, namespace: str, pod: str, gpus: list[str], container: str = "main") -> None:
        """One more pod whose one container holds ``gpus`` whole."""
        with self._lock:
            self._pods = [*self._pods, {"namespace": namespace, "name": pod, "containers": [
                {"name": container, "devices": {GPU: list(gpus)}}]}]

    def end(self, pod: str) -> None:
        with self._lock:
            self._pods = [p for p in self._pods if p["name"] != pod]

    def _response(self) -> Any:
        pb, _ = compiled()
        with self._lock:
            pods = list(self._pods)
            self.lists += 1
        return pb.ListPodResourcesResponse(pod_resources=[
            pb.PodResources(name=pod["name"], namespace=pod["namespace"], containers=[
                pb.ContainerResources(
                    name=c["name"],
                    devices=[pb.ContainerDevices(resource_name=resource, device_ids=ids,
                                                 topology=pb.TopologyInfo(nodes=[pb.NUMANode(ID=0)]))
                             for resource, ids in c["devices"].items()],
                    # What a real kubelet lists beside devices: the agent must skip it.
                    cpu_ids=[0, 1],
                    memory=[pb.ContainerMemory(memory_type="memory", size=2**30)])
                for c in pod["containers"]])
            for pod in pods])

    def start(self) -> FakeKubelet:
        pb, services = compiled()
        kubelet = self

        class Lister(services.PodResourcesListerServicer):  # type: ignore[name-defined,misc]
            def List(self, request: Any, context: Any) -> Any:
                return kubelet._response()

            def GetAllocatableResources(self, request: Any, context: Any) -> Any:
                return pb.AllocatableResourcesResponse()

        server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        services.add_PodResourcesListerServicer_to_server(Lister(), server)
        server.add_insecure_port(f"unix://{self.socket_path}")
        server.start()
        self._server = server
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop(grace=None).wait()
            self._server = None
        Path(self.socket_path).unlink(missing_ok=True)

    def __enter__(self) -> FakeKubelet:
        return self.start()

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.stop()
