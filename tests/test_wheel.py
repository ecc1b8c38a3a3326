"""The wheel ships the prebuilt JupyterLab extension.

hatch-jupyter-builder can skip npm (HATCH_JUPYTER_BUILDER_SKIP_NPM, an sdist
without the sources, SKIP_JUPYTER_BUILDER) and a wheel that silently lacks the
labextension installs fine and shows nothing. So build a real wheel and look
inside. When the extension was built before (``pip install -e .`` in CI) and
nothing in labextension/ changed since, the build hook skips npm and this takes
a few seconds.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LABEXT_NAME = "jupyter-gpufrac"
SCHEMA_ID = "https://jupyter-gpufrac.github.io/events/kernel/v1"


def _build_wheel(out: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "-w", str(out)]
    # Without isolation pip need not fetch hatchling from PyPI; it is there
    # whenever the project was installed for development.
    if all(importlib.util.find_spec(m) for m in ("hatchling", "hatch_jupyter_builder")):
        cmd.append("--no-build-isolation")
    cmd.append(str(ROOT))
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"wheel build failed:\n{done.stdout}\n{done.stderr}"
    wheels = list(out.glob("jupyter_gpufrac-*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


@pytest.fixture(scope="module")
def wheel_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    wheel = _build_wheel(tmp_path_factory.mktemp("wheel"))
    with zipfile.ZipFile(wheel) as zf:
        return {name: zf.read(name) for name in zf.namelist()}


def _labext_files(files: dict[str, bytes]) -> dict[str, bytes]:
    marker = f"/data/share/jupyter/labextensions/{LABEXT_NAME}/"
    return {
        name.split(marker, 1)[1]: data for name, data in files.items() if ".data/" in name and marker in name
    }


def test_wheel_contains_prebuilt_labextension(wheel_files: dict[str, bytes]) -> None:
    labext = _labext_files(wheel_files)
    assert labext, "the wheel has no share/jupyter/labextensions/jupyter-gpufrac/"
    meta = json.loads(labext["package.json"])
    assert meta["name"] == LABEXT_NAME
    build = meta["jupyterlab"]["_build"]
    # The entry point JupyterLab loads must be in the wheel, with our code in it.
    assert build["load"] in labext, build["load"]
    assert build["extension"] == "./extension"
    assert "static/style.js" in labext
    assert "schemas/jupyter-gpufrac/plugin.json" in labext  # the settings schema
    bundles = b"".join(data for name, data in labext.items() if name.endswith(".js"))
    assert SCHEMA_ID.encode() in bundles, "the bundle lacks the extension's code"
    assert b"jp-gpufrac-StatusItem" in bundles, "the bundle lacks the stylesheet"
    install = json.loads(labext["install.json"])
    assert install["packageName"] == "jupyter-gpufrac"


def test_wheel_does_not_ship_sources_or_node_modules(wheel_files: dict[str, bytes]) -> None:
    assert not [n for n in wheel_files if "node_modules" in n or n.endswith(".ts")]


def test_labextension_output_dir_matches_shared_data() -> None:
    """package.json's outputDir is what pyproject ships; drift means an empty wheel."""
    pkg = json.loads((ROOT / "labextension" / "package.json").read_text())
    out = (ROOT / "labextension" / pkg["jupyterlab"]["outputDir"]).resolve()
    assert out == ROOT / "jupyter_gpufrac" / "labextension"
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    shared = project["tool"]["hatch"]["build"]["targets"]["wheel"]["shared-data"]
    assert shared["jupyter_gpufrac/labextension"] == f"share/jupyter/labextensions/{LABEXT_NAME}"
    assert pkg["name"] == LABEXT_NAME


def test_wheel_ships_the_systemd_unit_and_the_event_schema(wheel_files: dict[str, bytes]) -> None:
    unit = wheel_files["node_agent/systemd/gpufrac-agent.service"].decode()
    assert "ExecStart=@EXEC_START@" in unit  # install-service fills it in
    assert SCHEMA_ID.encode() in wheel_files["jupyter_gpufrac/events/kernel.yaml"]
