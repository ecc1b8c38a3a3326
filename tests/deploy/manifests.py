"""What the tests of deploy/kubernetes share: the files, their YAML, and Kubernetes' schemas."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from harness.agent import ROOT

kubernetes_validate = pytest.importorskip("kubernetes_validate.utils",
                                          reason="kubernetes-validate is in the test extra")

DEPLOY = ROOT / "deploy" / "kubernetes"
DOCS = ROOT / "docs" / "kubernetes.md"
VALUES = DEPLOY / "examples" / "jupyterhub-values.yaml"

# The Kubernetes release whose schemas the manifests must meet: one fixed version, so that a
# newer kubernetes-validate cannot change the verdict (it keeps the older schemas).
KUBERNETES_VERSION = "1.33"

# YAML files in deploy/kubernetes that are no Kubernetes objects, and what they are instead.
NOT_OBJECTS = {
    "kustomization.yaml": "kustomize's own configuration",
    "examples/jupyterhub-values.yaml": "values for the jupyterhub Helm chart (Zero to JupyterHub)",
}

Manifest = dict[str, Any]


def yaml_files() -> list[Path]:
    return sorted(p for p in DEPLOY.rglob("*") if p.suffix in (".yaml", ".yml"))


def relative(path: Path) -> str:
    return path.relative_to(DEPLOY).as_posix()


def documents(path: Path) -> list[Manifest]:
    """The YAML documents of one file, empty ones left out (as kubectl does)."""
    with path.open() as f:
        return [doc for doc in yaml.safe_load_all(f) if doc is not None]


def objects() -> dict[str, list[Manifest]]:
    """Every Kubernetes object in deploy/kubernetes, by file."""
    return {relative(p): documents(p) for p in yaml_files() if relative(p) not in NOT_OBJECTS}


def only(kind: str) -> Manifest:
    found = [doc for docs in objects().values() for doc in docs if doc["kind"] == kind]
    assert len(found) == 1, f"expected one {kind} in {DEPLOY}, found {len(found)}"
    return found[0]


def validate(obj: Manifest, where: str) -> None:
    """Check one object against Kubernetes' schema, strictly: a field the API does not know
    fails as a misspelt one would (kubectl would drop or refuse it)."""
    if KUBERNETES_VERSION not in {v.rsplit(".", 1)[0] for v in kubernetes_validate.all_versions()}:
        pytest.fail(f"kubernetes-validate {kubernetes_validate.__version__} has no schemas for "
                    f"Kubernetes {KUBERNETES_VERSION}; install a newer one")
    try:
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
    except kubernetes_validate.ValidationError as err:
        path = ".".join(str(part) for part in err.path) or "(top)"
        raise AssertionError(f"{where}: {obj.get('kind')} {obj.get('metadata', {}).get('name')}: "
                             f"{path}: {err.message}") from None
    except kubernetes_validate.SchemaNotFoundError as err:
        raise AssertionError(f"{where}: {err.message}") from None


def env_of(container: Manifest) -> dict[str, Any]:
    """A container's environment: name -> value, or -> valueFrom for a value from elsewhere."""
    return {item["name"]: item.get("value", item.get("valueFrom")) for item in container.get("env", [])}
