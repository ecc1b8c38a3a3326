"""Every name two processes share: kernel environment, files, restart causes, events, states."""

from __future__ import annotations

import pathlib
import sys
from collections.abc import Mapping
from types import MappingProxyType

from node_agent import words
from node_agent.caps import FRAMEWORK_CAPS

# The environment the provisioner gives a kernel; kernel/env.py parses it.
# The agent's own clients read this one too (node_agent.client.default_socket_path).
AGENT_SOCKET = "GPUFRAC_AGENT_SOCKET"
LEASE_ID = "GPUFRAC_LEASE_ID"
KERNEL_ID = "GPUFRAC_KERNEL_ID"
REQUEST = "GPUFRAC_REQUEST"
LIMIT = "GPUFRAC_LIMIT"
GPU_UUID = "GPUFRAC_GPU_UUID"
GPU_INDEX = "GPUFRAC_GPU_INDEX"
GPU_NAME = "GPUFRAC_GPU_NAME"
GPU_TOTAL = "GPUFRAC_GPU_TOTAL"
CONTEXT = "GPUFRAC_CONTEXT"
SIMULATED = "GPUFRAC_SIMULATED"
CHECKPOINT_DIR = "GPUFRAC_CHECKPOINT_DIR"
RESTORE = "GPUFRAC_RESTORE"
RESTART_REASON = "GPUFRAC_RESTART_REASON"
# "1": the kernel starts parked, its lease holding no GPU; it must not initialise CUDA until
# its next cell has a GPU again.
PARKED = "GPUFRAC_PARKED"
# Where the request and limit came from, JSON {"request": SOURCE, "limit": SOURCE or null}.
SHARE_SOURCE = "GPUFRAC_SHARE_SOURCE"
# The file holding the user's remembered %gpu request for this environment (--reset removes it).
REMEMBERED_REQUEST = "GPUFRAC_REMEMBERED_REQUEST"
# The share a new kernel gets when nothing else names one (c.GpuFrac), JSON {"request": SPEC,
# "limit": SPEC or null}: what `%gpu request --reset` leaves new notebooks with.
DEFAULT_SHARE = "GPUFRAC_DEFAULT_SHARE"
# Why the server started this kernel without a GPU lease, for people (unset with a lease).
NO_LEASE_REASON = "GPUFRAC_NO_LEASE_REASON"

# The server's own environment on Kubernetes (the pod spec sets them; docs/kubernetes.md): the
# folder of the downward API's files (annotations, name, namespace, uid), the container's name
# (KAI's per-container annotations are keyed by it), and the GPUs the container can see ("all",
# or UUIDs; unset: only those the cluster gave it).
PODINFO = "GPUFRAC_PODINFO"
CONTAINER = "GPUFRAC_CONTAINER"
REACHABLE_GPUS = "GPUFRAC_REACHABLE_GPUS"
# The node the server runs on, for people reading where a notebook ran (on Kubernetes the
# downward API's spec.nodeName); unset: the host name.
NODE_NAME = "GPUFRAC_NODE_NAME"

# Set anew by every launch and removed from the inherited environment first, so that a
# value from an earlier launch (a restore flag, an old GPU) never leaks into the next one.
# Set when the kernel must not checkpoint (its folder is not the user's alone): why, for people.
NO_CHECKPOINTS = "GPUFRAC_NO_CHECKPOINTS"
# The generation of the newest checkpoint of this kernel the server saw (an integer).
CHECKPOINT_GENERATION = "GPUFRAC_CHECKPOINT_GENERATION"
# Bytes one kernel's checkpoint, and all of the user's kernels' checkpoints, may take on disk.
CHECKPOINT_KERNEL_BUDGET = "GPUFRAC_CHECKPOINT_KERNEL_BUDGET"
CHECKPOINT_USER_BUDGET = "GPUFRAC_CHECKPOINT_USER_BUDGET"
# Bytes a snapshot may copy into memory at a cell's end (its changed tensors and arrays).
CHECKPOINT_STAGING_BUDGET = "GPUFRAC_CHECKPOINT_STAGING_BUDGET"
# The disk budgets set as shares of the space free for checkpoints, which the kernel measures
# again as the disk fills and empties: JSON such as {"kernel": 0.25, "user": 0.5}.
CHECKPOINT_DISK_SHARES = "GPUFRAC_CHECKPOINT_DISK_SHARES"
# An earlier kernel's state of this notebook that this (fresh) kernel may take over with
# `%gpu restore`, JSON {"folder": its folder in the checkpoint root, "generation": the newest
# the servers recorded, "reason": a RESTART_REASON}; unset when there is none.
RESUMABLE = "GPUFRAC_RESUMABLE"

LAUNCH_VARIABLES = (
    LEASE_ID, KERNEL_ID, REQUEST, LIMIT, GPU_UUID, GPU_INDEX, GPU_NAME, GPU_TOTAL, CONTEXT,
    SIMULATED, CHECKPOINT_DIR, RESTORE, RESTART_REASON, PARKED, SHARE_SOURCE, REMEMBERED_REQUEST,
    DEFAULT_SHARE, NO_LEASE_REASON, NO_CHECKPOINTS, CHECKPOINT_GENERATION,
    CHECKPOINT_KERNEL_BUDGET, CHECKPOINT_USER_BUDGET, CHECKPOINT_STAGING_BUDGET,
    CHECKPOINT_DISK_SHARES, RESUMABLE, *FRAMEWORK_CAPS,
)

# The IPython extension the kernel loads.
KERNEL_EXTENSION = "jupyter_gpufrac.kernel"

# The server asks a kernel over a comm of this target; the kernel answers once and closes it.
COMM_TARGET = "jupyter_gpufrac"
ASK_CHECKPOINT = "checkpoint"  # answer: {"ok": true, "checkpoint": {...}} or {"ok": false, "error"}
ASK_RESTORE_REPORT = "restore-report"  # answer: {"ok": true, "report": {...} or null}
# Move GPU tensors to host memory, then checkpoint: {"ok": true, "checkpoint": {...},
# "offloaded_bytes": n} or {"ok": false, "error"} (then nothing was moved).
ASK_PARK = "park"
ASKS = (ASK_CHECKPOINT, ASK_RESTORE_REPORT, ASK_PARK)
# The checkpoint's status (Checkpointer.status: the durable cell and time, the write in progress
# with its progress, the last error), asked on the control channel: the kernel answers it in its
# control thread, while a cell runs too. Not user activity (the server's untracked types).
CHECKPOINT_STATUS_REQUEST = "gpufrac_checkpoint_request"
CHECKPOINT_STATUS_REPLY = "gpufrac_checkpoint_reply"
# The kernel's account (server/account.py kernel_push) as the server last wrote it, in the
# kernel's checkpoint folder after each of its events: `%gpu` says what the panel says.
ACCOUNT_FILE = "account.json"
# In the server's data folder: the user's last `%gpu request` in one environment (by the
# server's sys.prefix), the share of their next kernels there: last-request-<key>.json.
LAST_REQUEST_FILE = "last-request-{environment}.json"
# In a kernel's checkpoint folder: the datagram socket its directive thread waits on. The
# server sends one datagram there when the agent addresses the kernel's lease (jupyter_gpufrac.wake).
WAKE_SOCKET = "wake.sock"
# In a kernel's checkpoint folder: whose notebook the state is (user, path), where its kernel
# ran (node, GPU, server) and how it ended, written by the server (docs/survival.md).
NOTEBOOK_RECORD = "notebook.json"
# In the checkpoint root: the user whose checkpoints it holds (a volume shared by several
# users is refused).
OWNER_FILE = "owner.json"
# In the server's runtime folder: the socket `jupyter gpufrac flush` asks to make every
# kernel's checkpoint durable (a pod's preStop hook), one per server process.
FLUSH_SOCKET = "gpufrac-flush-{pid}.sock"
# What a new kernel of a notebook does with the state an earlier kernel left (c.GpuFrac.resume).
RESUME_ALWAYS, RESUME_ASK, RESUME_NEVER = "always", "ask", "never"
RESUME_MODES = (RESUME_ALWAYS, RESUME_ASK, RESUME_NEVER)
# The directive kinds a kernel acts on itself (shrink) or tells its user of; the server wakes
# the kernel for these.
KERNEL_DIRECTIVES = ("shrink", "migrate", "killed", "frozen", "unparked", "moved")

# Where a share came from, as people read it.
SOURCE_KERNELSPEC = "kernelspec"
SOURCE_REMEMBERED = "your last %gpu request here"
SOURCE_CONFIG = "c.GpuFrac"
SOURCE_RUNAI = "RUNAI_GPU_MEMORY_LIMIT"
SOURCE_MAGIC = "%gpu request"
# Each source in the words every surface shows after "from" (`%gpu`, the panel;
# docs/glossary.md); any other source (a pod annotation, named with its key) is shown as it is.
SOURCE_WORDS = MappingProxyType({
    SOURCE_KERNELSPEC: "the kernelspec",
    SOURCE_REMEMBERED: "your request remembered here",
    SOURCE_CONFIG: "the c.GpuFrac default",
    SOURCE_RUNAI: "RUNAI_GPU_MEMORY_LIMIT",
    SOURCE_MAGIC: "%gpu request in this notebook",
})

# Why a kernel was restarted: the "cause" of RESTART_REASON.
CAUSE_MIGRATED = "migrated"
CAUSE_REQUEST_CHANGED = "request_changed"
CAUSE_OOM_KILLED = "oom_killed"
CAUSE_DIED = "died"
CAUSE_PLACED = "placed"
CAUSE_PARKED = "parked"
# A new kernel of a notebook took over the state its earlier kernel left (its server or node
# went away, or jupyter_server culled it).
CAUSE_RESUMED = "resumed"
RESTART_CAUSES = (CAUSE_MIGRATED, CAUSE_REQUEST_CHANGED, CAUSE_OOM_KILLED, CAUSE_DIED, CAUSE_PLACED,
                  CAUSE_PARKED, CAUSE_RESUMED)

# Kernel GPU events (jupyter_events), server to browser.
EVENT_SCHEMA_ID = "https://jupyter-gpufrac.github.io/events/kernel/v1"
EVENT_SCHEMA_PATH = pathlib.Path(__file__).parent / "events" / "kernel.yaml"
EVENT_KINDS = (
    "placed",
    "bursting",
    "shrink_requested",
    "move_pending",
    "migrating",
    "migrated",
    "oom_killed",
    "restored",
    "no_gpu",
    "agent_unreachable",
    "agent_reachable",
    "parked",
    "unparked",
    "frozen",
    "resumable",
)

# The one lifecycle vocabulary people see: a kernel's state in REST, the widget and the panel.
KERNEL_STATES = (
    "guaranteed",
    "bursting",
    "shrinking",
    "move-pending",
    "migrating",
    "oom-killed",
    "restored",
    "restore-incomplete",
    "no-gpu",
    "agent-unreachable",
    "parked",
    "waiting-for-gpu",
)
# Every state but these two says the agent answered about the kernel's lease.
AGENT_SILENT_STATES = ("no-gpu", "agent-unreachable")

# The agent's ledger states that a kernel shows as they are (the others need events to tell).
# A lease being frozen is on its way to parked; one being thawed has a cell waiting for it.
LEASE_STATE_SHOWN = MappingProxyType({"shrinking": "shrinking", "killed": "oom-killed",
                                      "parked": "parked", "pending": "waiting-for-gpu",
                                      "freezing": "parked", "thawing": "waiting-for-gpu"})

# How the panel words each kernel state (labextension/src/stateView.ts labels(); move-pending counts
# down instead while its deadline is known): `%gpu` says them the same way.
KERNEL_STATE_WORDS = MappingProxyType({
    "guaranteed": "guaranteed",
    "bursting": "bursting",
    "shrinking": "shrinking",
    "move-pending": "moving soon — cell still running",
    "migrating": "moving",
    "oom-killed": "stopped",
    "restored": "restored",
    "restore-incomplete": "restored in part",
    "no-gpu": "no GPU",
    "agent-unreachable": "agent unreachable",
    "parked": "parked",
    "waiting-for-gpu": "waiting for a GPU",
})

# How the panel words another lease's ledger state (a kernel's own state is a KERNEL_STATE):
# the glossary's words, as `gpufrac-agent status` says them.
LEASE_STATE_WORDS = words.LEASE_STATE_WORDS

# The state an event implies until the next status confirms it. "migrated" still reads
# migrating: a move is done only when the kernel says what came back ("restored"), and a
# "restored" event without ok=true reads RESTORE_INCOMPLETE.
EVENT_STATE = MappingProxyType({
    "placed": "guaranteed",
    "agent_reachable": "guaranteed",
    "bursting": "bursting",
    "shrink_requested": "shrinking",
    "move_pending": "move-pending",
    "migrating": "migrating",
    "migrated": "migrating",
    "oom_killed": "oom-killed",
    "restored": "restored",
    "no_gpu": "no-gpu",
    "agent_unreachable": "agent-unreachable",
    "parked": "parked",
    "unparked": "guaranteed",
    "frozen": "waiting-for-gpu",
})
RESTORE_INCOMPLETE = "restore-incomplete"

TYPESCRIPT_PATH = "labextension/src/contract.ts"


def typescript() -> str:
    """The browser's copy of the names it shares (labextension/src/contract.ts), generated."""

    def array(name: str, values: tuple[str, ...]) -> str:
        quoted = [f"'{v}'" for v in values]
        line = f"export const {name} = [{', '.join(quoted)}] as const;"
        if len(line) <= 80:  # prettier's print width: shorter arrays stay on one line
            return line
        return f"export const {name} = [\n" + ",\n".join(f"  {q}" for q in quoted) + "\n] as const;"

    def record(mapping: Mapping[str, str]) -> str:
        def key(k: str) -> str:
            return k if k.isidentifier() else f"'{k}'"

        items = ",\n".join(f"  {key(k)}: '{v}'" for k, v in mapping.items())
        return "{\n" + items + "\n}"

    return "\n".join([
        "// Generated by `python -m jupyter_gpufrac.contract` from jupyter_gpufrac/contract.py:",
        "// do not edit; tests/test_contract.py fails when the two disagree.",
        "",
        array("EVENT_KINDS", EVENT_KINDS),
        "",
        array("KERNEL_STATES", KERNEL_STATES),
        "",
        array("AGENT_SILENT_STATES", AGENT_SILENT_STATES),
        "",
        f"export const EVENT_STATE: Readonly<Record<string, string>> = {record(EVENT_STATE)};",
        "",
        "export const LEASE_STATE_WORDS: Readonly<Record<string, string>> = "
        f"{record(LEASE_STATE_WORDS)};",
        "",
        "export const KERNEL_STATE_WORDS: Readonly<Record<string, string>> = "
        f"{record(KERNEL_STATE_WORDS)};",
        "",
        f"export const SOURCE_WORDS: Readonly<Record<string, string>> = {record(SOURCE_WORDS)};",
        "",
        f"export const RESTORE_INCOMPLETE = '{RESTORE_INCOMPLETE}';",
        "",
    ])


if __name__ == "__main__":
    sys.stdout.write(typescript())
