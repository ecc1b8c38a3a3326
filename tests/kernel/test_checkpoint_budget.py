"""Checkpoint disk budgets (issue 27): what fits is protected, the rest is named, never silently."""

from __future__ import annotations

import itertools
import json
import os
import shutil
import signal
from pathlib import Path
from typing import Any

import numpy
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jupyter_gpufrac import contract
from jupyter_gpufrac.kernel import env as kenv
from jupyter_gpufrac.kernel.budget import (
    OTHERS_CACHE_S,
    DiskLimits,
    least_bytes,
    parse_budget,
    protect,
    staged_bytes,
)
from jupyter_gpufrac.kernel.checkpoint import Checkpointer
from jupyter_gpufrac.kernel.groups import group_size
from node_agent.quantities import QuantityError

from .kernels import running_kernel, wait_written

SUMMARY = "__import__('jupyter_gpufrac.kernel', fromlist=['x']).summary()['checkpoint']"
MiB = 2**20


@given(st.lists(st.integers(0, 1000), max_size=12), st.integers(0, 4000))
def test_what_is_protected_fits_and_nothing_that_fits_is_left_out(
        sizes: list[int], budget: int) -> None:
    chosen = protect(sizes, budget)
    assert chosen == sorted(set(chosen))
    used = sum(sizes[i] for i in chosen)
    assert used <= budget
    # Maximal: each unit left out is larger than what the protected ones leave of the budget.
    for i in set(range(len(sizes))) - set(chosen):
        assert sizes[i] > budget - used


@given(st.lists(st.integers(0, 100), max_size=7), st.integers(0, 300))
def test_smallest_first_protects_as_many_units_as_any_choice_could(
        sizes: list[int], budget: int) -> None:
    best = max(len(subset) for n in range(len(sizes) + 1)
               for subset in itertools.combinations(sizes, n) if sum(subset) <= budget)
    assert len(protect(sizes, budget)) == best


@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.integers(0, 20_000), min_size=1, max_size=6), st.integers(0, 60_000))
def test_a_checkpoint_holds_what_fits_and_names_only_what_could_not(
        tmp_path: Path, sizes: list[int], budget: int) -> None:
    folder = tmp_path / f"k{len(list(tmp_path.iterdir()))}"
    ns: dict[str, Any] = {f"v{i}": numpy.zeros(n, dtype=numpy.uint8) for i, n in enumerate(sizes)}
    ck = Checkpointer(folder)
    ck.limits = DiskLimits(folder, budget, None)
    result = ck.take(ns, execution_count=1)
    header = Checkpointer(folder).read_header()
    assert header is not None
    used = group_size(header["groups"], "bytes")
    assert used <= budget
    assert sorted([*result.names, *result.unprotected]) == sorted(ns)
    for size in result.unprotected.values():
        assert size > budget - used  # it would not have fitted beside what is protected


def test_a_negative_budget_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="budget: expected bytes >= 0"):
        protect([1], -1)


@pytest.mark.parametrize(("text", "expected"), [
    ("25%", (0.25, None)), ("100 %", (1.0, None)), ("0", (None, 0)), ("20GiB", (None, 20 * 2**30)),
    ("500M", (None, 500 * 10**6)), ("4096", (None, 4096)),
])
def test_budgets_read_as_a_share_or_a_size(text: str, expected: tuple[Any, Any]) -> None:
    assert parse_budget(text, "c.GpuFrac.checkpoint_kernel_budget") == expected


@pytest.mark.parametrize("text", ["-1", "-5GiB", "150%", "lots", "0.5", "", "25%%"])
def test_a_malformed_budget_names_the_setting_and_what_was_expected(text: str) -> None:
    with pytest.raises(QuantityError) as bad:
        parse_budget(text, "c.GpuFrac.checkpoint_user_budget")
    assert str(bad.value).startswith("c.GpuFrac.checkpoint_user_budget: expected ")


@pytest.mark.parametrize("make", [
    lambda: torch.zeros(1000), lambda: torch.zeros(1000)[10:20], lambda: numpy.zeros(1000),
    lambda: numpy.zeros((100, 100))[::3, ::7], lambda: b"x" * 5000, lambda: bytearray(5000),
    lambda: [1, 2, 3],
])
def test_the_size_known_before_copying_never_exceeds_what_the_checkpoint_takes(
        ckdir: Path, make: Any) -> None:
    value = make()
    Checkpointer(ckdir).take({"v": value}, execution_count=1)
    header = Checkpointer(ckdir).read_header()
    assert header is not None
    [record] = header["groups"]
    assert least_bytes(value) <= group_size([record], "bytes")


def test_budget_zero_protects_nothing_names_everything_and_a_restore_says_so(
        ckdir: Path) -> None:
    ns: dict[str, Any] = {"t": torch.zeros(1000), "x": 1, "s": "text"}
    ck = Checkpointer(ckdir)
    ck.limits = DiskLimits(ckdir, 0, None)
    result = ck.take(ns, execution_count=1)
    assert result.names == []
    assert sorted(result.unprotected) == ["s", "t", "x"]
    assert result.unprotected["t"] >= 4000
    assert "per-kernel checkpoint budget of 0 B" in str(result.unprotected_why)
    assert "c.GpuFrac.checkpoint_kernel_budget" in str(result.unprotected_why)
    loaded: dict[str, Any] = {}
    back = Checkpointer(ckdir).load(loaded)
    assert loaded == {}
    assert sorted(back.lost) == ["s", "t", "x"]
    assert all(why.startswith("not protected: it takes ") for why in back.lost.values())
    assert back.header["unprotected"] == result.unprotected


def test_the_smallest_variables_are_protected_first(ckdir: Path) -> None:
    ns: dict[str, Any] = {"big": torch.zeros(MiB // 4), "mid": torch.zeros(MiB // 16),
                          "small": torch.zeros(100), "held": {"t": torch.zeros(MiB // 8)}}
    ck = Checkpointer(ckdir)
    ck.limits = DiskLimits(ckdir, MiB // 2, None)  # room for mid and small, not big or held
    result = ck.take(ns, execution_count=1)
    assert result.names == ["mid", "small"]
    assert result.unprotected["big"] == MiB and result.unprotected["held"] > MiB // 2
    # big alone is over the budget: it is not even copied (held's size is learned by pickling).
    assert result.bytes_written < MiB
    loaded: dict[str, Any] = {}
    Checkpointer(ckdir).load(loaded)
    assert sorted(loaded) == ["mid", "small"]


def test_views_of_one_storage_are_protected_or_named_together(ckdir: Path) -> None:
    base = torch.zeros(MiB // 4)
    ns: dict[str, Any] = {"base": base, "view": base[:10], "other": torch.zeros(100)}
    ck = Checkpointer(ckdir)
    ck.limits = DiskLimits(ckdir, MiB // 2, None)
    result = ck.take(ns, execution_count=1)
    assert result.names == ["other"]
    assert sorted(result.unprotected) == ["base", "view"]


def test_a_variable_that_grows_past_the_budget_is_named_and_its_old_value_not_restored(
        ckdir: Path) -> None:
    ns: dict[str, Any] = {"grows": torch.ones(1000), "x": 1}
    ck = Checkpointer(ckdir)
    ck.limits = DiskLimits(ckdir, MiB, None)
    assert ck.take(ns, execution_count=1).unprotected == {}
    ns["grows"] = torch.ones(MiB)  # 4 MiB: past the budget
    ns["x"] = 2
    result = ck.take(ns, execution_count=2)
    assert list(result.unprotected) == ["grows"]
    assert ck.status()["unprotected"] == result.unprotected
    loaded: dict[str, Any] = {}
    back = Checkpointer(ckdir).load(loaded)
    # The value of cell 1 is not presented as current: a restore names it, and holds none.
    assert "grows" not in loaded and loaded["x"] == 2
    assert "not protected" in back.lost["grows"]
    # Smaller again: protected again, with its new value.
    ns["grows"] = torch.full((10,), 7.0)
    assert ck.take(ns, execution_count=3).unprotected == {}
    loaded = {}
    Checkpointer(ckdir).load(loaded)
    assert torch.equal(loaded["grows"], torch.full((10,), 7.0))


def test_a_cell_that_changes_nothing_keeps_naming_what_is_not_protected(ckdir: Path) -> None:
    ns: dict[str, Any] = {"big": list(range(100_000)), "x": 1}
    ck = Checkpointer(ckdir)
    ck.limits = DiskLimits(ckdir, 10_000, None)
    first = ck.take(ns, execution_count=1)
    assert list(first.unprotected) == ["big"]
    again = ck.take(ns, execution_count=2)
    assert again.unprotected == first.unprotected
    assert "not protected" in again.lost["big"]


def test_the_user_budget_counts_the_other_kernels_checkpoints(ckdir: Path) -> None:
    other = ckdir.parent / "kernel-2"
    Checkpointer(other).take({"t": torch.zeros(MiB // 2)}, execution_count=1)  # about 2 MiB
    ns: dict[str, Any] = {"t": torch.zeros(MiB // 2), "x": 1}
    ck = Checkpointer(ckdir)
    ck.limits = DiskLimits(ckdir, None, 3 * MiB)
    result = ck.take(ns, execution_count=1)
    assert list(result.unprotected) == ["t"]
    why = str(result.unprotected_why)
    assert "per-user checkpoint budget of 3.0 MiB" in why and "c.GpuFrac.checkpoint_user_budget" in why
    # Measured once, then cached: removing the other kernel's folder shows only later.
    shutil.rmtree(other)
    assert ck.take(ns, execution_count=2).unprotected == result.unprotected


def test_the_other_kernels_are_measured_again_after_the_cache_time(ckdir: Path) -> None:
    other = ckdir.parent / "kernel-2"
    Checkpointer(other).take({"t": torch.zeros(MiB // 4)}, execution_count=1)
    now = [0.0]
    limits = DiskLimits(ckdir, None, 10 * MiB, clock=lambda: now[0])
    taken = limits.others()
    assert taken >= MiB
    shutil.rmtree(other)
    now[0] = OTHERS_CACHE_S - 1
    assert limits.others() == taken
    now[0] = OTHERS_CACHE_S
    assert limits.others() == 0
    room = limits.room()
    assert room is not None and room.bytes == 10 * MiB


def test_the_budgets_reach_the_kernel_from_its_environment() -> None:
    parsed = kenv.parse({contract.CHECKPOINT_KERNEL_BUDGET: "1048576",
                         contract.CHECKPOINT_USER_BUDGET: "0"})
    assert (parsed.checkpoint_kernel_budget, parsed.checkpoint_user_budget) == (MiB, 0)
    bad = kenv.parse({contract.CHECKPOINT_KERNEL_BUDGET: "-3"})
    assert bad.checkpoint_kernel_budget is None
    assert any(contract.CHECKPOINT_KERNEL_BUDGET in problem for problem in bad.problems)


def test_a_kernel_over_budget_runs_on_names_what_is_not_protected_and_survives_a_removed_folder(
        ckdir: Path) -> None:
    env = {"GPUFRAC_CHECKPOINT_DIR": str(ckdir), contract.CHECKPOINT_KERNEL_BUDGET: str(MiB)}
    with running_kernel(env) as k:
        assert k.run("import torch\nbig_tensor = torch.zeros(2**20)\nsmall = 3").status == "ok"
        wait_written(k)
        state = k.value(SUMMARY)
        assert list(state["unprotected"]) == ["big_tensor"]
        shown = k.run("%gpu").stdout
        assert "not protected: big_tensor (4.0 MiB) — over the per-kernel checkpoint budget " \
               "of 1.0 MiB; raise c.GpuFrac.checkpoint_kernel_budget" in shown
        shutil.rmtree(ckdir)  # by hand, while the kernel runs
        assert k.run("small = 4").status == "ok"
        wait_written(k)
        assert k.value(SUMMARY)["error"] is None
        loaded: dict[str, Any] = {}
        back = Checkpointer(ckdir).load(loaded)
        assert loaded["small"] == 4 and "not protected" in back.lost["big_tensor"]
        # small grows past the budget: named from now on, and its old value is not kept as if
        # it were current.
        assert k.run("small = torch.ones(2**19)").status == "ok"
        wait_written(k)
        assert sorted(k.value(SUMMARY)["unprotected"]) == ["big_tensor", "small"]
        loaded = {}
        back = Checkpointer(ckdir).load(loaded)
        assert "small" not in loaded and "not protected" in back.lost["small"]


def test_a_kernel_with_budget_zero_runs_names_every_variable_and_its_restore_says_so(
        ckdir: Path) -> None:
    env = {"GPUFRAC_CHECKPOINT_DIR": str(ckdir), contract.CHECKPOINT_KERNEL_BUDGET: "0"}
    with running_kernel(env) as k:
        assert k.run("a = 1\nb = [1, 2]").status == "ok"
        wait_written(k)
        shown = k.run("%gpu").stdout
        assert "not protected: " in shown and "a (" in shown and "b (" in shown, shown
        assert "per-kernel checkpoint budget of 0 B" in shown
        os.kill(k.pid, signal.SIGKILL)
    reason = {"cause": "died", "message": "killed by a test"}
    env.update({contract.RESTORE: "1", contract.RESTART_REASON: json.dumps(reason)})
    with running_kernel(env) as k:
        report = k.ask(contract.ASK_RESTORE_REPORT)["report"]
        assert report["restored"] == [] and report["lost"] == ["a", "b"]
        assert all("not protected" in why for why in report["lost_reasons"].values())
        assert report["ok"] is False and "not protected" in report["message"]
        assert k.run("c = 3").status == "ok"


def test_the_checkpoint_status_is_answered_on_the_control_channel_while_a_cell_runs(
        ckdir: Path) -> None:
    env = {"GPUFRAC_CHECKPOINT_DIR": str(ckdir), contract.CHECKPOINT_KERNEL_BUDGET: "0"}
    with running_kernel(env) as k:
        assert k.run("x = 1").status == "ok"
        wait_written(k)
        started = k.client.execute("import threading\nthreading.Event().wait(120)")
        while True:  # the cell runs from its execute_input on
            msg = k.client.get_iopub_msg(timeout=60)
            if (msg["header"]["msg_type"] == "execute_input"
                    and msg["parent_header"].get("msg_id") == started):
                break
        # The cell still runs when the kernel is shut down (killed) at the end of the block.
        request = k.client.session.msg(contract.CHECKPOINT_STATUS_REQUEST, {})
        k.client.control_channel.send(request)
        reply = k.client.control_channel.get_msg(timeout=60)
        assert reply["parent_header"]["msg_id"] == request["header"]["msg_id"]
        assert reply["header"]["msg_type"] == contract.CHECKPOINT_STATUS_REPLY
        status = reply["content"]
        assert status["durable_cell"] == 1 and status["writing"] is None
        assert list(status["unprotected"]) == ["x"]


def test_the_staging_budget_names_what_a_snapshot_would_copy_beyond_it(ckdir: Path) -> None:
    """Changed tensors and arrays are copied at the cell's end: beyond the staging budget, one
    whose bytes nothing can prove unchanged while they are written (a tensor made under
    ``torch.inference_mode()`` has no version counter) is left out and named; a host tensor
    with a version counter is held and written from where it is."""
    with torch.inference_mode():
        weights = torch.zeros(2**20)
    ns: dict[str, Any] = {"weights": weights, "grid": numpy.zeros(2**17),
                          "bias": torch.zeros(16), "held": torch.zeros(2**20), "x": 1}
    ck = Checkpointer(ckdir)
    ck.staging_budget = 2 * MiB  # weights and held take 4 MiB each, grid 1 MiB
    first = ck.take(ns, execution_count=1)
    assert first.unprotected == {"weights": 4 * MiB}
    assert sorted(first.names) == ["bias", "grid", "held", "x"]
    assert "snapshot memory budget of 2.0 MiB" in str(first.unprotected_why)
    assert "c.GpuFrac.checkpoint_staging_budget" in str(first.unprotected_why)
    # Unchanged, it stays named; a restore says it was not protected and loads no old value.
    again = ck.take(ns, execution_count=2)
    assert again.unprotected == first.unprotected
    loaded: dict[str, Any] = {}
    back = Checkpointer(ckdir).load(loaded)
    assert "weights" not in loaded and "not protected" in back.lost["weights"]
    # Once it fits (the tensor shrank), it is protected again.
    ns["weights"] = torch.ones(2**18)
    third = ck.take(ns, execution_count=3)
    assert third.unprotected == {} and "weights" in third.names


def test_staged_bytes_counts_what_a_snapshot_copies() -> None:
    tensor, array = torch.zeros(1000), numpy.zeros(1000)
    assert staged_bytes(tensor) == 4000
    assert staged_bytes(array) == 8000
    assert staged_bytes([tensor]) == 0  # a container's pickling tells
    assert staged_bytes(b"x" * 10) == 0


def test_the_staging_budget_reaches_the_kernel_and_a_bad_one_is_named() -> None:
    parsed = kenv.parse({contract.CHECKPOINT_STAGING_BUDGET: "1048576"})
    assert parsed.checkpoint_staging_budget == MiB
    bad = kenv.parse({contract.CHECKPOINT_STAGING_BUDGET: "lots"})
    assert bad.checkpoint_staging_budget is None
    assert any(contract.CHECKPOINT_STAGING_BUDGET in problem for problem in bad.problems)
    with pytest.raises(QuantityError) as caught:
        parse_budget("most", "c.GpuFrac.checkpoint_staging_budget", "the host's RAM")
    assert caught.value.field == "c.GpuFrac.checkpoint_staging_budget"
    assert "a share of the host's RAM like 25%" in caught.value.message
