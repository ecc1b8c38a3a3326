"""Real Unix users for attack tests: made by the test run when it is root (CI is), else skipped."""

from __future__ import annotations

import grp
import json
import os
import pwd
import select
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest

VICTIM = "gpufrac-victim"
ATTACKER = "gpufrac-attacker"
ADMINS = "gpufrac-admins"


@dataclass(frozen=True)
class User:
    name: str
    uid: int
    gid: int
    groups: tuple[int, ...] = ()

    def popen_args(self) -> dict[str, Any]:
        """Keyword arguments that make ``subprocess`` run a command as this user."""
        return {"user": self.uid, "group": self.gid, "extra_groups": list(self.groups),
                "env": {**os.environ, "HOME": "/tmp", "USER": self.name}}


def _require_root() -> None:
    if os.geteuid() != 0 or not shutil.which("useradd"):
        pytest.skip("attack tests create Unix users: run them as root (CI does)")


def group(name: str) -> int:
    """The gid of group ``name``, created if missing."""
    _require_root()
    try:
        return grp.getgrnam(name).gr_gid
    except KeyError:
        # Another test worker may make it at the same moment: its group is as good.
        made = subprocess.run(["groupadd", "--system", name], capture_output=True, text=True)
        try:
            return grp.getgrnam(name).gr_gid
        except KeyError:
            raise RuntimeError(f"groupadd {name} failed: {made.stderr.strip()}") from None


def user(name: str, *groups: str) -> User:
    """User ``name`` (created if missing, no home, no login shell) with ``groups`` added."""
    _require_root()
    try:
        entry = pwd.getpwnam(name)
    except KeyError:
        # Another test worker may make it at the same moment: its user is as good.
        made = subprocess.run(["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin",
                               "--user-group", name], capture_output=True, text=True)
        try:
            entry = pwd.getpwnam(name)
        except KeyError:
            raise RuntimeError(f"useradd {name} failed: {made.stderr.strip()}") from None
    return User(name, entry.pw_uid, entry.pw_gid, tuple(group(g) for g in groups))


def spawn(who: User | int, fn: Callable[[], Any]) -> tuple[int, int]:
    """Run ``fn`` in a forked child that has become ``who`` (a User, or a bare uid with no
    groups): (pid, pipe with its answer for :func:`collect`). Forked, not exec'd: this
    Python's own files may be unreadable to other users. SO_PEERCRED is taken at connect(),
    so the agent sees that user."""
    from node_agent.client import AgentClient, AgentError

    if os.getuid() != 0:
        pytest.skip("needs root to act as a second uid")
    # The client imports its HTTP stack at its first request, which the child could not:
    # one request that fails at once (nothing listens at /dev/null) loads it here.
    AgentClient(os.devnull).ping()
    uid, gid, groups = (who, who, ()) if isinstance(who, int) else (who.uid, who.gid, who.groups)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: never return into pytest
        try:
            os.close(read)
            os.setgroups(list(groups))
            os.setresgid(gid, gid, gid)
            os.setresuid(uid, uid, uid)
            out: dict[str, Any] = {"ok": fn()}
        except AgentError as exc:
            out = {"status": exc.status, "field": exc.field, "message": exc.message}
        except BaseException as exc:  # report anything
            out = {"crash": repr(exc)}
        try:
            os.write(write, json.dumps(out).encode())
        finally:
            os._exit(0)
    os.close(write)
    return pid, read


def collect(pid: int, read: int, timeout: float = 30.0) -> Any:
    """The answer of a child from :func:`spawn`: ``{"ok": result}``, an AgentError as
    ``{"status", "field", "message"}``, or ``{"crash": repr}``. Killed if it overruns."""
    deadline = time.monotonic() + timeout
    chunks: list[bytes] = []
    try:
        while time.monotonic() < deadline:
            if select.select([read], [], [], max(0.0, deadline - time.monotonic()))[0]:
                chunk = os.read(read, 65536)
                if not chunk:
                    break
                chunks.append(chunk)
        else:
            os.kill(pid, signal.SIGKILL)
    finally:
        os.close(read)
        os.waitpid(pid, 0)
    return json.loads(b"".join(chunks) or b'{"crash": "timed out"}')


def as_user(who: User | int, fn: Callable[[], Any]) -> Any:
    """:func:`spawn` then :func:`collect`."""
    return collect(*spawn(who, fn))
