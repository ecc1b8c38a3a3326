"""Checkpoint generations: each committed state counts one on, a restore never goes back silently."""

from __future__ import annotations

import os
import shutil
import signal
import stat
import time
from pathlib import Path

from harness.jupyter import running_server
from jupyter_gpufrac.kernel.checkpoint import Checkpointer
from jupyter_gpufrac.kernel.state_file import committed_generation


def test_generations_grow_with_each_committed_state_and_across_processes(tmp_path: Path) -> None:
    root = tmp_path / "k"
    first = Checkpointer(root)
    a = first.take({"x": 1})
    unchanged = first.take({"x": 1})
    b = first.take({"x": 2})
    assert 0 < a.generation == unchanged.generation < b.generation
    assert committed_generation(root) == b.generation
    # A new process goes on from what is on disk, and from what it loads.
    second = Checkpointer(root)
    assert second.take({"x": 3}).generation > b.generation
    third = Checkpointer(root)
    third.load({})
    assert third.generation == committed_generation(root)
    assert committed_generation(tmp_path / "none") is None


def _wait(check: object, what: str, timeout: float = 60.0) -> object:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = check()  # type: ignore[operator]
        if found:
            return found
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def _regular_only(folder: str, names: list[str]) -> list[str]:
    return [n for n in names if not (stat.S_ISREG(os.lstat(os.path.join(folder, n)).st_mode)
                                     or os.path.isdir(os.path.join(folder, n)))]


def test_a_renamed_older_checkpoint_folder_is_reported_as_older(tmp_path: Path) -> None:
    config = "c.GpuFrac.lease_poll_interval = 0.3\n"
    with running_server(tmp_path, str(tmp_path / "nobody.sock"), config) as server:
        notebook = server.open_notebook("secret.ipynb")
        try:
            folder = tmp_path / "data" / "gpufrac" / "checkpoints" / notebook.kernel_id
            before = committed_generation(folder) or 0
            notebook.ok("secret = 'v1-old'")
            old = _wait(lambda: (committed_generation(folder) or 0) > before and
                        committed_generation(folder), "the first checkpoint")
            # Someone who can write above the folder keeps a copy of it as it is now...
            shutil.copytree(folder, tmp_path / "old", ignore=_regular_only)
            notebook.ok("secret = 'v2-new'")
            pid = int(notebook.ok("print(__import__('os').getpid())").strip())
            _wait(lambda: (committed_generation(folder) or 0) > old, "the second checkpoint")
            time.sleep(1.5)  # the server looks at its kernels' checkpoints every 0.3 s
            # ...and, once the kernel died, puts it back in place of the newer one.
            os.kill(pid, signal.SIGKILL)
            folder.rename(tmp_path / "new")
            (tmp_path / "old").rename(folder)

            def restored() -> str | None:
                report = server.kernel_status(notebook.kernel_id).get("restore")
                return report.get("message") if report else None

            message = str(_wait(restored, "the restore report", 90))
            assert "older than the newest one recorded for it" in message, message
            status = server.kernel_status(notebook.kernel_id)["restore"]
            assert status["ok"] is False and status["older"]
            shown = notebook.ok("print(secret)")
            assert "older than the newest one recorded for it" in shown, shown
            assert "v1-old" in shown
        finally:
            notebook.close()
