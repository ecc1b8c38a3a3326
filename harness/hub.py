"""A real JupyterHub (with configurable-http-proxy) as a child process, driven through its REST API."""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from harness.agent import free_port, rest_call, wait_for
from harness.jupyter import Server

ROOT = Path(__file__).resolve().parents[1]
# Where `make` installs configurable-http-proxy from npm (the Hub starts it as its proxy).
VENV_PROXY = ROOT / ".venv" / "chp" / "node_modules" / ".bin" / "configurable-http-proxy"


def proxy_command() -> str | None:
    """configurable-http-proxy: the one `make` installed, else one on PATH (`npm install -g`)."""
    return str(VENV_PROXY) if VENV_PROXY.exists() else shutil.which("configurable-http-proxy")
SERVICE = "gpufrac-test"


@dataclass
class Hub:
    url: str  # the proxy's public URL: what browsers and notebooks talk to
    token: str  # a service's token with the admin scopes the tests need
    root: Path
    log: Path
    process: subprocess.Popen[bytes] = field(repr=False)

    def api(self, path: str, method: str = "GET", body: object = None,
            token: str | None = None) -> tuple[int, Any]:
        """The Hub's REST API (``/hub/api`` + ``path``), as the test service unless ``token``."""
        return rest_call(f"{self.url}/hub/api{path}", token or self.token, method, body)

    def new_token(self, user: str) -> str:
        """An API token of ``user``'s, made by the Hub for them (as an admin service may)."""
        status, body = self.api(f"/users/{user}/tokens", "POST", {"note": "gpufrac hub test"})
        assert status == 201, (status, body)
        return str(body["token"])

    def start_server(self, user: str, token: str, root: Path) -> Server:
        """Ask for ``user``'s single-user server as they would (with their own token): a
        :class:`Server` reached through the proxy with that token, once :meth:`wait_ready`
        says so. ``root`` is its notebook folder; its ``process`` and ``log`` are the Hub's,
        whose spawner's children write to the Hub's log."""
        status, body = self.api(f"/users/{user}/server", "POST", {}, token=token)
        assert status in (201, 202), (status, body)
        return Server(f"{self.url}/user/{user}", token, root, self.log, self.process)

    def wait_ready(self, user: str, server: Server, timeout: float = 90) -> None:
        """Wait until the Hub calls ``user``'s server ready and the proxy routes to it."""

        def ready() -> bool:
            if self.process.poll() is not None:
                raise AssertionError(f"the Hub exited: {self.log_text()[-3000:]}")
            model = self.api(f"/users/{user}")[1]
            if not (model.get("servers", {}).get("", {}).get("ready")):
                return False
            return server.api("/api/status")[0] == 200

        try:
            wait_for(ready, timeout, f"{user}'s single-user server", interval=0.25)
        except AssertionError as err:
            raise AssertionError(f"{err}\n--- hub log ---\n{self.log_text()[-6000:]}") from None

    def server_pid(self, user: str) -> int | None:
        """The pid LocalProcessSpawner keeps for ``user``'s server (None when none runs)."""
        state = self.api(f"/users/{user}")[1]
        server = state.get("servers", {}).get("", {})
        pid = (server.get("state") or {}).get("pid")
        return int(pid) if pid else None

    def proxy_pid(self) -> int | None:
        pid_file = self.root / "jupyterhub-proxy.pid"
        return int(pid_file.read_text()) if pid_file.exists() else None

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self, timeout: float = 60) -> None:
        """SIGTERM: the Hub stops every single-user server and its proxy, then exits."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def start_hub(root: Path, config: str, users: list[str], admins: list[str],
              deadline_s: float = 60) -> Hub:
    """``jupyterhub`` in ``root`` (its config, database, cookie secret, proxy pid file and log),
    listening on loopback only, with ``config`` appended to what it needs to be driven by a test
    service; ``users`` exist in the Hub from the start, ``admins`` are Hub admins."""
    root.mkdir(parents=True, exist_ok=True)
    root.chmod(0o700)  # the Hub's secrets and database: root's alone
    token, port = secrets.token_hex(32), free_port()
    (root / "jupyterhub_config.py").write_text(
        config
        + "\n# Added by harness/hub.py: loopback ports, this folder, and a service that drives the test.\n"
        + f"c.JupyterHub.bind_url = 'http://127.0.0.1:{port}'\n"
        + f"c.JupyterHub.hub_bind_url = 'http://127.0.0.1:{free_port()}'\n"
        + f"c.ConfigurableHTTPProxy.api_url = 'http://127.0.0.1:{free_port()}'\n"
        + f"c.ConfigurableHTTPProxy.command = [{proxy_command()!r}]\n"
        + f"c.ConfigurableHTTPProxy.pid_file = {str(root / 'jupyterhub-proxy.pid')!r}\n"
        + f"c.JupyterHub.db_url = 'sqlite:///{root / 'jupyterhub.sqlite'}'\n"
        + f"c.JupyterHub.cookie_secret_file = {str(root / 'jupyterhub_cookie_secret')!r}\n"
        + f"c.Authenticator.allowed_users = {set(users)!r}\n"
        + f"c.Authenticator.admin_users = {set(admins)!r}\n"
        + f"c.JupyterHub.services = [{{'name': {SERVICE!r}, 'api_token': {token!r}}}]\n"
        + "c.JupyterHub.load_roles = [{'name': 'gpufrac-test', 'services': ['gpufrac-test'],\n"
        + "    'scopes': ['admin:users', 'admin:servers', 'tokens', 'list:users', 'read:users']}]\n"
    )
    (root / "jupyterhub_config.py").chmod(0o600)  # it holds the service's token
    log = root / "jupyterhub.log"
    with open(log, "wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "jupyterhub", "-f", str(root / "jupyterhub_config.py")],
            cwd=root, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            # The venv's bin first: the Hub finds jupyterhub-singleuser where the test's Python is.
            env={**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}"},
        )
    hub = Hub(f"http://127.0.0.1:{port}", token, root, log, process)

    def ready() -> bool:
        if process.poll() is not None:
            raise AssertionError(f"jupyterhub exited: {hub.log_text()[-3000:]}")
        try:
            return hub.api("/")[0] == 200
        except OSError:
            return False

    try:
        wait_for(ready, deadline_s, "JupyterHub to answer through its proxy", interval=0.25)
    except BaseException:
        hub.stop()
        raise
    return hub


def still_running(pids: list[int], timeout: float = 30) -> list[int]:
    """Wait up to ``timeout`` s for ``pids`` to end; the ones still running then (zombies have ended)."""
    deadline = time.monotonic() + timeout
    alive = list(pids)
    while alive:
        alive = [pid for pid in alive if _alive(pid)]
        if not alive or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    return alive


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
