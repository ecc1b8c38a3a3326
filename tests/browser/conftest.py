"""One JupyterLab for the browser test, isolated from the user's Jupyter.

The server runs from this interpreter with its own HOME, config, data and
runtime dirs, the gpufrac provisioner as default, and GPUFRAC_AGENT_SOCKET on a
fresh path: nothing answers there, so the server embeds a simulated 2-GPU
agent. The labextension is linked from the repo's build output
(jupyter_gpufrac/labextension) into the isolated data dir, which comes first on
JupyterLab's search path (JUPYTER_PREFER_ENV_PATH=0: in a virtualenv the env's
dirs would otherwise come first), so the test sees the current build whether or
not (and how) the package is installed.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from harness.agent import free_port, rest_call, wait_for

ROOT = Path(__file__).resolve().parents[2]
BUILT_LABEXTENSION = ROOT / "jupyter_gpufrac" / "labextension"
CHROMIUM = os.environ.get("GPUFRAC_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--no-first-run",
]


def _missing(reason: str) -> None:
    """Skip on a developer's machine; in CI a missing piece is a failure."""
    if os.environ.get("CI"):
        pytest.fail(reason)
    pytest.skip(reason)


@dataclass
class Lab:
    url: str
    token: str
    root: Path
    notebooks: Path
    env: dict[str, str]
    log: Path
    process: subprocess.Popen[bytes] = field(repr=False)

    def api(self, path: str, method: str = "GET", body: object = None) -> tuple[int, object]:
        """Call the server's REST API; returns (status, parsed JSON or None)."""
        return rest_call(f"{self.url}{path}", self.token, method, body, timeout=30)

    def wait_for(self, what: str, check: Callable[[], object], timeout: float) -> object:
        """``harness.agent.wait_for``, with the tail of the Lab's log in the failure message."""
        try:
            return wait_for(check, timeout, what, interval=0.5)
        except AssertionError as err:
            pytest.fail(f"{err}\n--- lab log ---\n{self.log_tail()}")

    def log_tail(self, lines: int = 80) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def _end_leftovers(marker: str) -> None:
    """End processes this fixture started indirectly: their command line names
    its temp dir (the embedded agent's --socket and --state-dir do)."""
    import psutil

    me = os.getpid()
    for proc in psutil.process_iter(["pid", "cmdline"]):
        if proc.info["pid"] == me or not any(marker in a for a in proc.info["cmdline"] or ()):
            continue
        with contextlib.suppress(psutil.Error):
            proc.terminate()
            try:
                proc.wait(timeout=5)
            except psutil.TimeoutExpired:
                proc.kill()


def _write_json(path: Path, data: object) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2))


@pytest.fixture(scope="session")
def chromium() -> dict[str, object]:
    """Keyword arguments for Playwright's chromium.launch(): Debian's Chromium,
    never a downloaded browser."""
    if not Path(CHROMIUM).exists():
        _missing(f"{CHROMIUM} not found (apt-get install -y chromium)")
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        _missing("the playwright Python package is not installed (pip install playwright)")
    return {"executable_path": CHROMIUM, "headless": True, "args": list(CHROMIUM_ARGS)}


@pytest.fixture
def screenshots(tmp_path: Path) -> Path:
    """Where a test's screenshots go: docs/screenshots with
    GPUFRAC_UPDATE_SCREENSHOTS=1, else a temp dir."""
    if os.environ.get("GPUFRAC_UPDATE_SCREENSHOTS"):
        out = ROOT / "docs" / "screenshots"
    else:
        out = tmp_path / "screenshots"
    out.mkdir(parents=True, exist_ok=True)
    return out


@contextlib.contextmanager
def launch_lab(root: Path, config: str = "", agent_socket: str | None = None) -> Iterator[Lab]:
    """``jupyter lab`` in ``root`` (its HOME, config, data, runtime and notebook folders, made
    when missing and kept: a Lab started again in the same ``root`` finds what the last one
    left), ``config`` added to its jupyter_server_config.py, until the block ends."""
    if not (BUILT_LABEXTENSION / "package.json").exists():
        pytest.fail(
            "the labextension is not built: run `pip install -e .` or "
            "`cd labextension && npm install && npm run build`"
        )
    home, config_dir, data, runtime, notebooks = (
        root / d for d in ("home", "config", "data", "runtime", "notebooks")
    )
    for d in (home, config_dir, data, runtime, notebooks):
        d.mkdir(parents=True, exist_ok=True)
    (data / "labextensions").mkdir(exist_ok=True)
    if not (data / "labextensions" / "jupyter-gpufrac").is_symlink():
        os.symlink(BUILT_LABEXTENSION, data / "labextensions" / "jupyter-gpufrac")

    (config_dir / "jupyter_server_config.py").write_text(
        "c.ServerApp.jpserver_extensions = {'jupyter_gpufrac': True}\n"
        "c.KernelProvisionerFactory.default_provisioner_name = 'gpufrac-provisioner'\n"
        # The test drives the app (theme switch) through window.jupyterapp.
        "c.LabApp.expose_app_in_browser = True\n"
        "c.ServerApp.open_browser = False\n"
        # CI containers run as root; JupyterLab refuses that unless told.
        "c.ServerApp.allow_root = True\n"
        # No PyPI queries from the extension manager.
        "c.LabApp.extension_manager = 'readonly'\n"
        + config
    )
    settings = config_dir / "lab" / "user-settings" / "@jupyterlab"
    # No "fetch news?" toast on a fresh profile, and no calls out of the box.
    _write_json(
        settings / "apputils-extension" / "notification.jupyterlab-settings",
        {"fetchNews": "false", "checkForUpdates": False},
    )
    _write_json(
        settings / "apputils-extension" / "themes.jupyterlab-settings",
        {"theme": "JupyterLab Light"},
    )

    port = free_port()
    token = "gpufrac-browser-test"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JUPYTER_", "GPUFRAC_", "IPYTHON"))}
    env.update(
        HOME=str(home),
        JUPYTER_CONFIG_DIR=str(config_dir),
        JUPYTER_DATA_DIR=str(data),
        JUPYTER_RUNTIME_DIR=str(runtime),
        IPYTHONDIR=str(home / ".ipython"),
        # Inside a virtualenv jupyter_core puts sys.prefix's dirs before the user's,
        # so an installed (possibly stale) copy of the extension in
        # $PREFIX/share/jupyter/labextensions would win over the build linked above.
        JUPYTER_PREFER_ENV_PATH="0",
        # Fresh, so the server embeds its simulated agent; a developer may point
        # the test at an agent of their own instead.
        GPUFRAC_AGENT_SOCKET=agent_socket or os.environ.get("GPUFRAC_TEST_AGENT_SOCKET")
        or str(root / "agent.sock"),
        PYTHONUNBUFFERED="1",
    )
    # The kernel and the agent CLI run from this interpreter's environment.
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    log = root / "lab.log"
    with open(log, "ab") as out:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "jupyterlab",
                "--no-browser",
                "--ServerApp.ip=127.0.0.1",
                f"--ServerApp.port={port}",
                "--ServerApp.port_retries=0",
                f"--IdentityProvider.token={token}",
                f"--ServerApp.root_dir={notebooks}",
                # The simulated node even where a GPU is: the test moves between two GPUs.
                "--GpuFrac.embedded_agent_nvml=False",
            ],
            cwd=notebooks,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            # Its own process group: teardown can end the kernels it started too.
            start_new_session=True,
        )
    server = Lab(
        url=f"http://127.0.0.1:{port}",
        token=token,
        root=root,
        notebooks=notebooks,
        env=env,
        log=log,
        process=process,
    )
    try:
        deadline = time.monotonic() + 90
        while True:
            if process.poll() is not None:
                pytest.fail(f"jupyter lab exited with {process.returncode}:\n{server.log_tail()}")
            try:
                if server.api("/api/status")[0] == 200:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"jupyter lab did not answer in 90 s:\n{server.log_tail()}")
            time.sleep(0.5)
        # The embedded agent starts with the server extension; wait for it.
        while True:
            status, node = server.api("/api/gpufrac/node")
            if status == 200 and isinstance(node, dict) and node.get("gpus"):
                break
            if time.monotonic() > deadline:
                pytest.fail(
                    f"GET /api/gpufrac/node gave no GPUs in time: {status} {node}\n{server.log_tail()}"
                )
            time.sleep(0.5)
        yield server
    finally:
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        # Kernels left behind by an unclean exit share the server's group; the
        # embedded agent has its own session but names our temp dir.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL)
        _end_leftovers(str(root))


@pytest.fixture(scope="session")
def lab(tmp_path_factory: pytest.TempPathFactory, chromium: dict[str, object]) -> Iterator[Lab]:
    with launch_lab(tmp_path_factory.mktemp("lab")) as server:
        yield server
