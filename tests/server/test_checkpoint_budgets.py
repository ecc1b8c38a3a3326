"""The recovery point and the checkpoint budgets in a real server's REST kernel view."""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from traitlets.config import Config

from harness.agent import AgentProcess
from jupyter_gpufrac import contract
from jupyter_gpufrac.checkpoint_disk import free_disk
from jupyter_gpufrac.kernel import store
from jupyter_gpufrac.kernel.disk_shares import SPACE_CACHE_S, SharedDiskLimits
from jupyter_gpufrac.server.app import GpuFrac
from node_agent.quantities import format_bytes

from .conftest import gpufrac_config
from .test_checkpoint_retention import gpufrac_app, start_kernel

MiB = 2**20
FLUSH = "__import__('jupyter_gpufrac.kernel', fromlist=['x'])._hook.checkpointer.flush(60)"


async def run(jp_serverapp: Any, kernel_id: str, code: str) -> None:
    client = jp_serverapp.kernel_manager.get_kernel(kernel_id).client()
    client.start_channels()
    try:
        await client.wait_for_ready(timeout=60)
        reply = await client.execute(code, reply=True, timeout=120)
        assert reply["content"]["status"] == "ok", reply["content"]
        reply = await client.execute(FLUSH, reply=True, timeout=120, store_history=False)
        assert reply["content"]["status"] == "ok", reply["content"]
    finally:
        client.stop_channels()


class TestBudgetedKernel:
    @pytest.fixture
    def jp_server_config(self, agent: AgentProcess) -> dict[str, Any]:
        return gpufrac_config(agent.socket, checkpoint_kernel_budget="1MiB")

    async def test_the_rest_view_shows_the_recovery_point_and_what_is_not_protected(
            self, jp_fetch: Any, jp_serverapp: Any, no_leases: AgentProcess) -> None:
        app = gpufrac_app(jp_serverapp)
        kernel_id = await start_kernel(jp_fetch, Path(app.checkpoint_dir))
        try:
            status = json.loads((await jp_fetch("api", "gpufrac", "kernels", kernel_id)).body)
            # Nothing yet, or the empty namespace the kernel checkpoints as it starts.
            assert status["checkpoint"] is None or status["checkpoint"]["durable_cell"] == 0
            before = time.time()
            await run(jp_serverapp, kernel_id,
                      "import torch\nbig_tensor = torch.zeros(2**20)\nsmall = 3")
            status = json.loads((await jp_fetch("api", "gpufrac", "kernels", kernel_id)).body)
            point = status["checkpoint"]
            assert point["durable_cell"] == 1
            assert before - 1 <= point["durable_time"] <= time.time()  # a time, not an age
            assert list(point["unprotected"]) == ["big_tensor"]
            assert point["unprotected"]["big_tensor"] >= 4 * MiB
            assert "per-kernel checkpoint budget of 1.0 MiB" in point["unprotected_why"]
            disk = status["checkpoint_disk"]
            assert disk["kernel_budget"] == MiB and disk["user_budget"] > 0

            await run(jp_serverapp, kernel_id, "del big_tensor\nsmall = 4")
            point = json.loads((await jp_fetch("api", "gpufrac", "kernels", kernel_id)).body)[
                "checkpoint"]
            assert point["durable_cell"] == 2 and point["unprotected"] == {}
        finally:
            await jp_fetch("api", "kernels", kernel_id, method="DELETE")


def test_default_budgets_are_shares_of_the_space_free_for_checkpoints(tmp_path: Path) -> None:
    app = GpuFrac(config=Config({"GpuFrac": {"checkpoint_dir": str(tmp_path / "ck")}}))
    kernel, user = app.checkpoint_budgets()
    free = free_disk(tmp_path)
    # A quarter and a half of what was free (the disk may change a little meanwhile).
    assert abs(kernel - free // 4) < free // 100 + MiB
    assert abs(user - free // 2) < free // 100 + MiB
    sized = GpuFrac(config=Config({"GpuFrac": {"checkpoint_dir": str(tmp_path / "ck"),
                                               "checkpoint_kernel_budget": "0",
                                               "checkpoint_user_budget": "2GiB"}}))
    assert sized.checkpoint_budgets() == (0, 2 * 2**30)


def test_the_staging_budget_is_a_share_of_the_hosts_ram_or_a_size() -> None:
    ram = psutil.virtual_memory().total
    assert GpuFrac().staging_budget() == int(0.25 * ram)
    sized = GpuFrac(config=Config({"GpuFrac": {"checkpoint_staging_budget": "8GiB"}}))
    assert sized.staging_budget() == 8 * 2**30


@pytest.mark.parametrize(("name", "value"), [("checkpoint_kernel_budget", "-1GiB"),
                                             ("checkpoint_user_budget", "200%"),
                                             ("checkpoint_staging_budget", "lots")])
def test_a_bad_budget_names_the_setting_and_what_was_expected(name: str, value: str) -> None:
    app = GpuFrac(config=Config({"GpuFrac": {name: value}}))
    [problem] = app.config_problems
    assert problem.startswith(f"c.GpuFrac.{name}: expected ") and repr(value) in problem
    assert getattr(app, name) == app.traits()[name].default_value


class TestWritingShown:
    @pytest.fixture
    def jp_server_config(self, agent: AgentProcess, monkeypatch: pytest.MonkeyPatch
                         ) -> dict[str, Any]:
        # Each 8 MiB of a blob waits 1 s: the write lasts long enough to be seen on a busy machine.
        monkeypatch.setenv(store.SLOW_ENV, "1")
        return gpufrac_config(agent.socket)

    async def test_a_write_in_progress_is_shown_with_its_progress_and_is_not_activity(
            self, jp_fetch: Any, jp_serverapp: Any, no_leases: AgentProcess) -> None:
        app = gpufrac_app(jp_serverapp)
        km = jp_serverapp.kernel_manager
        # The server's questions are not the user's activity, nor a busy kernel in JupyterLab.
        assert not km.track_message_type(contract.CHECKPOINT_STATUS_REQUEST)
        kernel_id = await start_kernel(jp_fetch, Path(app.checkpoint_dir))
        client = km.get_kernel(kernel_id).client()
        client.start_channels()
        try:
            await client.wait_for_ready(timeout=60)
            reply = await client.execute("import torch\na = torch.full((2**24,), 2.0)",
                                         reply=True, timeout=120)
            assert reply["content"]["status"] == "ok"
            seen: list[dict[str, Any]] = []
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:  # the 64 MB write takes about 8 s
                point = json.loads((await jp_fetch("api", "gpufrac", "kernels", kernel_id)).body)[
                    "checkpoint"]
                # No "writing" at all: the kernel did not answer this time.
                if "writing" in point and point["writing"] is None and point["durable_cell"] == 1:
                    break
                if point.get("writing") is not None:
                    seen.append(point["writing"])
            else:
                raise AssertionError("the checkpoint after cell 1 was never written")
            assert seen, "the write was never shown"
            assert seen[0]["cell"] == 1 and seen[0]["bytes_total"] >= 2**26
            assert all(w["bytes_done"] <= w["bytes_total"] for w in seen)
            assert point["error"] is None
        finally:
            client.stop_channels()
            await jp_fetch("api", "kernels", kernel_id, method="DELETE")


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 32 MiB disk of its own (tmpfs), filled to 98% by a file ``filler`` on it."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=32m,mode=0700", "tmpfs",
                              str(disk)], capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"a small disk of its own needs mount (root): {mounted.stderr.strip()}")
    try:
        filler = disk / "filler"
        with open(filler, "wb") as out:
            out.write(b"\0" * (32 * MiB - 640 * 1024))
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


class TestBudgetsFollowTheDisk:
    @pytest.fixture
    def jp_server_config(self, agent: AgentProcess, small_disk: Path) -> dict[str, Any]:
        return gpufrac_config(agent.socket, checkpoint_dir=str(small_disk / "checkpoints"))

    async def test_a_disk_full_when_the_server_started_does_not_fix_the_budgets(
            self, jp_fetch: Any, jp_serverapp: Any, no_leases: AgentProcess,
            small_disk: Path) -> None:
        """Finding 8: the disk was 98% full as the server started; its per-kernel budget
        (25% of what was free) stayed 160 KiB for the server's life. Once space is freed, a
        kernel's budget is a quarter of what is free then."""
        app = gpufrac_app(jp_serverapp)
        (small_disk / "filler").unlink()
        kernel_id = await start_kernel(jp_fetch, Path(app.checkpoint_dir))
        try:
            await run(jp_serverapp, kernel_id, "import torch\nfour_mib = torch.zeros(2**20)")
            status = json.loads((await jp_fetch("api", "gpufrac", "kernels", kernel_id)).body)
            assert status["checkpoint"]["unprotected"] == {}, status["checkpoint"]
            assert status["checkpoint_disk"]["kernel_budget"] > 7 * MiB
        finally:
            await jp_fetch("api", "kernels", kernel_id, method="DELETE")


def test_a_share_of_a_full_disk_says_the_disk_is_short_and_follows_it(small_disk: Path) -> None:
    folder = small_disk / "checkpoints" / "k1"
    folder.mkdir(parents=True)
    now = [0.0]
    limits = SharedDiskLimits(folder, None, 100 * MiB, {"kernel": 0.25}, clock=lambda: now[0])
    room = limits.room()
    assert room is not None and room.bytes < 200 * 1024
    assert room.why.startswith("over the per-kernel checkpoint budget of ")
    assert f"25% of the {format_bytes(limits.space())} free for checkpoints now" in room.why
    assert f"under {small_disk / 'checkpoints'}" in room.why and "free disk space there" in room.why
    (small_disk / "filler").unlink()
    now[0] += SPACE_CACHE_S
    room = limits.room()
    assert room is not None and room.bytes > 7 * MiB
