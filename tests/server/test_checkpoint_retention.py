"""Checkpoints of shut-down kernels through real servers: marked, kept, removed at start and by
the periodic sweep; running, restarted and other servers' kernels' folders stay."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import time
from pathlib import Path
from typing import Any

import pytest

from harness.agent import AgentProcess
from harness.jupyter import Server, start_server, stop_server
from jupyter_gpufrac import contract
from jupyter_gpufrac.checkpoint_disk import SHUTDOWN_MARKER, read_marker, write_marker

from .conftest import gpufrac_config


def gpufrac_app(jp_serverapp: Any) -> Any:
    return jp_serverapp.web_app.settings["gpufrac_app"]


def listening(folder: Path) -> bool:
    """Whether the kernel of ``folder`` listens on its wake socket (it runs, hooked)."""
    try:
        fd = os.open(folder, os.O_PATH | os.O_DIRECTORY)
    except FileNotFoundError:
        return False
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            sock.connect(f"/proc/self/fd/{fd}/{contract.WAKE_SOCKET}")
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


async def until(check: Any, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.1)


async def start_kernel(jp_fetch: Any, root: Path) -> str:
    response = await jp_fetch("api", "kernels", method="POST", body=json.dumps({"name": "python3"}))
    kernel_id = str(json.loads(response.body)["id"])
    await until(lambda: listening(root / kernel_id), f"kernel {kernel_id} to listen")
    return kernel_id


def backdate(folder: Path, age: float) -> None:
    when = time.time() - age
    for path in [*folder.rglob("*"), folder]:
        if not path.is_symlink():
            os.utime(path, (when, when), follow_symlinks=False)


class TestShutdownAndServerStart:
    @pytest.fixture
    def jp_server_config(self, agent: AgentProcess) -> dict[str, Any]:
        return gpufrac_config(agent.socket)

    async def test_a_deleted_kernel_is_marked_and_removed_by_a_new_server_start_while_running_and_restarted_ones_stay(  # noqa: E501
            self, jp_fetch: Any, jp_serverapp: Any, no_leases: AgentProcess,
            tmp_path: Path) -> None:
        app = gpufrac_app(jp_serverapp)
        assert app.checkpoint_keep_seconds == 86400.0 and app.checkpoint_sweep_interval == 3600.0
        root = Path(app.checkpoint_dir)
        deleted = await start_kernel(jp_fetch, root)
        restarted = await start_kernel(jp_fetch, root)
        running = await start_kernel(jp_fetch, root)

        await jp_fetch("api", "kernels", restarted, "restart", method="POST", body="{}")
        await until(lambda: listening(root / restarted), "the restarted kernel to listen")
        await jp_fetch("api", "kernels", deleted, method="DELETE")
        marker = read_marker(root / deleted)
        assert marker is not None and abs(marker.time - time.time()) < 60
        assert marker.keep_until == pytest.approx(marker.time + 86400.0)
        assert (root / deleted / "blobs").is_dir()
        for kernel_id in (restarted, running):
            assert not (root / kernel_id / SHUTDOWN_MARKER).exists(), kernel_id

        status = json.loads((await jp_fetch("api", "gpufrac", "kernels", running)).body)
        disk = status["checkpoint_disk"]
        assert disk["folders"] == 3 and disk["kept_after_shutdown"] == 1
        assert disk["kept_until"] == pytest.approx(marker.keep_until)
        assert 0 <= disk["kernel_bytes"] <= disk["all_bytes"] and disk["complete"] is True

        # Nothing was written in the running kernels' folders for days: only their wake sockets
        # (they run, under another server than the new one) keep them.
        for kernel_id in (restarted, running):
            backdate(root / kernel_id, 3 * 86400)
        config = (f"c.GpuFrac.checkpoint_dir = {str(root)!r}\n"
                  "c.GpuFrac.checkpoint_keep_seconds = 0\nc.GpuFrac.embedded_agent = False\n")
        second: Server = await asyncio.to_thread(start_server, tmp_path / "second",
                                                 no_leases.socket, config)
        try:
            await until(lambda: not (root / deleted).exists(), "the new server to remove it", 30)
            assert (root / restarted).is_dir() and (root / running).is_dir()
            # The sweep's summary line comes once its last folder is gone.
            await until(lambda: "expired checkpoint folders" in second.log_text(),
                        "the sweep's summary in the log", 30)
            log = second.log_text()
            assert f"removed the checkpoint of kernel {deleted} (shut down at" in log
            assert "removed 1 expired checkpoint folders" in log and "freeing" in log

            # A server that stops shuts its kernels down, but not as their users did: no marker.
            status_code, model = await asyncio.to_thread(
                second.api, "/api/kernels", "POST", {"name": "python3"})
            assert status_code == 201, model
            theirs = str(model["id"])
            await until(lambda: listening(root / theirs), "the second server's kernel")
        finally:
            await asyncio.to_thread(stop_server, second)
        assert (root / theirs).is_dir() and not (root / theirs / SHUTDOWN_MARKER).exists()
        assert not listening(root / theirs)

        for kernel_id in (restarted, running):
            await jp_fetch("api", "kernels", kernel_id, method="DELETE")
            assert read_marker(root / kernel_id) is not None


class TestPeriodicSweep:
    @pytest.fixture
    def jp_server_config(self, agent: AgentProcess) -> dict[str, Any]:
        return gpufrac_config(agent.socket, checkpoint_keep_seconds=0.0,
                              checkpoint_sweep_interval=0.2)

    async def test_the_periodic_sweep_removes_what_expires_after_the_start(
            self, jp_serverapp: Any) -> None:
        await jp_serverapp.extension_manager.start_all_extensions()
        app = gpufrac_app(jp_serverapp)
        root = Path(app.checkpoint_dir)
        # Twice: the second folder appears after a sweep has run, so only a later one removes it.
        for name in ("shut-down-since-the-start", "shut-down-later"):
            folder = root / name
            (folder / "blobs").mkdir(parents=True, mode=0o700)
            folder.chmod(0o700)
            (folder / "blobs" / "a.bin").write_bytes(b"x" * 100_000)
            now = time.time()
            assert write_marker(folder, now, now)
            await until(lambda folder=folder: not folder.exists(), "the periodic sweep", 10)
        assert root.is_dir()
