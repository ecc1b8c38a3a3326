"""A notebook pod's downward API files: KAI's share for the container, the GPUs the cluster gave it."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from jupyter_gpufrac import contract
from jupyter_gpufrac.server.launch import resolve_share
from jupyter_gpufrac.server.podinfo import (
    PodInfo,
    cluster_gpus,
    parse_annotations,
    reachable_gpus,
    read_podinfo,
)
from node_agent.quantities import MiB, QuantityError, parse_quantity


def go_quote(value: str) -> str:
    """What Go's strconv.Quote writes for ``value`` (the kubelet writes annotations so)."""
    out = []
    for char in value:
        if char in '"\\':
            out.append("\\" + char)
        elif char == "\n":
            out.append("\\n")
        elif char == "\t":
            out.append("\\t")
        elif not char.isprintable():
            out.append(f"\\u{ord(char):04x}" if ord(char) < 0x10000 else f"\\U{ord(char):08x}")
        else:
            out.append(char)
    return '"' + "".join(out) + '"'


@given(st.dictionaries(st.from_regex(r"[a-z][a-z0-9./-]{0,40}", fullmatch=True)
                       .filter(lambda k: "=" not in k),
                       st.text(max_size=40)))
def test_annotations_read_back_what_the_kubelet_wrote(notes: dict[str, str]) -> None:
    text = "".join(f"{key}={go_quote(value)}\n" for key, value in sorted(notes.items()))
    assert parse_annotations(text) == notes


def test_a_broken_annotations_file_names_the_line() -> None:
    with pytest.raises(QuantityError, match="line 2"):
        parse_annotations('a="1"\nno quotes here\n')
    with pytest.raises(QuantityError, match="bad escape"):
        parse_annotations('a="\\q"\n')
    for impossible in ("\\UFFFFFFFF", "\\ud800"):
        with pytest.raises(QuantityError, match="no character"):
            parse_annotations(f'a="{impossible}"\n')


def pod(notes: dict[str, str], container: str = "notebook") -> PodInfo:
    return PodInfo(notes, "team-a", "jupyter-ada", container)


def test_kai_share_for_the_container() -> None:
    share = pod({"gpu-fraction": "0.5", "gpu-fraction-num-devices": "2"}).share()
    assert share is not None and share.request.fraction == 0.5 and share.devices == 2
    assert share.source == "pod annotation gpu-fraction" and share.limit is None
    memory = pod({"gpu-memory": "8000"}).share()
    assert memory is not None and memory.request.nbytes == 8000 * MiB
    # The per-container form wins over the pod's, and may carry a limit.
    per = pod({"gpu-fraction": "0.5", "nvidia.com/container.notebook.gpu-memory.request": "4Gi",
               "nvidia.com/container.notebook.gpu-memory.limit": "12000"}).share()
    assert per is not None and per.request.nbytes == 4 << 30 and per.limit is not None
    assert per.limit.nbytes == 12000 * MiB and "container.notebook" in per.source
    # Another container's fraction, or no annotation: no share from the pod.
    assert pod({"gpu-fraction": "0.5", "gpu-fraction-container-name": "sidecar"}).share() is None
    assert pod({"nvidia.com/container.sidecar.gpu-memory.request": "4Gi"}).share() is None
    assert pod({}).share() is None


@pytest.mark.parametrize(("notes", "field"), [
    ({"gpu-fraction": "1.5"}, "gpu-fraction"),
    ({"gpu-fraction": "4Gi"}, "gpu-fraction"),
    ({"gpu-memory": "0.5"}, "gpu-memory"),
    ({"gpu-fraction": "0.5", "gpu-memory": "100"}, "gpu-fraction"),
    ({"gpu-fraction": "0.5", "gpu-fraction-num-devices": "two"}, "gpu-fraction-num-devices"),
    ({"nvidia.com/container.notebook.gpu-memory.limit": "4Gi"}, "gpu-memory.limit"),
    ({"nvidia.com/container.notebook.gpu-memory.request": "0.5"}, "gpu-memory.request"),
])
def test_a_bad_annotation_is_named(notes: dict[str, str], field: str) -> None:
    with pytest.raises(QuantityError) as refused:
        pod(notes).share()
    assert field in refused.value.field


def test_the_pods_share_ranks_below_the_kernelspec_and_above_what_the_user_asked() -> None:
    share = pod({"gpu-fraction": "0.5"}).share()
    from_pod = resolve_share(None, None, {}, "0.25", "1", share)
    assert from_pod.request.fraction == 0.5 and from_pod.request_source == share.source  # type: ignore[union-attr]
    # Its limit: the platform's RUNAI_GPU_MEMORY_LIMIT, else the default.
    assert from_pod.limit == parse_quantity("1", "x") and from_pod.limit_source == contract.SOURCE_CONFIG
    runai = resolve_share(None, None, {"RUNAI_GPU_MEMORY_LIMIT": "0.8"}, "0.25", "1", share)
    assert runai.limit == parse_quantity("0.8", "x")
    # The cluster's plan counts the pod's share on its GPU: a remembered %gpu request from
    # elsewhere does not take more; a kernelspec, the admin's, does.
    asked = resolve_share(None, {"request": "2Gi"}, {}, "0.25", "1", share)
    assert asked.request_source == share.source  # type: ignore[union-attr]
    spec = resolve_share({"gpufrac": {"request": "0.75"}}, None, {}, "0.25", "1", share)
    assert spec.request_source == contract.SOURCE_KERNELSPEC


def test_the_cluster_s_gpus_and_what_the_container_reaches(tmp_path: Path) -> None:
    a, b = "GPU-5eed0000-0000-0000-0000-000000000000", "GPU-5eed0001-0000-0000-0000-000000000000"
    assert cluster_gpus({"NVIDIA_VISIBLE_DEVICES": f"{a},{b}"}) == (a, b)
    # Where the device plugin hands devices out by CDI name.
    cdi = f"k8s.device-plugin.nvidia.com/gpu={a},k8s.device-plugin.nvidia.com/gpu={b}"
    assert cluster_gpus({"NVIDIA_VISIBLE_DEVICES": cdi}) == (a, b)
    assert cluster_gpus({"NVIDIA_VISIBLE_DEVICES": f"{a},{a}"}) == (a,)
    # KAI's per-container annotation of the devices it granted comes first.
    granted = pod({"nvidia.com/container.notebook.gpus.devices": b})
    assert cluster_gpus({"NVIDIA_VISIBLE_DEVICES": a}, granted) == (b,)
    assert cluster_gpus({"NVIDIA_VISIBLE_DEVICES": a}, pod({})) == (a,)
    for value in ("all", "none", "void", "0,1", ""):
        assert cluster_gpus({"NVIDIA_VISIBLE_DEVICES": value}) is None
    assert reachable_gpus({}, (a,)) == (a,)
    assert reachable_gpus({contract.REACHABLE_GPUS: "all"}, (a,)) is None
    assert reachable_gpus({contract.REACHABLE_GPUS: f"{a}, {b}"}, (a,)) == (a, b)

    assert read_podinfo({}) is None
    (tmp_path / "annotations").write_text('gpu-fraction="0.25"\n')
    (tmp_path / "namespace").write_text("team-a")
    info = read_podinfo({contract.PODINFO: str(tmp_path)})
    assert info == PodInfo({"gpu-fraction": "0.25"}, "team-a", "", "notebook")
