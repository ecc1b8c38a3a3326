"""One shared GPU node behind a real JupyterHub: the system agent (root), real Unix users the run
creates, their single-user servers spawned by the Hub, each reached through the Hub's proxy."""

from __future__ import annotations

import contextlib
import grp
import importlib.util
import json
import os
import pwd
import shutil
import stat
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import pytest
from unix_users import User

from harness.agent import ROOT, AgentProcess
from harness.hub import VENV_PROXY, Hub, proxy_command, start_hub, still_running
from harness.jupyter import Notebook, Server

DOCS_CONFIG = ROOT / "docs" / "jupyterhub" / "jupyterhub_config.py"
ADMINS = "gpufrac-hub-admins"
# Two notebook users, a third who runs a whole-GPU job, and a Hub admin in the admin group.
NAMES = {role: f"gpufrac-hub-{role}" for role in ("alice", "bob", "carol", "dave")}
# Leases of kernels that died without their server's word are released this long after (the
# default is 60 s); well above the moment a moved kernel's lease has no process.
ORPHAN_GRACE = 15


@dataclass
class HubNode:
    tmp: Path
    agent: AgentProcess
    hub: Hub
    users: dict[str, User]  # by role: alice, bob, carol, dave
    homes: dict[str, Path]
    tokens: dict[str, str] = field(default_factory=dict)
    servers: dict[str, Server] = field(default_factory=dict)
    notebooks: dict[str, Notebook] = field(default_factory=dict)
    # The agent's leases right after the Hub stopped (None until it did).
    leases_left_at_stop: list[str] | None = None

    def run_as(self, role: str, args: list[str], timeout: float = 180) -> subprocess.CompletedProcess[str]:
        """A command as that user, with the groups and the environment a login would give."""
        return subprocess.run(args, **login_args(self.users[role], self.homes[role]),
                              capture_output=True, text=True, timeout=timeout)

    def agent_cli(self, role: str, *args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
        """``python -m node_agent --socket S ARGS`` as that user."""
        return self.run_as(role, [sys.executable, "-m", "node_agent", "--socket", self.agent.socket,
                                  *args], timeout)

    def status_as(self, role: str) -> dict[str, Any]:
        """``gpufrac-agent status --json`` as that user: what the agent shows them."""
        done = self.agent_cli(role, "status", "--json", timeout=60)
        assert done.returncode == 0, done.stderr
        return dict(json.loads(done.stdout))

    def user_pids(self) -> list[int]:
        """Every process that runs as one of the test users."""
        uids = {u.uid for u in self.users.values()}
        pids = []
        for proc in psutil.process_iter(["uids", "status"]):
            with contextlib.suppress(psutil.Error):
                if proc.info["uids"].real in uids and proc.info["status"] != psutil.STATUS_ZOMBIE:
                    pids.append(proc.pid)
        return pids

    def shutdown(self) -> list[str]:
        """Close the pages, stop the Hub (it stops every user's server and its proxy), and say
        which process did not stop with it or runs as a test user still."""
        for notebook in self.notebooks.values():
            with contextlib.suppress(Exception):
                notebook.close()
        self.notebooks.clear()
        proxy = self.hub.proxy_pid()
        started = [self.hub.process.pid, *([proxy] if proxy else []), *self.user_pids()]
        self.hub.stop()
        problems = [f"pid {pid} ({_cmdline(pid)}) outlived the Hub" for pid in still_running(started)]
        problems += [f"pid {pid} ({_cmdline(pid)}) runs as a test user" for pid in self.user_pids()
                     if pid not in started]
        if problems:
            problems.append(f"--- hub log (servers' output too) ---\n{self.hub.log_text()[-8000:]}")
        return problems


def _cmdline(pid: int) -> str:
    try:
        return " ".join(psutil.Process(pid).cmdline())[:200]
    except psutil.Error:
        return "gone"


def login_args(who: User, home: Path) -> dict[str, Any]:
    """``subprocess`` arguments that run a command as ``who``, as a login would: uid, gid and
    supplementary groups (SO_PEERGROUPS hands these to the agent), HOME and a clean environment."""
    return {"user": who.uid, "group": who.gid, "extra_groups": list(who.groups), "cwd": home,
            "env": {"HOME": str(home), "USER": who.name, "LOGNAME": who.name,
                    "PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8"}}


def _require_environment() -> None:
    """Skip, saying exactly why, where this test cannot run as written."""
    if os.geteuid() != 0 or not shutil.which("useradd"):
        pytest.skip("tests/hub creates Unix users and runs JupyterHub as root: run it as root (CI does)")
    if importlib.util.find_spec("jupyterhub") is None:
        pytest.skip("JupyterHub is not installed: `make .venv/bin/gpufrac-agent` installs the test extra")
    if proxy_command() is None:
        pytest.skip(f"configurable-http-proxy is neither at {VENV_PROXY} nor on PATH: "
                    "`make .venv/chp/node_modules/.bin/configurable-http-proxy` installs it from npm")
    # The Hub starts every user's server from this environment as that user. A Python kept where
    # other users cannot reach it (pyenv under a 0700 /root) fails with "Permission denied" —
    # a fact of the machine, not of the product: say what grants the least that fixes it.
    nobody = pwd.getpwnam("nobody")
    try:
        probe = subprocess.run(
            [sys.executable, "-c", "import jupyterhub.singleuser, jupyter_gpufrac.server.app"],
            user=nobody.pw_uid, group=nobody.pw_gid, extra_groups=[], cwd="/",
            env={"PATH": "/usr/bin:/bin", "HOME": "/nonexistent"}, capture_output=True, text=True,
        )
        failure = (probe.stderr.strip().splitlines() or ["?"])[-1] if probe.returncode else ""
    except OSError as err:  # exec itself refused
        failure = str(err)
    if failure:
        folders = " ".join(sorted({folder for path in (
            os.path.realpath(sys.executable), sysconfig.get_paths()["stdlib"], ROOT)
            for folder in _unsearchable(Path(path))})) or "(none found)"
        pytest.skip(
            f"other users cannot start this Python ({sys.executable}): {failure}. The Hub runs every user's "
            f"server as that user from it. Grant search (x) only, never read or write, on the "
            f"folders in the way, as .ci/run does: chmod o+x {folders}"
        )


def _unsearchable(path: Path) -> list[str]:
    """The folders on the way to ``path`` that other users may not enter."""
    return [str(folder) for folder in [*reversed(path.parents), path]
            if folder.is_dir() and not folder.stat().st_mode & stat.S_IXOTH]


def _make_group(name: str) -> int:
    with contextlib.suppress(KeyError):
        return grp.getgrnam(name).gr_gid
    subprocess.run(["groupadd", "--system", name], check=True)
    return grp.getgrnam(name).gr_gid


def _make_user(name: str, home: Path, groups: list[str]) -> User:
    """User ``name`` with a home of their own (0700) in this run's folder and exactly ``groups``
    besides their own: created, or brought to that state when an earlier run left it."""
    try:
        pwd.getpwnam(name)
    except KeyError:
        subprocess.run(["useradd", "--no-create-home", "--home-dir", str(home), "--shell",
                        "/usr/sbin/nologin", "--user-group", name], check=True)
    subprocess.run(["usermod", "--home", str(home), "--groups", ",".join(groups), name], check=True)
    entry = pwd.getpwnam(name)
    home.mkdir(mode=0o700)
    os.chown(home, entry.pw_uid, entry.pw_gid)
    return User(name, entry.pw_uid, entry.pw_gid, tuple(grp.getgrnam(g).gr_gid for g in groups))


def _remove_users() -> None:
    for name in NAMES.values():
        with contextlib.suppress(KeyError):
            pwd.getpwnam(name)
            subprocess.run(["userdel", name], check=False, capture_output=True)
    with contextlib.suppress(KeyError):
        grp.getgrnam(ADMINS)
        subprocess.run(["groupdel", ADMINS], check=False, capture_output=True)


def hub_config(agent_socket: str) -> str:
    """The documented LocalProcessSpawner configuration, with only the test's facts put over it."""
    return (
        f"load_subconfig({str(DOCS_CONFIG)!r})\n"
        # The test's agent instead of /run/gpufrac/agent.sock; its admin group instead of gpu-admins.
        f"c.Spawner.environment['GPUFRAC_AGENT_SOCKET'] = {agent_socket!r}\n"
        f"c.PAMAuthenticator.admin_groups = {{{ADMINS!r}}}\n"
        # Only what the test needs in each server: other extensions add seconds to each start.
        "c.Spawner.args += [f'--ServerApp.jpserver_extensions={name}=False' for name in\n"
        "    ('jupyterlab', 'jupyter_lsp', 'jupyter_server_terminals', 'notebook_shim')]\n"
    )


@pytest.fixture(scope="module")
def hub_node() -> Iterator[HubNode]:
    _require_environment()
    # Not pytest's tmp_path (0700 under root's): the users must reach their homes and the socket.
    tmp = Path(tempfile.mkdtemp(prefix="gpufrac-hub-"))
    tmp.chmod(0o755)
    (tmp / "home").mkdir(mode=0o755)
    agent: AgentProcess | None = None
    node: HubNode | None = None
    try:
        _remove_users()  # whatever an interrupted run left
        _make_group(ADMINS)
        homes = {role: tmp / "home" / name for role, name in NAMES.items()}
        users = {role: _make_user(name, homes[role], [ADMINS] if role == "dave" else [])
                 for role, name in NAMES.items()}
        # The system agent: root, its socket in a root-owned folder every user may enter.
        (tmp / "agent").mkdir(mode=0o755)
        agent = AgentProcess(tmp / "agent", "2x4GiB", [
            "--admin-group", ADMINS, "--poll-interval", "0.2", "--migrate-grace", "90",
            "--orphan-grace", str(ORPHAN_GRACE)]).start()
        hub = start_hub(tmp / "hub", hub_config(agent.socket), list(NAMES.values()), [NAMES["dave"]])
        node = HubNode(tmp, agent, hub, users, homes)
        yield node
        problems = node.shutdown()
        assert not problems, "\n".join(problems)
    finally:
        if node is not None:
            node.hub.stop()
            # Whatever still runs as a test user was started by this run: end it, by pid.
            for pid in node.user_pids():
                with contextlib.suppress(psutil.Error):
                    psutil.Process(pid).kill()
        if agent is not None:
            agent.stop()
        _remove_users()
        shutil.rmtree(tmp, ignore_errors=True)
