"""A Jupyter data folder another user can write: links, planted files, foreign or open folders."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import time
from pathlib import Path

import pytest
from unix_users import ATTACKER, user

from harness.jupyter import running_server
from jupyter_gpufrac.kernel import store
from jupyter_gpufrac.server.events import KernelEventLog
from jupyter_gpufrac.server.settings import KernelSettings


def settings(root: Path) -> KernelSettings:
    return KernelSettings(socket_path="/nonexistent", client_name="test", default_request="0.25",
                          default_limit="1", checkpoint_root=str(root),
                          events=KernelEventLog(None, logging.getLogger("test")),
                          log=logging.getLogger("test"))


def private(path: Path) -> Path:
    path.mkdir(parents=True)
    path.chmod(0o700)
    return path


@pytest.mark.parametrize("shared", [False, True], ids=["own-folder", "open-folder"])
def test_a_linked_remembered_request_file_does_not_overwrite_its_target(
        tmp_path: Path, shared: bool) -> None:
    target = tmp_path / "important.txt"
    target.write_text("keep me")
    root = private(tmp_path / "checkpoints")
    s = settings(root)
    path = Path(s.remembered_request_path)
    # The attacker's links: at the name, and at the temporary name the writer used to pick.
    for name in (path, Path(f"{path}.{os.getpid()}.tmp")):
        name.symlink_to(target)
    if shared:
        attacker = user(ATTACKER)
        os.chown(root, attacker.uid, attacker.gid)
        root.chmod(0o777)
    # As `%gpu request --remember` keeps it (GpuMagic._remember).
    with contextlib.suppress(store.UnsafeCheckpointError):
        store.write_file(root, path.name, json.dumps({"request": "0.5", "limit": "1"}).encode(),
                         blobs=False)
    assert target.read_text() == "keep me"
    if not shared:
        # Ours alone: the request is kept, as a file of its own in place of the link.
        assert not path.is_symlink()
        assert json.loads(path.read_text()) == {"request": "0.5", "limit": "1"}
        assert s.last_request() == {"request": "0.5", "limit": "1"}


@pytest.mark.parametrize("content", [
    {"request": "lots"}, {"request": {"fraction": 0.5}}, {"request": "0.5", "limit": "huge"},
    {"request": True}, ["0.5"], "0.5",
])
def test_a_remembered_request_that_is_not_a_quantity_is_ignored(
        tmp_path: Path, content: object, caplog: pytest.LogCaptureFixture) -> None:
    root = private(tmp_path / "checkpoints")
    s = settings(root)
    Path(s.remembered_request_path).write_text(json.dumps(content))
    with caplog.at_level(logging.WARNING):
        assert s.last_request() is None
    assert "ignoring the remembered %gpu request" in caplog.text


def test_a_remembered_request_of_another_user_is_ignored(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    attacker = user(ATTACKER)
    root = private(tmp_path / "checkpoints")
    s = settings(root)
    path = Path(s.remembered_request_path)
    path.write_text(json.dumps({"request": "1", "limit": "1"}))
    os.chown(path, attacker.uid, attacker.gid)
    with caplog.at_level(logging.WARNING):
        assert s.last_request() is None
    assert "belongs to uid" in caplog.text
    # Written by us, it is read.
    path.unlink()
    store.write_file(root, path.name, json.dumps({"request": "0.5", "limit": None}).encode(),
                     blobs=False)
    assert s.last_request() == {"request": "0.5", "limit": None}


def _wait(check: object, what: str, timeout: float = 60.0) -> object:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = check()  # type: ignore[operator]
        if found:
            return found
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.mark.parametrize("how", ["open-data-folder", "foreign-data-folder",
                                 "foreign-checkpoint-root"])
def test_a_bad_checkpoint_folder_is_named_and_kernels_still_start(
        tmp_path: Path, missing_socket: str, how: str) -> None:
    attacker = user(ATTACKER)
    data = tmp_path / "data" / "gpufrac"
    data.mkdir(parents=True)
    data.chmod(0o700)
    bad = data
    if how == "open-data-folder":
        data.chmod(0o777)
        fix = f"chmod 700 {data}"
    elif how == "foreign-data-folder":
        # Another user pre-created the shared folder, writable by all.
        os.chown(data, attacker.uid, attacker.gid)
        data.chmod(0o777)
        fix = "another user owns it"
    else:
        bad = data / "checkpoints"
        bad.mkdir(mode=0o755)
        os.chown(bad, attacker.uid, attacker.gid)
        fix = "another user owns it"
    with running_server(tmp_path, missing_socket) as server:
        problems = server.get("/api/gpufrac/node")["config_problems"]
        said = [p for p in problems if str(bad) in p]
        assert len(said) == 1 and fix in said[0] and "without checkpoints" in said[0], problems
        assert str(bad) in server.log_text() and fix in server.log_text()
        notebook = server.open_notebook("shared.ipynb")
        try:
            assert notebook.ok("print(6 * 7)").strip() == "42"
            status = server.kernel_status(notebook.kernel_id)
            assert status["checkpoints_off"] and str(bad) in status["checkpoints_off"]
            shown = notebook.ok("%gpu")
            assert "checkpoint: off" in shown, shown
            pid = int(notebook.ok("import os; print(os.getpid())").strip())
            os.kill(pid, signal.SIGKILL)
            # Restarted by jupyter_client, without checkpoints, rather than left dead.
            _wait(lambda: _answers(notebook, pid), "the killed kernel to come back", 90)
        finally:
            notebook.close()
        assert "Unhandled error" not in server.log_text()
    # Nothing was written into the folder another user controls.
    assert not any(p.name.startswith("last-request") for p in bad.rglob("*"))
    assert not (data / "checkpoints").exists() or not any((data / "checkpoints").iterdir())


def _answers(notebook: object, old_pid: int) -> bool:
    try:
        reply = notebook.run("import os; print(os.getpid())", timeout=10)  # type: ignore[attr-defined]
    except Exception:
        return False
    return reply.status == "ok" and reply.stdout.strip().isdigit() and \
        int(reply.stdout.strip()) != old_pid
