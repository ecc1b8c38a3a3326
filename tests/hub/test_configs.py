"""The example Hub configurations in docs/jupyterhub/ name only settings that exist, with values
their classes accept: a renamed trait would otherwise be a warning in a log nobody reads.
(test_hub.py runs the LocalProcessSpawner one for real; SystemdSpawner needs systemd.)"""

from __future__ import annotations

from typing import Any

import pytest
from traitlets import HasTraits, TraitError
from traitlets.config import Config
from traitlets.config.loader import KVArgParseConfigLoader, PyFileConfigLoader

from harness.agent import ROOT

jupyterhub_app = pytest.importorskip("jupyterhub.app", reason="JupyterHub is in the test extra")
systemdspawner = pytest.importorskip("systemdspawner",
                                     reason="jupyterhub-systemdspawner is in the test extra")

from jupyterhub.auth import PAMAuthenticator  # noqa: E402
from jupyterhub.spawner import LocalProcessSpawner  # noqa: E402

from jupyter_gpufrac.server.app import GpuFrac  # noqa: E402

FOLDER = ROOT / "docs" / "jupyterhub"
CLASSES: dict[str, type[HasTraits]] = {
    "JupyterHub": jupyterhub_app.JupyterHub,
    "PAMAuthenticator": PAMAuthenticator,
    "Spawner": LocalProcessSpawner,
    "LocalProcessSpawner": LocalProcessSpawner,
    "SystemdSpawner": systemdspawner.SystemdSpawner,
    "GpuFrac": GpuFrac,
}


def load(name: str) -> Config:
    return PyFileConfigLoader(name, path=str(FOLDER)).load_config()


def check(section: str, settings: dict[str, Any]) -> None:
    traits = CLASSES[section].class_traits(config=True)
    for key, value in settings.items():
        assert key in traits, f"c.{section}.{key} is no setting of {CLASSES[section].__name__}"
        trait: Any = traits[key]
        try:
            trait.validate(HasTraits(), value)  # any owner: these traits look at none
        except TraitError as err:  # a value of the wrong type or out of range
            raise AssertionError(f"c.{section}.{key} = {value!r}: {err}") from None


@pytest.mark.parametrize("name", ["jupyterhub_config.py", "jupyterhub_config_systemd.py"])
def test_example_configs_name_real_settings(name: str) -> None:
    config = load(name)
    for section, settings in config.items():
        check(section, dict(settings))
    # The single-user servers' own settings, given as command-line arguments.
    args = KVArgParseConfigLoader(list(config.Spawner.args)).load_config()
    assert set(args) == {"GpuFrac"}, args
    check("GpuFrac", {key: GpuFrac.class_traits()[key].from_string(str(value))
                      for key, value in args.GpuFrac.items()})
    assert config.Spawner.environment["JUPYTER_DEFAULT_PROVISIONER_NAME"] == "gpufrac-provisioner"


def test_the_systemd_example_changes_only_the_spawner() -> None:
    local, systemd = load("jupyterhub_config.py"), load("jupyterhub_config_systemd.py")
    assert systemd.JupyterHub.spawner_class == "systemd" != local.JupyterHub.spawner_class
    assert {key: value for key, value in systemd.items() if key != "SystemdSpawner"} == {
        **local, "JupyterHub": {**local.JupyterHub, "spawner_class": "systemd"}}
    # Where the GPUs are seen and owners are known by uid and groups, as the agent needs.
    assert systemd.SystemdSpawner.isolate_devices is False and systemd.SystemdSpawner.dynamic_users is False
