"""A kernel restarted where it was: nobody else can take its sockets between the two processes."""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import socket
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from unix_users import ATTACKER, collect, spawn, user

from harness.agent import AgentProcess, wait_for
from harness.jupyter import Notebook, running_server
from jupyter_gpufrac.server.transport import MAX_SOCKET_PATH, ipc_prefix

CHANNELS = ("shell", "iopub", "stdin", "control", "hb")


def addresses(info: dict[str, Any]) -> list[str | tuple[str, int]]:
    """Where each of the kernel's sockets listens: Unix socket paths, or TCP (host, port)."""
    if info["transport"] == "ipc":
        return [f"{info['ip']}-{info[f'{name}_port']}" for name in CHANNELS]
    return [(info["ip"], int(info[f"{name}_port"])) for name in CHANNELS]


def bind_any(targets: list[str | tuple[str, int]], stop: int, ready: int) -> list[str]:
    """The attacker: bind each of the kernel's addresses the moment it is free, until ``stop``
    is readable (``ready`` is written after the first round); what it managed to bind, and
    why it could not."""
    bound: list[str] = []
    held: list[socket.socket] = []
    why: set[str] = set()
    deadline = time.monotonic() + 120  # never outlive a test that died
    while time.monotonic() < deadline and not select.select([stop], [], [], 0)[0]:
        for target in targets:
            if str(target) in bound:
                continue
            sock = socket.socket(socket.AF_UNIX if isinstance(target, str) else socket.AF_INET)
            try:
                sock.bind(target)
                sock.listen(8)
            except OSError as err:
                sock.close()
                why.add(f"{type(err).__name__}")
                continue
            held.append(sock)
            bound.append(str(target))
        if ready >= 0:
            os.write(ready, b"x")
            os.close(ready)
            ready = -1
        time.sleep(0.001)
    for sock in held:
        sock.close()
    return [*bound, *(f"refused: {w}" for w in sorted(why))]


def test_a_restarted_kernels_sockets_cannot_be_taken_by_another_user(
        tmp_path: Path, agent: AgentProcess) -> None:
    """Finding 2: another user binds each of the kernel's addresses as soon as the killed
    process frees it. The kernel comes back on its own addresses anyway, the open page keeps
    its connection, and the attacker never held one."""
    attacker = user(ATTACKER)
    with running_server(tmp_path, agent.socket) as server:
        notebook = server.open_notebook("mine.ipynb")
        try:
            pid = int(notebook.ok("import os; secret = 42; print(os.getpid())").strip())
            connection = tmp_path / "runtime" / f"kernel-{notebook.kernel_id}.json"
            info = json.loads(connection.read_text())
            targets = addresses(info)
            stop_read, stop_write = os.pipe()
            ready_read, ready_write = os.pipe()

            def attack() -> list[str]:
                os.close(stop_write)
                os.close(ready_read)
                return bind_any(targets, stop_read, ready_write)

            child = spawn(attacker, attack)
            os.close(stop_read)
            os.close(ready_write)
            try:
                assert os.read(ready_read, 1) == b"x"  # the attacker is at it before the kill
                os.close(ready_read)
                os.kill(pid, signal.SIGKILL)
                wait_for(lambda: _back(notebook, pid), 90, "the killed kernel to come back")
            finally:
                os.close(stop_write)
                answer = collect(*child)
            bound = [a for a in answer.get("ok", []) if not a.startswith("refused")]
            assert "ok" in answer and bound == [], answer
            # The page never reconnected, and its kernel has its variables back.
            assert notebook.ok("print(secret)").strip() == "42"
            assert json.loads(connection.read_text()) == info
        finally:
            notebook.close()
        assert "Address already in use" not in server.log_text()


def _back(notebook: Notebook, old_pid: int) -> bool:
    try:
        reply = notebook.run("import os; print(os.getpid())", timeout=10)
    except AssertionError:
        return False
    return reply.status == "ok" and reply.stdout.strip().isdigit() and \
        int(reply.stdout.strip()) != old_pid


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A private folder with a short path (pytest's are too long for socket paths)."""
    path = Path(tempfile.mkdtemp(prefix="rt-"))
    yield path
    shutil.rmtree(path)


def test_sockets_go_beside_the_connection_file_only_in_a_private_folder_and_when_they_fit(
        short_tmp: Path, tmp_path: Path) -> None:
    private = short_tmp
    kernel = "0f3c2a8e-1111-4222-8333-944455556666"
    assert ipc_prefix(str(private / f"kernel-{kernel}.json"), kernel) == \
        str(private / f"kernel-{kernel}-ipc")
    for folder in (tmp_path / "open", tmp_path / ("x" * 80)):
        folder.mkdir(mode=0o700)
        if folder.name == "open":
            folder.chmod(0o777)
        prefix = ipc_prefix(str(folder / f"kernel-{kernel}.json"), kernel)
        assert not prefix.startswith(str(folder)) and prefix.endswith(f"kernel-{kernel}-ipc")
        assert len(prefix) + 6 <= MAX_SOCKET_PATH
        spare = Path(prefix).parent
        st = spare.stat()
        assert (st.st_uid, st.st_mode & 0o777) == (os.geteuid(), 0o700)
