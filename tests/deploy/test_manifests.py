"""deploy/kubernetes: every manifest meets Kubernetes' schema, the kustomization applies all of
them, and the agent's DaemonSet is granted what docs/kubernetes.md says and nothing more."""

from __future__ import annotations

import re
import subprocess
import sys
from functools import cache
from pathlib import PurePosixPath
from typing import Any

import pytest
import yaml

from deploy.manifests import (
    DEPLOY,
    DOCS,
    NOT_OBJECTS,
    Manifest,
    documents,
    env_of,
    objects,
    only,
    relative,
    validate,
    yaml_files,
)
from harness.agent import ROOT

# The host paths the agent mounts, each with its hostPath type, where it is mounted, and
# whether read-only; see docs/kubernetes.md, "What the DaemonSet may do".
HOST_PATHS = {
    "/run/gpufrac": ("DirectoryOrCreate", "/run/gpufrac", False),
    "/var/lib/gpufrac": ("DirectoryOrCreate", "/var/lib/gpufrac", False),
    "/var/lib/kubelet/pod-resources": ("Directory", "/var/lib/kubelet/pod-resources", True),
    "/var/log/containers": ("Directory", "/var/log/containers", True),
    "/dev/null": ("CharDevice", "/var/run/nvidia-container-devices/all", True),
}
CAPABILITIES = {"KILL", "SYS_PTRACE"}
RBAC_KINDS = {"Role", "ClusterRole", "RoleBinding", "ClusterRoleBinding"}


def pod_spec() -> Manifest:
    spec: Manifest = only("DaemonSet")["spec"]["template"]["spec"]
    return spec


def agent() -> Manifest:
    containers = pod_spec()["containers"]
    assert [c["name"] for c in containers] == ["agent"], "the DaemonSet runs the agent alone"
    container: Manifest = containers[0]
    return container


def flag(command: list[str], name: str) -> str:
    """The value of ``--name VALUE`` or ``--name=VALUE`` in a command line."""
    for i, word in enumerate(command):
        if word == name:
            return command[i + 1]
        if word.startswith(name + "="):
            return word.split("=", 1)[1]
    raise AssertionError(f"{name} is not in the agent's command {command}")


# --- the schemas ---------------------------------------------------------------------------
@pytest.mark.parametrize("name", [relative(p) for p in yaml_files()])
def test_every_yaml_file_is_a_valid_object_or_a_known_other_file(name: str) -> None:
    docs = documents(DEPLOY / name)
    assert docs, f"{name} holds no YAML document"
    if name in NOT_OBJECTS:
        assert all("kind" not in doc or doc["kind"] == "Kustomization" for doc in docs), name
        return
    for doc in docs:
        assert {"apiVersion", "kind", "metadata"} <= set(doc), f"{name}: not a Kubernetes object"
        validate(doc, name)


def test_the_schema_check_refuses_what_kubectl_would() -> None:
    """The check above is strict: an unknown field, a wrong type, a missing field all fail."""
    daemonset = only("DaemonSet")
    broken: list[tuple[str, Any]] = [
        ("an unknown field", lambda d: d["spec"]["template"]["spec"].update(hostPid=True)),
        ("a wrong type", lambda d: d["spec"]["template"]["spec"].update(hostPID="yes")),
        ("a missing field", lambda d: d["spec"].pop("selector")),
    ]
    for what, change in broken:
        copy = yaml.safe_load(yaml.safe_dump(daemonset))
        change(copy)
        with pytest.raises(AssertionError):
            validate(copy, what)


def test_the_kustomization_applies_every_manifest() -> None:
    """A new manifest must be listed, or `kubectl apply -k` would silently leave it out."""
    (kustomization,) = documents(DEPLOY / "kustomization.yaml")
    assert kustomization["apiVersion"] == "kustomize.config.k8s.io/v1beta1"
    assert kustomization["kind"] == "Kustomization"
    resources = kustomization["resources"]
    assert len(resources) == len(set(resources)), "a resource listed twice"
    manifests = {name for name in objects() if PurePosixPath(name).parts[0] != "examples"}
    assert set(resources) == manifests
    # Everything lands in the kustomization's namespace, which the manifests name too (so that
    # `kubectl apply -f` of one file does the same).
    namespace = kustomization["namespace"]
    for name in resources:
        for doc in documents(DEPLOY / name):
            if doc["kind"] == "Namespace":
                assert doc["metadata"]["name"] == namespace
            else:
                assert doc["metadata"].get("namespace") == namespace, f"{name}: {doc['kind']}"
    # `kustomize edit set image <placeholder>=<your image>` must find the DaemonSet's image.
    placeholder = agent()["image"].rsplit(":", 1)[0]
    assert [image["name"] for image in kustomization.get("images", [])] == [placeholder]


# --- what the agent may do -----------------------------------------------------------------
def test_the_agent_sees_host_processes_and_nothing_else_of_the_host() -> None:
    spec = pod_spec()
    assert spec["hostPID"] is True
    for other in ("hostNetwork", "hostIPC", "hostUsers"):
        assert other not in spec, f"{other}: the agent needs the host's processes only"
    assert spec["priorityClassName"] == "system-node-critical"


def test_the_agent_runs_as_root_with_only_the_capabilities_it_needs() -> None:
    context = agent()["securityContext"]
    assert context.get("privileged", False) is False
    assert context["allowPrivilegeEscalation"] is False
    assert context["runAsUser"] == 0
    assert context["capabilities"]["drop"] == ["ALL"]
    assert set(context["capabilities"]["add"]) == CAPABILITIES
    assert len(context["capabilities"]["add"]) == len(CAPABILITIES)
    assert context["readOnlyRootFilesystem"] is True
    assert "initContainers" not in pod_spec(), "an init container would need rights of its own"


def test_the_agent_mounts_exactly_the_host_paths_it_needs() -> None:
    volumes = {v["name"]: v for v in pod_spec()["volumes"]}
    host = {v["hostPath"]["path"]: v for v in volumes.values() if "hostPath" in v}
    assert set(host) == set(HOST_PATHS)
    mounts = {m["name"]: m for m in agent()["volumeMounts"]}
    assert set(mounts) == set(volumes), "a volume is declared but not mounted, or the reverse"
    for path, (kind, mount_path, read_only) in HOST_PATHS.items():
        volume = host[path]
        assert volume["hostPath"]["type"] == kind, path
        mount = mounts[volume["name"]]
        assert mount["mountPath"] == mount_path, path
        assert mount.get("readOnly", False) is read_only, path
        assert "mountPropagation" not in mount, path
    # Anything else is scratch space of the pod's own.
    assert all("emptyDir" in v for v in volumes.values() if "hostPath" not in v)


def test_the_agent_takes_no_gpu_from_the_scheduler_and_no_token() -> None:
    """Asking for nvidia.com/gpu would take whole GPUs away from everyone else; NVML sees them
    through the NVIDIA runtime instead."""
    resources = agent().get("resources", {})
    for part in ("requests", "limits"):
        names = set(resources.get(part, {}))
        assert names <= {"cpu", "memory"}, f"{part}: {names}"
    env = env_of(agent())
    assert env["NVIDIA_VISIBLE_DEVICES"] == "all"
    assert env["NVIDIA_DRIVER_CAPABILITIES"] == "utility"
    account = only("ServiceAccount")
    assert pod_spec()["serviceAccountName"] == account["metadata"]["name"]
    assert pod_spec()["automountServiceAccountToken"] is False
    assert account["automountServiceAccountToken"] is False
    kinds = {doc["kind"] for docs in objects().values() for doc in docs}
    assert not kinds & RBAC_KINDS, "the agent never talks to the API server: no RBAC"


def test_the_agent_runs_on_gpu_nodes_and_names_its_node() -> None:
    spec = pod_spec()
    assert spec["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
    assert env_of(agent())["NODE_NAME"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    assert only("Namespace")["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "privileged"


@cache
def serve_options() -> set[str]:
    """The options `gpufrac-agent serve --help-all` lists (the aliases, `--name=<Type>`)."""
    done = subprocess.run([sys.executable, "-m", "node_agent", "serve", "--help-all"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return set(re.findall(r"^(--[a-z][a-z0-9-]*)(?:=|$)", done.stdout, re.MULTILINE))


def test_the_agents_command_uses_options_that_exist_and_the_mounted_paths() -> None:
    command = agent()["command"]
    assert command[:2] == ["gpufrac-agent", "serve"]
    used = [word.split("=", 1)[0] for word in command[2:] if word.startswith("--")]
    missing = [name for name in used if name not in serve_options()]
    assert not missing, f"gpufrac-agent serve has no {missing}"
    # The paths it names are where the host paths are mounted.
    socket = flag(command, "--socket")
    assert env_of(agent())["GPUFRAC_AGENT_SOCKET"] == socket
    assert str(PurePosixPath(socket).parent) == HOST_PATHS["/run/gpufrac"][1]
    assert flag(command, "--state-dir") == HOST_PATHS["/var/lib/gpufrac"][1]
    kubelet = PurePosixPath(flag(command, "--kubelet-socket"))
    assert kubelet == PurePosixPath(HOST_PATHS["/var/lib/kubelet/pod-resources"][1]) / "kubelet.sock"


def test_the_docs_name_each_right_the_daemonset_grants() -> None:
    text = DOCS.read_text()
    for name in sorted(CAPABILITIES) + sorted(HOST_PATHS) + ["hostPID", "automountServiceAccountToken"]:
        assert name in text, f"docs/kubernetes.md does not say why the agent has {name}"


def test_the_image_is_built_from_the_containerfile_the_docs_name() -> None:
    containerfile = DEPLOY / "image" / "Containerfile"
    text = containerfile.read_text()
    assert re.search(r"^FROM python:3\.11-slim$", text, re.MULTILINE)
    assert "'jupyter-gpufrac[kubernetes]'" in text, "the agent needs the kubernetes extra (grpcio)"
    assert str(containerfile.relative_to(ROOT)) in DOCS.read_text()
