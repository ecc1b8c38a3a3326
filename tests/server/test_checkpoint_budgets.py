"""The recovery point and the checkpoint budgets in a real server's REST kernel view."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
from traitlets.config import Config

from harness.agent import AgentProcess
from jupyter_gpufrac import contract
from jupyter_gpufrac.checkpoint_disk import free_disk
from jupyter_gpufrac.kernel import store
from jupyter_gpufrac.server.app import GpuFrac

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
