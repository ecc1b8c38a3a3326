"""Pure pieces: environment parsing, ladder decisions, namespace selection, messages, %gpu parser."""

from __future__ import annotations

import json
import types
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from IPython.core.error import UsageError

from jupyter_gpufrac.kernel import env as kenv
from jupyter_gpufrac.kernel import ladder, messages, namespace
from jupyter_gpufrac.kernel.magics import build_parser

GiB = 1024**3


def test_env_parses_the_provisioner_contract() -> None:
    parsed = kenv.parse({
        "GPUFRAC_LEASE_ID": "l-1", "GPUFRAC_AGENT_SOCKET": "/s", "GPUFRAC_KERNEL_ID": "k",
        "GPUFRAC_REQUEST": str(4 * GiB), "GPUFRAC_LIMIT": str(8 * GiB),
        "GPUFRAC_GPU_UUID": "GPU-a", "GPUFRAC_GPU_INDEX": "1", "GPUFRAC_GPU_NAME": "Sim",
        "GPUFRAC_GPU_TOTAL": str(16 * GiB), "GPUFRAC_SIMULATED": "1",
        "GPUFRAC_CHECKPOINT_DIR": "/ck", "GPUFRAC_RESTORE": "1",
        "GPUFRAC_RESTART_REASON": '{"cause": "migrated", "message": "free GPU 1", '
                                  '"from_gpu": "GPU-a", "to_gpu": "GPU-b"}',
    })
    assert parsed.has_lease and parsed.request == 4 * GiB and parsed.limit == 8 * GiB
    assert parsed.gpu_index == 1 and parsed.simulated and parsed.restore
    assert parsed.checkpoint_dir == Path("/ck")
    assert parsed.restart_reason == kenv.RestartReason("migrated", "free GPU 1", "GPU-a", "GPU-b")
    assert parsed.problems == ()


def test_env_without_lease_and_with_bad_values() -> None:
    parsed = kenv.parse({"GPUFRAC_REQUEST": "lots", "GPUFRAC_RESTART_REASON": "plain words"},
                        connection_file="/run/kernel-abc-123.json")
    assert not parsed.has_lease and "GPUFRAC_LEASE_ID is not set" in parsed.no_lease_reason()
    assert "not started by the gpufrac kernel provisioner" in parsed.no_lease_reason()
    assert parsed.kernel_id == "abc-123"
    assert parsed.checkpoint_dir.name == "abc-123"
    assert parsed.problems == ("GPUFRAC_REQUEST: expected a whole number of bytes, got 'lots'",)
    assert parsed.restart_reason == kenv.RestartReason("unknown", "plain words")
    assert not parsed.restore


def test_limit_below_request_is_reported_and_clamped() -> None:
    parsed = kenv.parse({"GPUFRAC_REQUEST": "10", "GPUFRAC_LIMIT": "5"})
    assert parsed.limit == 10 and "below" in parsed.problems[0]


def test_namespace_selection() -> None:
    hidden_exit = object()
    ns = {"In": [], "Out": {}, "_": 1, "__": 2, "_i": "", "_i12": "", "_12": 3, "_oh": {},
          "exit": hidden_exit, "quit": object(), "x": 1, "_private": 2, "types": types,
          "__builtins__": {}, "get_ipython": print, "__warningregistry__": {}}
    sel = namespace.select(ns, {"exit": hidden_exit})
    assert set(sel.values) == {"x", "_private"}
    assert sel.modules == {"types": "types"}


@given(st.integers(0, 100))
def test_backoff_is_monotonic_and_capped(failures: int) -> None:
    delay = ladder.backoff_delay(failures)
    assert 0 <= delay <= 30
    assert ladder.backoff_delay(failures + 1) >= delay


def test_directive_filtering_and_cursor() -> None:
    started = 1000.0
    directives = [
        {"seq": 1, "lease_id": "l-1", "kind": "migrate", "created": 900.0},  # old history
        {"seq": 2, "lease_id": "l-2", "kind": "shrink", "created": 1001.0},  # someone else
        {"seq": 3, "lease_id": "l-1", "kind": "shrink", "created": 1001.0},
    ]
    assert [d["seq"] for d in ladder.fresh_directives(directives, "l-1", started)] == [3]
    assert ladder.next_cursor(5, 9) == 9
    assert ladder.next_cursor(9, 2) == 0  # the agent restarted with a new sequence


def test_shrink_then_offload_between_cells() -> None:
    state = ladder.LadderState()
    actions = ladder.on_directive(state, {"kind": "shrink", "reason": "owner needs it",
                                          "deadline": 5.0})
    assert actions == [ladder.Action.EMPTY_CACHE, ladder.Action.CAP_REQUEST]
    assert state.shrinking and state.deadline == 5.0 and "owner needs it" in state.notices[0]
    after = ladder.after_cell(state, usage=10, request=5, cut_off=False)
    assert after == [ladder.Action.OFFLOAD, ladder.Action.EMPTY_CACHE, ladder.Action.CHECKPOINT]
    assert ladder.after_cell(state, usage=4, request=5, cut_off=False) == [ladder.Action.CHECKPOINT]


def test_every_completed_cell_is_checkpointed_but_not_one_a_move_cut_off() -> None:
    state = ladder.LadderState()
    assert ladder.after_cell(state, usage=None, request=None, cut_off=False) == [
        ladder.Action.CHECKPOINT]
    assert ladder.on_directive(state, {"kind": "migrate", "reason": "free GPU 1"}) == []
    assert state.moving and "free GPU 1" in state.notices[0]
    # Half a cell's effects are not a good state to come back to.
    assert ladder.after_cell(state, usage=None, request=None, cut_off=True) == []


def test_restart_messages_say_why_and_what() -> None:
    reason = kenv.RestartReason("migrated", "free GPU 1 for a job", "1", "0")
    text = messages.restore_message(
        reason, restored=["model", "opt"], lost={"gen": "TypeError: generator"},
        checkpoint_time=1000.0, checkpoint_cell=4, last_cell=6, newer_names=["late"],
        now=1030.0,
    )
    assert "moved from GPU 1 to GPU 0: free GPU 1 for a job." in text
    # UUIDs mean nothing to people; the server's own sentence names GPUs by index.
    server = kenv.RestartReason("migrated", "Moved from GPU 1 to GPU 0 to free GPU 1 for a job",
                                "GPU-5eed-1", "GPU-5eed-0")
    assert messages.restart_cause(server) == (
        "This kernel was moved from GPU 1 to GPU 0 to free GPU 1 for a job.")
    assert "GPU-5eed" not in messages.restart_cause(kenv.RestartReason("migrated", "", "GPU-5eed-1",
                                                                       "GPU-5eed-0"))
    assert "Restored 2 of 3 variables" in text and "model, opt" in text
    assert "gen (TypeError: generator)" in text and "late" in text
    cut = messages.restore_message(reason, restored=["a"], lost={}, checkpoint_time=None,
                                   interrupted_cell="[7] for epoch in range(100):")
    assert "Cell [7] for epoch in range(100): was cut off" in cut and "re-run it" in cut
    assert "ended unexpectedly" in messages.restart_cause(kenv.RestartReason("died", ""))
    assert "Cells [5] to [6] ran after the checkpoint: re-run them" in text
    one = messages.restore_message(reason, restored=["a"], lost={}, checkpoint_time=1000.0,
                                   checkpoint_cell=4, last_cell=5, now=1030.0)
    assert "Cell [5] ran after the checkpoint: re-run it if you need its effects." in one
    assert "Cells [" not in one


def test_back_on_a_gpu_is_told_in_short_sentences() -> None:
    text = messages.unparked("GPU 0", 0.81, ["a", "b"], 2**30, ["c"])
    assert text == ("gpufrac: back on GPU 0 (this cell waited under 1 s for it). 2 variables "
                    "(1.0 GiB) moved back onto it. c stays in host memory: there is no room "
                    "under the cap. `%gpu reload` moves it back once there is.")
    # Durations in one way everywhere: format_duration, never "0 s" for what took time.
    assert messages.thawed("GPU 1", 1.5, 151.0).startswith(
        "gpufrac: back on GPU 1, thawed (2 min 31 s frozen; this cell waited 2 s for it). ")
    oom = messages.restart_cause(kenv.RestartReason("oom_killed", "give 4.0 GiB back"))
    assert "reclaimer" in oom and "give 4.0 GiB back" in oom
    failed = messages.restore_message(None, restored=[], lost={}, checkpoint_time=None,
                                      error="there is no checkpoint in /x")
    assert "No variables were restored: there is no checkpoint" in failed


def test_oom_explanation_names_request_limit_and_remedies() -> None:
    text = messages.oom_explanation(request=4 * GiB, limit=8 * GiB, total=16 * GiB,
                                    reserved=7 * GiB, allocated=6 * GiB, cap=4 * GiB,
                                    shrunk=True, has_lease=True)
    assert "4.0 GiB (0.25 of the GPU)" in text and "8.0 GiB (0.5 of the GPU)" in text
    assert "%gpu request" in text and "%gpu reload" in text and "del x" in text


def test_oom_forms_and_whose_memory_ran_out() -> None:
    assert messages.oom_source(RuntimeError("CUDA error: out of memory")) == "CUDA"
    assert messages.oom_source(RuntimeError("CUDNN_STATUS_ALLOC_FAILED")) == "cuDNN"
    assert messages.oom_source(RuntimeError("index out of range")) is None
    tried = RuntimeError("CUDA out of memory. Tried to allocate 1.50 GiB (GPU 0; ...)")
    assert messages.oom_wanted(tried) == int(1.5 * GiB)
    # Its own cap: what it holds and wants is over it, whatever the GPU has free.
    own = messages.oom_cause(wanted=GiB, reserved=3 * GiB, cap=4 * GiB - 1, gpu_free=20 * GiB)
    assert own.startswith("This kernel reached its own cap")
    # Below its cap, on a GPU that others fill: each other share by its figures, not by owner.
    shares = [{"lease": "l-mine", "kind": "notebook", "request": 4 * GiB, "usage": GiB},
              {"lease": None, "kind": "notebook", "request": 4 * GiB, "usage": 10 * GiB},
              {"lease": None, "kind": "job", "request": 8 * GiB, "usage": 4 * GiB}]
    full = messages.oom_cause(wanted=GiB, reserved=GiB, cap=8 * GiB, gpu_free=100 * 2**20,
                              shares=shares, own_lease="l-mine")
    assert "The GPU itself is full (100.0 MiB free)" in full
    assert "2 other shares" in full and "6.0 GiB above it" in full and "on loan" in full
    assert "l-mine" not in full


@pytest.mark.parametrize(
    ("line", "message"),
    [
        (["request", "0.5", "extra"], "unrecognized arguments: extra"),
        (["request", "1", "--limit"], "argument --limit: expected one argument"),
        (["checkpoint", "--bogus"], "unrecognized arguments: --bogus"),
    ],
)
def test_parser_errors_are_usage_errors(line: list[str], message: str) -> None:
    with pytest.raises(UsageError, match=message):
        build_parser().parse_args(line)


def test_compute_is_shown_against_its_share_and_says_whether_it_holds() -> None:
    lease = {"compute_usage": 37, "compute_request": 0.25, "compute_limit": 0.5}
    assert messages.compute_text(lease, mps=False) == (
        "37% of the GPU's compute; share 0.25 to 0.5 of the GPU's compute "
        "(not enforced: no CUDA MPS on this node)")
    assert messages.compute_text({**lease, "compute_limit": 0.25}, mps=True).endswith(
        "share 0.25 of the GPU's compute (held by CUDA MPS)")
    assert messages.compute_text({"compute_usage": None}, mps=False) == "not sampled"


def test_no_lease_reason_is_the_servers_and_never_a_guess() -> None:
    """Only a kernel without the provisioner's environment is said not to be started by it."""
    told = kenv.parse({"GPUFRAC_KERNEL_ID": "k", "GPUFRAC_NO_LEASE_REASON": "The agent had no room."})
    assert told.no_lease_reason() == "The agent had no room."
    silent = kenv.parse({"GPUFRAC_KERNEL_ID": "k"})
    assert "did not say why" in silent.no_lease_reason()
    assert "provisioner" not in told.no_lease_reason() + silent.no_lease_reason()
    default = kenv.parse({"GPUFRAC_DEFAULT_SHARE": '{"request": "0.25", "limit": "1"}'})
    assert default.default_share == {"request": "0.25", "limit": "1"}


def test_a_resumed_notebook_is_told_from_what_and_a_manual_restore_names_no_cause() -> None:
    resumed = kenv.RestartReason(
        "resumed", "Resumed from the last checkpoint of its earlier kernel: its Jupyter server "
        "on node-a was stopped at 05:52:24; it ran on GPU 0 (Tesla T4, 15.0 GiB) there, and "
        "runs on GPU 1 (NVIDIA H100 80GB HBM3, 79.6 GiB) here.", "GPU-5eed-0", None)
    assert messages.restart_cause(resumed) == (
        "This notebook was resumed from the last checkpoint of its earlier kernel: its Jupyter "
        "server on node-a was stopped at 05:52:24; it ran on GPU 0 (Tesla T4, 15.0 GiB) there, "
        "and runs on GPU 1 (NVIDIA H100 80GB HBM3, 79.6 GiB) here.")
    # `%gpu restore` the user ran: nothing was restarted, so nothing says it was.
    manual = messages.restore_message(None, restored=[], lost={}, checkpoint_time=1000.0,
                                      checkpoint_cell=1, now=1000.0)
    assert manual.startswith("gpufrac: Restored 0 of 0 variables"), manual
    assert "restarted" not in manual


def test_env_offers_an_earlier_state_only_by_a_plain_folder_name() -> None:
    offered = kenv.parse({"GPUFRAC_RESUMABLE": json.dumps({
        "folder": "k-old", "generation": 7, "cell": 3, "time": 1000.0, "variables": 2,
        "reason": {"cause": "resumed", "message": "Resumed from …"}})})
    assert offered.resumable == kenv.Resumable(
        "k-old", kenv.RestartReason("resumed", "Resumed from …"), 7, 3, 1000.0, 2)
    hint = messages.resume_hint(offered.resumable)
    assert "holds 2 variables" in hint and "`%gpu restore` brings that state back" in hint
    for bad in ('{"folder": "../elsewhere"}', '{"folder": ".replaced-x"}', "not json", "[]"):
        parsed = kenv.parse({"GPUFRAC_RESUMABLE": bad})
        assert parsed.resumable is None and "GPUFRAC_RESUMABLE" in parsed.problems[0], bad
    # A kernel without checkpoints takes no state over.
    off = kenv.parse({"GPUFRAC_RESUMABLE": '{"folder": "k"}', "GPUFRAC_NO_CHECKPOINTS": "why"})
    assert off.resumable is None


def test_a_freeze_is_news_at_the_next_cell_in_one_sentence_each() -> None:
    """The frozen directive leaves its sentence for the next cell, however late it comes,
    without the words the kernel's own sentence says already."""
    state = ladder.LadderState()
    at = 1_700_000_000.0
    stamp = messages.clock(at)
    ladder.on_directive(state, {"kind": "frozen", "created": at, "cause": "job", "reason":
                                'frozen because job "train" needs GPU 1 whole: it thaws when '
                                "the job ends"})
    assert state.notices == [f'gpufrac: frozen in host memory at {stamp} because job "train" '
                             "needs GPU 1 whole: it thaws when the job ends."]
    assert state.frozen and state.frozen_at == at
    park = messages.frozen_news("parked at its user's request", "park", at)
    assert park.startswith(f"gpufrac: parked at {stamp}, at its user's request: frozen in host "
                           "memory, it gave its GPU back.")
    assert messages.thawed_news("GPU 0", 0.2, at) == (
        f"gpufrac: thawed at {stamp}, after being frozen for under 1 s, back on GPU 0. Nothing "
        "was restarted: every variable, open file and thread is as it was.")


def test_a_waiting_cell_says_what_it_waits_for_once() -> None:
    """The agent's reason may repeat what the sentence says ("frozen in host memory, waiting
    for a GPU: …"): said once."""
    text = messages.waiting_for_gpu("frozen in host memory, waiting for a GPU: no GPU has "
                                    "4.0 GiB free for its request", frozen=True)
    assert text.count("waiting for a GPU") == 1 and text.count("frozen in host memory") == 1
    assert text.startswith("gpufrac: waiting for a GPU (the kernel waits frozen in host memory; "
                           "nothing is lost): no GPU has 4.0 GiB free for its request. ")
