"""The KubeSpawner profiles of deploy/kubernetes/examples/jupyterhub-values.yaml render the
notebook pods docs/kubernetes.md describes.

KubeSpawner renders them itself: the Zero to JupyterHub chart's settings that the example uses
are set as the chart's jupyterhub_config.py sets them (its profileList is KubeSpawner's
profile_list as it is; its hub.extraConfig is run), then KubeSpawner applies a profile as it
does when a user picks it and builds the pod with its own code. No API server is contacted:
the client only needs a configuration, which a kubeconfig naming an unused address gives.
"""

from __future__ import annotations

import asyncio
import types
from pathlib import PurePosixPath
from typing import Any

import pytest
import yaml
from traitlets.config import Config

from deploy.manifests import DOCS, VALUES, Manifest, env_of, validate

kubespawner = pytest.importorskip("kubespawner", reason="jupyterhub-kubespawner is in the test extra")
from kubernetes_asyncio.client import ApiClient  # noqa: E402  (a dependency of kubespawner)
from kubernetes_asyncio.config import kube_config  # noqa: E402

PINNED, SPREAD = "gpu-fraction-pinned", "gpu-fraction-spread"
SOCKET_DIR = "/run/gpufrac"
PODINFO_ITEMS = {"annotations": "metadata.annotations", "name": "metadata.name",
                 "namespace": "metadata.namespace", "uid": "metadata.uid"}
ALL_GPUS = "/var/run/nvidia-container-devices/all"
DEVICE_LIST_LABEL = "jupyter-gpufrac/device-list"

# The chart's defaults that matter here (jupyterhub chart values.yaml): the user's uid and fsGroup,
# and the home volume of singleuser.storage.type "dynamic", which a profile must keep.
CHART_DEFAULTS: dict[str, Any] = {
    "uid": 1000,
    "fs_gid": 100,
    "volumes": {"volume-{user_server}": {"name": "volume-{user_server}",
                                         "persistentVolumeClaim": {"claimName": "{pvc_name}"}}},
    "volume_mounts": {"volume-{user_server}": {"name": "volume-{user_server}",
                                               "mountPath": "/home/jovyan"}},
}
# What the example may set, beyond the profiles: the chart keys this file sets as the chart does.
CHART_KEYS = {"hub": {"extraConfig"}, "singleuser": {"image", "extraTolerations", "profileList"}}

KUBECONFIG = """\
apiVersion: v1
kind: Config
clusters: [{name: unused, cluster: {server: "https://127.0.0.1:9"}}]
users: [{name: unused, user: {token: unused}}]
contexts: [{name: unused, context: {cluster: unused, user: unused}}]
current-context: unused
"""


def values() -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load(VALUES.read_text())
    return loaded


def hub_config(example: dict[str, Any]) -> Config:
    """The KubeSpawner configuration the jupyterhub chart makes of these values."""
    for section, keys in CHART_KEYS.items():
        assert set(example.get(section, {})) <= keys, (
            f"{section}: {set(example[section]) - keys} is not rendered by this test; add it here")
    assert set(example) <= set(CHART_KEYS)
    c = Config()
    for trait, value in CHART_DEFAULTS.items():
        setattr(c.KubeSpawner, trait, value)
    c.Spawner.cmd = ["jupyterhub-singleuser"]
    singleuser = example["singleuser"]
    image = singleuser["image"]
    c.KubeSpawner.image = f"{image['name']}:{image['tag']}"
    c.KubeSpawner.tolerations = singleuser.get("extraTolerations", [])
    c.KubeSpawner.profile_list = singleuser["profileList"]
    # hub.extraConfig: Python run at the end of the chart's jupyterhub_config.py, by key order.
    for name, code in sorted(example["hub"].get("extraConfig", {}).items()):
        exec(compile(code, f"hub.extraConfig.{name}", "exec"), {"c": c})
    return c


def render(profile: str, user_id: int = 7, name: str = "alice") -> Manifest:
    """The pod KubeSpawner would create for this user and profile, as the API receives it."""
    config = hub_config(values())

    async def make() -> Manifest:
        user = types.SimpleNamespace(name=name, id=user_id, url=f"/user/{name}/")
        hub = types.SimpleNamespace(public_host="", url="http://hub:8081/hub/", base_url="/hub/",
                                    api_url="http://hub:8081/hub/api")
        spawner = kubespawner.KubeSpawner(config=config, user=user, hub=hub, _mock=True)
        spawner.user_options = {"profile": profile}
        await spawner.load_user_options()
        pod = await spawner.get_pod_manifest()
        async with ApiClient() as api:
            serialised: Manifest = api.sanitize_for_serialization(pod)
        return serialised

    return asyncio.run(make())


@pytest.fixture(autouse=True)
def kubeconfig(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "kubeconfig"
    path.write_text(KUBECONFIG)
    # $KUBECONFIG, as the client read it when it was imported.
    monkeypatch.setattr(kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", str(path))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)


def notebook(pod: Manifest) -> Manifest:
    containers = pod["spec"]["containers"]
    # KAI gives the fraction to the pod's first container unless an annotation names another.
    assert containers[0]["name"] == "notebook"
    first: Manifest = containers[0]
    return first


def volumes_mounted(pod: Manifest) -> dict[str, tuple[Manifest, Manifest]]:
    """Each mount of the notebook container by mount path: (volume, mount)."""
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    return {m["mountPath"]: (volumes[m["name"]], m) for m in notebook(pod)["volumeMounts"]}


def test_the_example_lists_both_profiles() -> None:
    slugs = [p["slug"] for p in values()["singleuser"]["profileList"]]
    assert slugs == [PINNED, SPREAD]


@pytest.mark.parametrize("profile", [PINNED, SPREAD])
def test_a_profile_renders_a_pod_the_schema_accepts(profile: str) -> None:
    validate(render(profile), f"the pod of profile {profile}")


@pytest.mark.parametrize("profile", [PINNED, SPREAD])
def test_a_profile_asks_kai_for_a_fraction(profile: str) -> None:
    pod = render(profile)
    assert pod["spec"]["schedulerName"] == "kai-scheduler"
    assert pod["metadata"]["labels"]["kai.scheduler/queue"]
    annotations = pod["metadata"]["annotations"]
    assert {"gpu-fraction", "gpu-memory"} & set(annotations), annotations
    if "gpu-fraction" in annotations:
        assert 0 < float(annotations["gpu-fraction"]) <= 1
    # The share comes from KAI, not from the device plugin: a whole nvidia.com/gpu would be a
    # job's GPU, and KAI sets NVIDIA_VISIBLE_DEVICES itself (from its configmap).
    container = notebook(pod)
    for part in ("limits", "requests"):
        assert not any("nvidia.com" in name for name in container["resources"].get(part, {}))
    assert "NVIDIA_VISIBLE_DEVICES" not in env_of(container)
    assert pod["spec"]["runtimeClassName"] == "nvidia"
    assert pod["spec"]["nodeSelector"]["nvidia.com/gpu.present"] == "true"
    toleration = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
    assert toleration in pod["spec"]["tolerations"]


@pytest.mark.parametrize("profile", [PINNED, SPREAD])
def test_a_profile_gives_the_notebook_the_agents_socket_and_its_pod_info(profile: str) -> None:
    pod = render(profile)
    container = notebook(pod)
    env = env_of(container)
    mounted = volumes_mounted(pod)
    # The socket: the host's folder, which the agent makes, read-only (a socket still connects).
    assert PurePosixPath(env["GPUFRAC_AGENT_SOCKET"]).parent == PurePosixPath(SOCKET_DIR)
    volume, mount = mounted[SOCKET_DIR]
    assert volume["hostPath"] == {"path": SOCKET_DIR, "type": "Directory"}
    assert mount["readOnly"] is True
    # The pod's name, namespace, uid and annotations (KAI's among them), kept current.
    volume, mount = mounted[env["GPUFRAC_PODINFO"]]
    items = {item["path"]: item["fieldRef"]["fieldPath"] for item in volume["downwardAPI"]["items"]}
    assert items == PODINFO_ITEMS
    assert mount["readOnly"] is True
    assert env["GPUFRAC_CONTAINER"] == container["name"]
    assert env["JUPYTER_DEFAULT_PROVISIONER_NAME"] == "gpufrac-provisioner"
    assert "--GpuFrac.embedded_agent=False" in container["args"]
    # The profile adds to the chart's volumes: the user's home is still there.
    assert "/home/jovyan" in mounted


def test_the_pinned_profile_sees_only_kais_gpu() -> None:
    pod = render(PINNED)
    env = env_of(notebook(pod))
    assert "GPUFRAC_REACHABLE_GPUS" not in env
    assert ALL_GPUS not in volumes_mounted(pod)
    # Kept off nodes whose toolkit would ignore KAI's NVIDIA_VISIBLE_DEVICES (no GPU at all).
    (term,) = pod["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"]
    assert {"key": DEVICE_LIST_LABEL, "operator": "NotIn", "values": ["volume-mounts"]} in term[
        "matchExpressions"]


def test_the_spread_profile_sees_every_gpu_of_the_node() -> None:
    pod = render(SPREAD)
    env = env_of(notebook(pod))
    assert env["GPUFRAC_REACHABLE_GPUS"] == "all"
    volume, mount = volumes_mounted(pod)[ALL_GPUS]
    # The toolkit reads a mount of the host's /dev/null under this folder as a device request.
    assert volume["hostPath"] == {"path": "/dev/null", "type": "CharDevice"}
    assert mount["readOnly"] is True
    # Only on nodes whose toolkit takes device requests as volume mounts.
    (term,) = pod["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"]
    (expression,) = [e for e in term["matchExpressions"] if e["key"] == DEVICE_LIST_LABEL]
    assert expression["operator"] == "In"
    assert set(expression["values"]) == {"envvar-and-volume-mounts", "volume-mounts"}


def test_each_user_runs_as_a_uid_of_their_own_and_never_as_root() -> None:
    """The agent tells owners apart by uid, and treats uid 0 as an admin."""
    uids = set()
    for user_id, name in ((1, "alice"), (2, "bob")):
        context = notebook(render(PINNED, user_id, name))["securityContext"]
        assert context["allowPrivilegeEscalation"] is False
        assert not context.get("privileged")
        assert context["runAsUser"] != 0
        uids.add(context["runAsUser"])
    assert len(uids) == 2


def test_the_docs_describe_what_the_profiles_set() -> None:
    text = DOCS.read_text()
    pods = [render(PINNED), render(SPREAD)]
    names = {name for pod in pods for name in env_of(notebook(pod)) if name.startswith("GPUFRAC_")}
    for word in [*sorted(names), ALL_GPUS, DEVICE_LIST_LABEL, "kai.scheduler/queue", "gpu-fraction",
                 "RUNAI_GPU_MEMORY_LIMIT", *PODINFO_ITEMS.values()]:
        assert word in text, f"docs/kubernetes.md does not mention {word}"


@pytest.mark.parametrize("profile", [PINNED, SPREAD])
def test_a_stopped_or_evicted_notebook_pod_leaves_its_state_durable_on_the_users_volume(
        profile: str) -> None:
    """Evicted (KAI's consolidation or preemption, a node drain) or stopped by the Hub (its idle
    culler too): the preStop hook, then the server on SIGTERM, make every kernel's checkpoint
    durable within the pod's grace, on the user's own volume, which their next pod mounts on
    whatever node it lands: the notebook resumes there."""
    from traitlets.config.loader import KVArgParseConfigLoader

    from jupyter_gpufrac.cli import build_parser
    from jupyter_gpufrac.server.app import GpuFrac

    pods = {name: render(profile, user_id, name) for user_id, name in ((1, "alice"), (2, "bob"))}
    pod = pods["alice"]
    container = notebook(pod)
    gpufrac = KVArgParseConfigLoader(list(container["args"])).load_config().GpuFrac
    stop_grace = GpuFrac.class_traits()["stop_grace_period"].from_string(
        str(gpufrac.stop_grace_period))
    # The hook runs a command that exists, with options it takes.
    command = container["lifecycle"]["preStop"]["exec"]["command"]
    assert command[:3] == ["jupyter", "gpufrac", "flush"], command
    flush = build_parser().parse_args(command[2:])
    # Both fit the grace, with room for the kernels to stop (jupyter_client waits 5 s).
    grace = pod["spec"]["terminationGracePeriodSeconds"]
    assert flush.timeout < grace and stop_grace + 5 <= grace, (flush.timeout, stop_grace, grace)
    # The Hub's own stop of the server gives the same grace (KubeSpawner's default is 1 s).
    assert hub_config(values()).KubeSpawner.delete_grace_period >= grace
    # The checkpoints are on a volume of the user's own, writable, that follows them.
    folder = PurePosixPath(gpufrac.checkpoint_dir)
    claims = set()
    for name, rendered in pods.items():
        mounted = volumes_mounted(rendered)
        path = max((p for p in mounted if folder.is_relative_to(p)), key=len)
        volume, mount = mounted[path]
        assert not mount.get("readOnly"), mount
        claims.add(volume["persistentVolumeClaim"]["claimName"])
        assert name in volume["persistentVolumeClaim"]["claimName"]
    assert len(claims) == 2
    # Where a kernel ran is said by the node's name, from the downward API.
    assert env_of(container)["GPUFRAC_NODE_NAME"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
