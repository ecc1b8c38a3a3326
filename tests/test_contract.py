"""The names processes share agree everywhere: the browser's copy, the event schema, the env."""

from __future__ import annotations

from pathlib import Path

import yaml

from jupyter_gpufrac import contract
from jupyter_gpufrac.server.launch import build_kernel_env

ROOT = Path(__file__).resolve().parent.parent


def test_the_browser_copy_is_generated_from_the_contract() -> None:
    shipped = (ROOT / contract.TYPESCRIPT_PATH).read_text()
    assert shipped == contract.typescript(), (
        "labextension/src/contract.ts is stale: run "
        "`python -m jupyter_gpufrac.contract > labextension/src/contract.ts`"
    )


def test_the_event_schema_names_the_contract_id_and_every_event_kind() -> None:
    schema = yaml.safe_load(contract.EVENT_SCHEMA_PATH.read_text())
    assert schema["$id"] == contract.EVENT_SCHEMA_ID
    assert set(schema["properties"]["event"]["enum"]) == set(contract.EVENT_KINDS)


def test_every_event_state_and_lease_state_is_a_kernel_state() -> None:
    shown = set(contract.EVENT_STATE.values()) | set(contract.LEASE_STATE_SHOWN.values())
    shown |= {contract.RESTORE_INCOMPLETE, *contract.AGENT_SILENT_STATES}
    assert shown == set(contract.KERNEL_STATES)
    assert set(contract.EVENT_STATE) <= set(contract.EVENT_KINDS)


def test_a_launch_sets_only_contract_variables_and_clears_stale_ones() -> None:
    stale = {name: "stale" for name in contract.LAUNCH_VARIABLES}
    lease = {"id": "L1", "request": 1 << 30, "limit": 2 << 30, "physical_gpus": ["GPU-a"]}
    gpus = {"GPU-a": {"index": 0, "name": "A100", "memory_total": 80 << 30, "context_size": 1 << 28}}
    env = build_kernel_env(
        {"PATH": "/bin", **stale}, kernel_id="k", socket_path="/s", checkpoint_dir="/c",
        lease=lease, gpus=gpus, simulated=True, restart_reason=None, hide_gpus=False,
    )
    assert "stale" not in env.values()
    ours = {name for name in env if name.startswith("GPUFRAC_")}
    assert ours <= set(contract.LAUNCH_VARIABLES) | {contract.AGENT_SOCKET}
    assert env[contract.LEASE_ID] == "L1" and env[contract.AGENT_SOCKET] == "/s"


def test_every_ledger_state_has_words_for_people() -> None:
    from node_agent.ledger import STATES

    assert set(contract.LEASE_STATE_WORDS) == set(STATES)
    assert set(contract.LEASE_STATE_SHOWN) <= set(STATES)


def test_gpu_words_each_kernel_state_as_the_panel_does() -> None:
    """`%gpu` and the panel read one account; they must also say its state in the same words:
    the panel's labels are the generated copy of contract.KERNEL_STATE_WORDS (which
    test_the_browser_copy_is_generated_from_the_contract checks)."""
    view = (ROOT / "labextension" / "src" / "stateView.ts").read_text()
    labels = view[view.index("function labels("):view.index("function incompleteHelp(")]
    assert set(contract.KERNEL_STATE_WORDS) == set(contract.KERNEL_STATES)
    assert "Object.entries(KERNEL_STATE_WORDS)" in labels and "trans.__(word)" in labels
    assert "KERNEL_STATE_WORDS" in contract.typescript()
