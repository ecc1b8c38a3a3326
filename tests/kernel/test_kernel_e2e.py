"""Real ipykernels with ``--ext=jupyter_gpufrac.kernel``: magics, OOM help, checkpoint, restore."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from harness.agent import AgentProcess, wait_for
from jupyter_gpufrac import contract
from jupyter_gpufrac.kernel import store
from jupyter_gpufrac.kernel.checkpoint import Checkpointer
from jupyter_gpufrac.server.launch import build_kernel_env
from jupyter_gpufrac.wake import wake, wake_path

from .kernels import running_kernel, wait_written
from .test_directives import spread_lease

GiB = 1024**3


def test_no_lease_mode_magics_errors_and_oom_help(tmp_path: Path) -> None:
    with running_kernel({"GPUFRAC_CHECKPOINT_DIR": str(tmp_path / "ck")}) as k:
        status = k.run("%gpu")
        assert status.status == "ok"
        assert "no GPU lease" in status.stdout and "GPUFRAC_LEASE_ID is not set" in status.stdout

        bad = k.run("%gpu request abc")
        assert bad.status == "error" and "Traceback" not in bad.text
        assert "request: expected a share of one GPU: a fraction 0 < f <= 1" in bad.text
        assert "'abc'" in bad.text
        bad_limit = k.run("%gpu request 0.5 --limit lots")
        assert "limit: expected a share of one GPU" in bad_limit.text
        unknown = k.run("%gpu frobnicate")
        assert unknown.status == "error" and "unknown subcommand 'frobnicate'" in unknown.text
        no_lease = k.run("%gpu request 0.5")
        assert no_lease.status == "error" and "no GPU lease" in no_lease.text
        nothing = k.run("%gpu request")
        assert nothing.status == "error" and "give the new request" in nothing.text
        no_server = k.run("%gpu request --reset")
        assert no_server.status == "error" and "nothing is remembered for it" in no_server.text

        helped = k.run("%gpu --help")
        assert helped.status == "ok" and "request" in helped.stdout and "checkpoint" in helped.stdout
        sub_help = k.run("%gpu request --help")
        assert sub_help.status == "ok" and "--limit" in sub_help.stdout

        # torch imported mid-session is noticed (no CUDA here, so no cap to apply).
        k.run("import torch")
        assert "CUDA is not available" in k.run("%gpu").stdout
        oom = k.run('raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB")')
        assert oom.status == "error" and oom.error is not None
        assert oom.error["ename"] == "OutOfMemoryError"
        assert "ran out of the GPU memory" in oom.traceback and "del x" in oom.traceback
        # CUDA's own out-of-memory and a library's failed workspace are explained too...
        for raised, who in (
            ('RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling cublasCreate")',
             "cuBLAS"),
            ('torch.AcceleratorError("CUDA error: out of memory")', "CUDA"),
        ):
            failed = k.run(f"raise {raised}")
            assert f"gpufrac: {who} ran out of the GPU memory" in failed.traceback, failed
        # ...and any other RuntimeError is shown as IPython shows it, with nothing added.
        plain = k.run('raise RuntimeError("shape mismatch")')
        assert plain.error is not None and plain.error["ename"] == "RuntimeError"
        assert "shape mismatch" in plain.traceback and "gpufrac" not in plain.traceback

        # The silent checkpoint the server runs before a migration prints nothing.
        assert "torch" in k.value("__import__('jupyter_gpufrac.kernel', fromlist=['x'])"
                                  ".checkpoint_now()['modules']")
        quiet = k.run("%gpu checkpoint --quiet", silent=True)
        assert quiet.status == "ok" and quiet.stdout == ""
        assert (tmp_path / "ck" / store.STATE_FILE).exists()

        assert "no GPU memory to release" in k.run("%gpu release").stdout
        assert "nothing is offloaded" in k.run("%gpu reload").stdout
        # Every completed cell is checkpointed: a restore goes back to the last one.
        k.run("keep = {'n': 1}")
        restored = k.run("keep['n'] = 99\nlater = 1\n%gpu restore")
        assert restored.status == "ok" and "Restored" in restored.stdout
        assert k.value("keep") == {"n": 1}

        assert k.run("%unload_ext jupyter_gpufrac.kernel").status == "ok"
        assert k.run("%gpu").status == "error"
        assert k.run("%load_ext jupyter_gpufrac.kernel").status == "ok"
        assert "no GPU lease" in k.run("%gpu").stdout


CELL_STATE = """
import torch, threading
torch.manual_seed(0)
class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 2)
    def forward(self, x):
        return self.fc(x)
model = Net()
opt = torch.optim.SGD(model.parameters(), lr=0.5)
double = lambda v: 2 * v
items = [1, 2, 3]
same_items = items
gen = (i for i in range(3))
weights_before = model.fc.weight.detach().clone()
"""


def test_lease_resize_migrate_and_restore_in_a_new_kernel(tmp_path: Path, agent: AgentProcess) -> None:
    client = agent.client()
    lease = spread_lease(client)
    ckdir = tmp_path / "ck"
    env = {
        "GPUFRAC_LEASE_ID": lease["id"], "GPUFRAC_AGENT_SOCKET": agent.socket,
        "GPUFRAC_KERNEL_ID": "k-e2e", "GPUFRAC_REQUEST": str(lease["request"]),
        "GPUFRAC_LIMIT": str(lease["limit"]), "GPUFRAC_GPU_UUID": lease["physical_gpu"],
        "GPUFRAC_GPU_INDEX": "1", "GPUFRAC_GPU_NAME": "GPU 16GiB (simulated)",
        "GPUFRAC_GPU_TOTAL": str(16 * GiB), "GPUFRAC_SIMULATED": "1",
        "GPUFRAC_CHECKPOINT_DIR": str(ckdir),
    }
    with running_kernel(env) as k:
        status = k.run("%gpu").stdout
        # The GPU as the panel names it; "simulated" once.
        assert status.splitlines()[0] == ("gpufrac: this kernel's share of GPU 1 (GPU 16GiB, "
                                          "simulated)"), status
        # Ids are for scripts: neither the lease's nor the GPU's UUID.
        assert lease["id"] not in status and lease["physical_gpu"] not in status
        assert "12.0 GiB (0.75 of the GPU)" in status
        assert "<- this kernel" in status  # the node's GPUs, from the agent
        inverted = k.run("%gpu request 0.9 --limit 0.5")
        assert inverted.status == "error"
        assert "limit: 0.5 (8.0 GiB here) is below the request, 0.9" in inverted.text
        resized = k.run("%gpu request 0.5 --limit 0.8")
        assert resized.status == "ok", resized.text
        assert "now 0.5 of GPU 1: 8.0 GiB guaranteed, up to 12.8 GiB." in resized.stdout
        assert "kept for new notebooks" not in resized.stdout.lower()  # no server keeps it

        assert k.run(CELL_STATE).status == "ok"
        # A job needs a whole GPU: the agent compacts this spread kernel back (migrate). The
        # hook, woken as the server would wake it, hears it while idle, says so with the next
        # cell and checkpoints after it.
        client.create_lease(client="job", kind="job", request="1")
        assert wake(wake_path(ckdir))
        seen = ""
        deadline = time.monotonic() + 15
        while "this kernel is being moved" not in seen:
            assert time.monotonic() < deadline, f"no migrate notice in {seen!r}"
            seen += k.run("late = 1").stdout  # also: defined after the checkpoint
        wait_written(k)  # the checkpoint after that cell is written in the background
        names = k.value("__import__('jupyter_gpufrac.kernel', fromlist=['x'])"
                        ".summary()['last_checkpoint']['names']")
        assert {"model", "opt", "double", "Net", "items", "late"} <= set(names)
        assert k.run("later = 2").status == "ok"  # a completed cell: in the last good checkpoint
        wait_written(k)  # written in the background: the kill below must not come first

    reason = {"cause": "migrated", "message": "free GPU 1 for a job",
              "from_gpu": "GPU 1", "to_gpu": "GPU 0"}
    env.update(GPUFRAC_RESTORE="1", GPUFRAC_RESTART_REASON=json.dumps(reason))
    with running_kernel(env) as k:
        first = k.run("print('hello')")
        assert first.status == "ok"
        assert "This kernel was moved from GPU 1 to GPU 0: free GPU 1 for a job." in first.stdout
        assert "Restored" in first.stdout and "gen (TypeError" in first.stdout
        assert first.stdout.rstrip().endswith("hello")
        assert "Restored" not in k.run("print('again')").stdout  # shown once

        assert k.value("double(21)") == 42
        assert k.value("items is same_items") is True
        assert k.value("isinstance(model, Net)") is True
        assert k.value("'gen' in globals()") is False and k.value("later") == 2
        assert k.value("torch.equal(model.fc.weight, weights_before)") is True
        stepped = k.run("model(torch.ones(3, 4)).sum().backward(); opt.step()\n"
                        "print(torch.equal(model.fc.weight, weights_before))")
        assert stepped.stdout.strip() == "False"  # the optimizer drives the restored model
        assert "last restore:" in k.run("%gpu").stdout
        answer = k.ask(contract.ASK_RESTORE_REPORT)

    assert answer["ok"] is True
    report = answer["report"]
    # One variable could not be saved: the report does not call the restore a success.
    assert report["ok"] is False and report["error"] is None and report["cause"] == "migrated"
    assert {"model", "opt", "torch", "late", "later"} <= set(report["restored"])
    assert report["lost"] == ["gen"] and report["newer_names"] == []
    assert report["checkpoint_time"] > 0 and "Restored" in report["message"]


def test_restore_without_a_checkpoint_says_so(tmp_path: Path) -> None:
    env = {"GPUFRAC_CHECKPOINT_DIR": str(tmp_path / "ck"), "GPUFRAC_RESTORE": "1",
           "GPUFRAC_RESTART_REASON": json.dumps({"cause": "oom_killed",
                                                 "message": "gave 4.0 GiB back to a notebook"})}
    with running_kernel(env) as k:
        first = k.run("1 + 1")
        assert "stopped by the GPU memory reclaimer" in first.stdout
        assert "No variables were restored: there is no checkpoint" in first.stdout
        report = k.ask(contract.ASK_RESTORE_REPORT)["report"]
    assert not report["ok"] and report["cause"] == "oom_killed"
    assert "there is no checkpoint" in report["error"]


def test_the_kernel_answers_the_servers_questions_once_each(tmp_path: Path) -> None:
    """Checkpoint and restore report over the comm; a question it does not know names the rest."""
    ckdir = tmp_path / "ck"
    with running_kernel({"GPUFRAC_CHECKPOINT_DIR": str(ckdir)}) as k:
        k.run("x = 41")
        answer = k.ask(contract.ASK_CHECKPOINT)
        assert answer["ok"] is True and answer["checkpoint"]["names"] == ["x"], answer
        assert k.ask(contract.ASK_RESTORE_REPORT) == {"ok": True, "report": None}
        wrong = k.ask("reboot")
        assert wrong["ok"] is False and "checkpoint, restore-report" in wrong["error"]
        # The kernel never closes the comms: a close would reach every open notebook page.
        broadcast = []
        with contextlib.suppress(queue.Empty):
            while True:
                broadcast.append(k.client.get_iopub_msg(timeout=0.5)["msg_type"])
        assert "comm_close" not in broadcast, broadcast
        # A question is not a cell: no execution count, no history.
        assert k.value("len(In)") == 3 and k.value("x") == 41  # "", "x = 41", this one
    header = Checkpointer(ckdir).read_header()  # what the ask saved is the last good state
    assert header is not None and "x" in json.dumps(header)


OWNER = """
import sys
print("ready", flush=True)
sys.stdin.readline()
held = b"x" * (450 * 2**20)  # touched pages: resident memory the simulated GPU counts
print("allocated", flush=True)
sys.stdin.readline()
"""


def test_bursting_kernel_checkpoints_and_hears_shrink(tmp_path: Path) -> None:
    agent = AgentProcess(tmp_path / "agent", "1x1GiB",
                         ["--log-level", "warning", "--poll-interval", "0.2", "--reclaim-grace", "300"])
    agent.start()
    owner: subprocess.Popen[str] | None = None
    try:
        client = agent.client()
        lease = client.create_lease(client="test", request="0.25", limit="1", kernel_id="kb")
        ckdir = tmp_path / "ck"
        env = {"GPUFRAC_LEASE_ID": lease["id"], "GPUFRAC_AGENT_SOCKET": agent.socket,
               "GPUFRAC_REQUEST": str(lease["request"]), "GPUFRAC_LIMIT": str(lease["limit"]),
               "GPUFRAC_GPU_TOTAL": str(GiB), "GPUFRAC_GPU_UUID": lease["physical_gpu"],
               "GPUFRAC_CHECKPOINT_DIR": str(ckdir)}
        with running_kernel(env) as k:
            assert k.run("import torch").status == "ok"
            client.register_pid(lease["id"], k.pid)  # after torch: its import is baseline
            assert k.run("big = torch.ones(600 * 2**20 // 4)").status == "ok"
            wait_for(lambda: client.lease(lease["id"])["bursting"], 15, "the agent to see a burst")
            assert k.run("x = 1").status == "ok"  # after this cell: bursting -> checkpoint
            # Written in the background: the cell's reply does not wait for it.
            wait_for(lambda: "big" in ((Checkpointer(ckdir).read_header() or {}).get("names")
                                       or []), 15, "the checkpoint to be written")

            owner = subprocess.Popen([sys.executable, "-c", OWNER], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
            assert owner.stdin is not None and owner.stdout is not None
            assert owner.stdout.readline().strip() == "ready"
            other = client.create_lease(client="test", request="0.5", kernel_id="owner")
            client.register_pid(other["id"], owner.pid)
            owner.stdin.write("go\n")
            owner.stdin.flush()
            assert owner.stdout.readline().strip() == "allocated"
            wait_for(lambda: client.lease(lease["id"])["state"] == "shrinking", 15,
                     "the agent to reclaim the loan")
            # As the server does when its long-poll hears the shrink: wake the kernel's thread.
            assert wake(wake_path(ckdir)), "the kernel listens on its wake socket"
            seen = ""
            deadline = time.monotonic() + 15
            while "needs the GPU memory lent to this kernel back" not in seen:
                assert time.monotonic() < deadline, f"no shrink notice in {seen!r}"
                seen += k.run("pass").stdout
            assert "shrinking" in k.run("%gpu").stdout

            owner.kill()  # the owner is done: the reclaim ends and the loan may be used again
            owner.wait()
            wait_for(lambda: client.lease(lease["id"])["state"] == "active", 15,
                     "the reclaim to end")
            seen = ""
            deadline = time.monotonic() + 15
            while "no longer needs the memory lent" not in seen:
                assert time.monotonic() < deadline, f"no end-of-shrink notice in {seen!r}"
                seen += k.run("pass").stdout
            assert "shrinking" not in k.run("%gpu").stdout
    finally:
        if owner is not None:
            owner.kill()
            owner.wait()
        agent.stop()


# Stands in for TensorFlow's config API (not installed here): it records what it was told.
FAKE_TENSORFLOW = '''
import types
calls = []
class _Gpu:
    def __init__(self, name):
        self.name = name
class LogicalDeviceConfiguration:
    def __init__(self, memory_limit=None):
        self.memory_limit = memory_limit
def _list(kind):
    return [_Gpu("/physical_device:GPU:0")] if kind == "GPU" else []
def _set(device, configs):
    calls.append((device.name, [c.memory_limit for c in configs]))
config = types.SimpleNamespace(list_physical_devices=_list,
                               set_logical_device_configuration=_set,
                               LogicalDeviceConfiguration=LogicalDeviceConfiguration)
'''


def test_other_frameworks_are_capped_at_the_limit_less_the_context(tmp_path: Path) -> None:
    fake = tmp_path / "site"
    (fake / "tensorflow").mkdir(parents=True)
    (fake / "tensorflow" / "__init__.py").write_text(FAKE_TENSORFLOW)
    limit, context = 3 * GiB, 500 * 2**20
    lease = {"id": "l-tf", "request": GiB, "limit": limit, "physical_gpus": ["GPU-x"]}
    gpus = {"GPU-x": {"index": 0, "memory_total": 16 * GiB, "context_size": context}}
    env = build_kernel_env({}, kernel_id="k", socket_path=str(tmp_path / "none.sock"),
                           checkpoint_dir=str(tmp_path / "ck"), lease=lease, gpus=gpus,
                           simulated=False, restart_reason=None, hide_gpus=False)
    # The environment caps JAX, CuPy and MPS clients from the start.
    assert env["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false"
    assert env["XLA_PYTHON_CLIENT_MEM_FRACTION"] == f"{(limit - context) / (16 * GiB):.4f}"
    assert env["CUPY_GPU_MEMORY_LIMIT"] == str(limit - context)
    assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=3072M"
    kept = {k: env[k] for k in env if k.startswith(("GPUFRAC_", "XLA_", "CUPY_", "TF_", "CUDA_"))}
    with running_kernel({**kept, "PYTHONPATH": str(fake),
                         "PYTORCH_NO_CUDA_MEMORY_CACHING": "1"}) as k:
        # TensorFlow, imported by a cell, is capped before it can touch the GPU.
        assert k.run("import tensorflow").status == "ok"
        assert k.value("tensorflow.calls") == [
            ("/physical_device:GPU:0", [(limit - context) // 2**20])]
        # A bypass of the PyTorch cap is named where the user looks.
        assert "PYTORCH_NO_CUDA_MEMORY_CACHING is set" in k.run("%gpu").stdout


def test_checkpoints_reach_the_agents_metrics_by_trigger(tmp_path: Path) -> None:
    """After each cell, when the server asks and by %gpu checkpoint: timed and sized in the
    agent's /metrics, without the cell waiting for the agent."""
    with AgentProcess(tmp_path / "agent", "1x1GiB", ["--log-level", "warning"]) as agent:
        client = agent.client()
        lease = client.create_lease(client="test", request="0.25", kernel_id="km")
        env = {"GPUFRAC_LEASE_ID": lease["id"], "GPUFRAC_AGENT_SOCKET": agent.socket,
               "GPUFRAC_REQUEST": str(lease["request"]), "GPUFRAC_LIMIT": str(lease["limit"]),
               "GPUFRAC_GPU_TOTAL": str(GiB), "GPUFRAC_GPU_UUID": lease["physical_gpu"],
               "GPUFRAC_CHECKPOINT_DIR": str(tmp_path / "ck")}

        def count(trigger: str) -> float:
            found = [s.value for f in text_string_to_metric_families(client.metrics())
                     for s in f.samples
                     if s.name == "gpufrac_checkpoint_duration_seconds_count"
                     and s.labels["trigger"] == trigger]
            return found[0]

        with running_kernel(env) as k:
            assert k.run("data = list(range(100_000))").status == "ok"
            assert k.run("import os\nmore = os.urandom(2**20)").status == "ok"
            assert k.ask(contract.ASK_CHECKPOINT)["ok"] is True
            assert k.run("%gpu checkpoint").status == "ok"
            # The one at start, one after each of the three cells (the magic's cell too).
            wait_for(lambda: count("cell") >= 4, 15, "after-cell checkpoints in /metrics")
            wait_for(lambda: count("server") == 1 and count("manual") == 1, 15,
                     "the asked and the manual checkpoint in /metrics")
            assert count("park") == 0
            samples = {(s.name, s.labels.get("trigger"), s.labels.get("le")): s.value
                       for f in text_string_to_metric_families(client.metrics())
                       for s in f.samples}
            # 1 MiB of random bytes cannot be compressed: written once, by a cell checkpoint.
            assert samples[("gpufrac_checkpoint_size_bytes_bucket", "manual", "+Inf")] == 1
            assert samples[("gpufrac_checkpoint_written_bytes_total", "cell", None)] >= 2**20


def test_a_checkpoint_asked_before_the_first_cell_keeps_the_restored_generators(
        tmp_path: Path) -> None:
    """Start-up code that draws from ``random`` after the restore (an IPython startup file runs
    after the extension) must not reach a checkpoint the server asks for before the next cell:
    the kernel restored after that one draws what an undisturbed kernel would."""
    ckdir = tmp_path / "ck"
    with running_kernel({"GPUFRAC_CHECKPOINT_DIR": str(ckdir)}) as k:
        assert k.run("import random\nrandom.seed(7)\nfirst = random.random()").status == "ok"
        wait_written(k)  # written in the background: the kill at the end must not come first
    undisturbed = random.Random(7)
    undisturbed.random()
    expected = undisturbed.random()

    startup = tmp_path / "ipython" / "profile_default" / "startup"
    startup.mkdir(parents=True)
    (startup / "00-draw.py").write_text("import random as _r\nfor _ in range(3):\n    _r.random()\n")
    restoring = {"GPUFRAC_CHECKPOINT_DIR": str(ckdir), "GPUFRAC_RESTORE": "1",
                 "GPUFRAC_RESTART_REASON": json.dumps({"cause": "migrated", "message": "test"})}
    with running_kernel({**restoring, "IPYTHONDIR": str(tmp_path / "ipython")}) as k:
        assert k.ask(contract.ASK_CHECKPOINT)["ok"] is True  # before any cell, as before a move
    with running_kernel(restoring) as k:
        assert k.value("random.random()") == expected


def test_a_restored_kernel_goes_on_numbering_its_cells_with_their_history(
        tmp_path: Path) -> None:
    """Killed while a cell runs, then restored: the next cell is the one after it, ``In`` holds
    the old sources (the cut-off cell's too), ``Out`` the outputs that can be restored."""
    ckdir = tmp_path / "ck"
    with running_kernel({"GPUFRAC_CHECKPOINT_DIR": str(ckdir)}) as k:
        assert k.run("x = 6 * 7\nx").execution_count == 1
        assert k.run("items = [1, 2]\nitems").execution_count == 2
        assert k.run("'seven'").execution_count == 3
        wait_written(k)  # silent: not a cell of its own
        k.client.execute("import time\ntime.sleep(120)")

        def running() -> object:
            with contextlib.suppress(OSError, ValueError):
                return json.loads(store.read_file(ckdir, store.CELLS_FILE)).get("running")
            return None

        wait_for(lambda: isinstance(running(), dict), 30, "cell [4] running in cells.json")
        os.kill(k.pid, signal.SIGKILL)
    restoring = {"GPUFRAC_CHECKPOINT_DIR": str(ckdir), "GPUFRAC_RESTORE": "1",
                 "GPUFRAC_RESTART_REASON": json.dumps({"cause": "died", "message": "killed"})}
    with running_kernel(restoring) as k:
        first = k.run("print(len(In), repr(In[4]), repr(_i4), repr(_i))")
        assert first.execution_count == 5, first.text
        assert "Cell [4] import time was cut off" in first.stdout, first.stdout
        assert "ran after the checkpoint" not in first.stdout  # [4] was cut off, not run
        assert first.stdout.rstrip().endswith(
            "6 'import time\\ntime.sleep(120)' 'import time\\ntime.sleep(120)' "
            "'import time\\ntime.sleep(120)'")
        assert k.value("In[1]") == "x = 6 * 7\nx"
        assert k.value("(Out[1], Out[3], _1, _, __)") == (42, "seven", 42, "seven", [1, 2])
        assert k.value("Out[2] is items and _oh is Out") is True
        assert k.run("x + 1").execution_count == 9
        assert k.value("_9") == 43


def test_a_restore_is_told_at_the_next_cell_however_late_once_with_its_ages_when_shown(
        tmp_path: Path) -> None:
    """Someone back from coffee reads at their first cell that the kernel was moved and
    restarted, and what came back, with its ages counted as it is shown; once."""
    ckdir = tmp_path / "ck"
    with running_kernel({"GPUFRAC_CHECKPOINT_DIR": str(ckdir)}) as k:
        assert k.run("a = 1").status == "ok"
        wait_written(k)
    restoring = {"GPUFRAC_CHECKPOINT_DIR": str(ckdir), "GPUFRAC_RESTORE": "1",
                 "GPUFRAC_RESTART_REASON": json.dumps({"cause": "migrated", "message": "test"})}
    with running_kernel(restoring) as k:
        # As if the first cell came two hours after the restore (of a checkpoint as old).
        shift = ("r = __import__('jupyter_gpufrac.kernel', fromlist=['x'])._hook.restore_report\n"
                 "r['time'] -= 7200\nr['checkpoint_time'] -= 7200")
        assert k.run(shift, silent=True).status == "ok"
        first = k.run("print('hello')")
        assert first.stdout.startswith("gpufrac: This kernel was moved: test.\ngpufrac: Restored "
                                       "1 of 1 variable from the checkpoint taken at"), first.stdout
        assert "(2.0 h ago, after cell [1]): a.\n" in first.stdout, first.stdout
        assert first.stdout.endswith("hello\n"), first.stdout
        assert k.run("print('again')").stdout == "again\n"
        status = k.run("%gpu").stdout
        assert "Restored 1 of 1 variable from the checkpoint taken at" in status, status
        assert "(2.0 h ago, after cell [1]): a." in status, status
