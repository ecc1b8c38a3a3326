"""``%gpu`` says the server's account of the kernel once it left one, and the agent's word before."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

from harness.agent import AgentProcess
from jupyter_gpufrac import contract
from jupyter_gpufrac.kernel import store

from .kernels import running_kernel

GiB = 1024**3


def leave_account(folder: Path, account: dict[str, Any]) -> None:
    """Leave the account in the kernel's folder as the server does after each event."""
    store.write_file(folder, contract.ACCOUNT_FILE, json.dumps(account).encode(), durable=False,
                     blobs=False)


def state_lines(status: str) -> list[str]:
    return [line.strip() for line in status.splitlines()
            if line.strip().startswith(("state:", "last:"))]


def leased_kernel_env(tmp_path: Path, agent: AgentProcess) -> dict[str, str]:
    """A kernel's environment as the provisioner gives it, with a fresh lease of the agent."""
    lease = agent.client().create_lease(client="test", request="0.25", limit="0.5",
                                        kernel_id="k1")
    return {
        "GPUFRAC_LEASE_ID": lease["id"], "GPUFRAC_AGENT_SOCKET": agent.socket,
        "GPUFRAC_KERNEL_ID": "k1", "GPUFRAC_REQUEST": str(lease["request"]),
        "GPUFRAC_LIMIT": str(lease["limit"]), "GPUFRAC_GPU_UUID": lease["physical_gpu"],
        "GPUFRAC_GPU_INDEX": "0", "GPUFRAC_GPU_TOTAL": str(16 * GiB),
        "GPUFRAC_CHECKPOINT_DIR": str(tmp_path / "ck"),
    }


def test_gpu_says_the_servers_account_and_the_agents_word_without_one(
        tmp_path: Path, agent: AgentProcess) -> None:
    with running_kernel(leased_kernel_env(tmp_path, agent)) as k:
        # No server left an account (an older server, or none): the agent's word, as before.
        assert state_lines(k.run("%gpu").stdout) == ["state:   guaranteed"]

        now = time.time()
        moving = {"state": "move-pending", "reason": "To move from GPU 0 to GPU 1 once the "
                  "running cell ends.", "deadline": now + 600}
        leave_account(tmp_path / "ck", {**moving, "once_used": moving, "last_event": {
            "event": "move_pending", "message": "To move from GPU 0 to GPU 1 once the running "
            "cell ends.", "time": now - 150}})
        state, last = state_lines(k.run("%gpu").stdout)
        # The panel's words, the countdown and the age computed when shown.
        counted = re.fullmatch(r"state:   moving in (\d+) s — cell still running \(To move from "
                               r"GPU 0 to GPU 1 once the running cell ends\)", state)
        assert counted is not None and 0 < int(counted[1]) <= 600, state
        assert re.fullmatch(r"last:    \d+ min ago: To move from GPU 0 to GPU 1 once the "
                            r"running cell ends\.", last), last

        # A restore is news until the user's next cell after it, as the server reads it.
        restored = {"event": "restored", "message": "Moved; restored 2 of 2 variables.",
                    "time": time.time() - 5}
        leave_account(tmp_path / "ck", {"state": "restored", "reason": restored["message"], "deadline": None,
                         "last_event": restored, "once_used": {
                             "state": "bursting", "reason": None, "deadline": None}})
        state, last = state_lines(k.run("%gpu").stdout)
        assert state == "state:   bursting"
        assert re.fullmatch(r"last:    \d+ s ago: Moved; restored 2 of 2 variables\.", last), last


def test_an_agent_that_does_not_answer_the_kernel_outranks_an_older_account(
        tmp_path: Path, agent: AgentProcess) -> None:
    with running_kernel(leased_kernel_env(tmp_path, agent)) as k:
        leave_account(tmp_path / "ck", {"state": "guaranteed", "reason": None, "deadline": None})
        assert state_lines(k.run("%gpu").stdout) == ["state:   guaranteed"]
        # The agent dies; the server has not told of it yet (its account still says
        # guaranteed), but this kernel's own question just went unanswered.
        agent.kill()
        state = state_lines(k.run("%gpu").stdout)
        assert len(state) == 1 and state[0].startswith(
            f"state:   agent unreachable at {agent.socket}: this kernel's share cannot be "
            "verified"), state
        # Once the server's account says so too, it is the one shown, in the panel's words.
        leave_account(tmp_path / "ck", {"state": "agent-unreachable", "deadline": None,
                                        "reason": "No GPU agent answers."})
        assert state_lines(k.run("%gpu").stdout) == [
            "state:   agent unreachable (No GPU agent answers)"]
