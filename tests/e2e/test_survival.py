"""The notebook survives what happens to its process: kills, repeated restores, a lost agent."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from harness.agent import AgentProcess, wait_for
from harness.jupyter import Server, running_server

pytestmark = pytest.mark.e2e

FAST = (
    "c.GpuFrac.migrate_grace_period = 3\n"
    "c.GpuFrac.lease_poll_interval = 0.5\n"
    "c.GpuFrac.agent_check_interval = 0.5\n"
)

STATE = """
import random
random.seed(5)
shared = [1, 2]
box = {"a": shared, "b": shared}
class Counter:
    def __init__(self):
        self.n = 0
    def bump(self):
        self.n += 1
        return self.n
counter = Counter()
counter.bump()
twice = lambda v: 2 * v
"""

CHECK = """
assert box["a"] is box["b"] is shared and shared == [1, 2], "aliases"
assert isinstance(counter, Counter) and counter.n == 1, "cell class and its instance"
assert twice(21) == 42, "cell lambda"
print("DRAW", random.random())
"""


def restores(server: Server, kernel_id: str) -> list[dict[str, Any]]:
    return [e for e in server.kernel_status(kernel_id)["events"] if e["event"] == "restored"]


def kernel_pid(nb: Any) -> int:
    return int(nb.ok("import os\nprint(os.getpid())").strip().splitlines()[-1])


def draw(output: str) -> float:
    return float(next(line.split()[1] for line in output.splitlines() if line.startswith("DRAW ")))


def test_killed_twice_comes_back_whole_both_times(tmp_path: Path) -> None:
    """Restored variables are the user's: the second restore brings back all of the first."""
    expected = random.Random(5)
    with AgentProcess(tmp_path / "agent", "2x2GiB", ["--poll-interval", "0.2"]) as agent, \
            running_server(tmp_path / "server", agent.socket, FAST) as server:
        nb = server.open_notebook("killed.ipynb")
        nb.ok(STATE)
        for round_ in (1, 2):
            pid = kernel_pid(nb)
            last = nb.run("'the last cell before the kill'").execution_count
            assert isinstance(last, int)
            os.kill(pid, signal.SIGKILL)
            wait_for(lambda n=round_: len(restores(server, nb.kernel_id)) >= n, 60,
                     f"restore {round_} after SIGKILL", interval=0.2)
            event = restores(server, nb.kernel_id)[-1]
            assert event["ok"] is True, event
            assert {"shared", "box", "Counter", "counter", "twice", "random"} <= set(event["restored"])
            assert server.kernel_status(nb.kernel_id)["state"] == "restored"
            # The notebook's cell numbers go on, with the history behind them.
            reply = nb.run(CHECK + "print('BEFORE', In[-2], Out[len(In) - 2])")
            assert reply.status == "ok", reply.error
            assert reply.execution_count == last + 1, (reply.execution_count, last)
            output = reply.stdout
            assert "BEFORE 'the last cell before the kill' the last cell before the kill" \
                in output, output
            assert kernel_pid(nb) != pid
            # The generator continues where it was: the same draws as a kernel never killed.
            assert draw(output) == expected.random(), output
        assert "ended unexpectedly" in nb.ok("%gpu")
        who = nb.ok("%who")
        assert "shared" in who and "counter" in who, who
        nb.close()


def test_killed_again_and_again_right_after_each_restore_keeps_its_kernel(tmp_path: Path) -> None:
    """jupyter_client removes a kernel that dies 5 times in a row within seconds of starting:
    a kernel that restored its variables did start, so kills in quick succession (reclaims,
    OOMs, an impatient user) never cost the notebook its kernel."""
    with AgentProcess(tmp_path / "agent", "2x2GiB", ["--poll-interval", "0.2"]) as agent, \
            running_server(tmp_path / "server", agent.socket, FAST) as server:
        nb = server.open_notebook("killed.ipynb")
        nb.ok("kept = list(range(5))")
        pid = kernel_pid(nb)
        for round_ in range(1, 8):
            os.kill(pid, signal.SIGKILL)
            wait_for(lambda n=round_: len(restores(server, nb.kernel_id)) >= n, 60,
                     f"restore {round_} after SIGKILL", interval=0.05)
            assert restores(server, nb.kernel_id)[-1]["ok"] is True
            # Killed again at once (no cell run first), before the restarter looks again.
            pid = int(server.kernel_status(nb.kernel_id)["lease"]["pids"][0])
        assert nb.ok("print(kept)").strip().endswith("[0, 1, 2, 3, 4]")
        nb.close()


def test_a_killed_kernel_restarts_when_its_process_exits_not_at_the_restarters_next_look(
    tmp_path: Path,
) -> None:
    """jupyter_client's restarter looks every ``time_to_dead`` seconds (3 by default): the
    server has it look as soon as the kernel's process exits, so a restore starts at once."""
    slow_looks = FAST + "c.KernelRestarter.time_to_dead = 600\n"
    with AgentProcess(tmp_path / "agent", "2x2GiB", ["--poll-interval", "0.2"]) as agent, \
            running_server(tmp_path / "server", agent.socket, slow_looks) as server:
        nb = server.open_notebook("killed.ipynb")
        nb.ok("kept = [1, 2, 3]")
        pid = kernel_pid(nb)
        os.kill(pid, signal.SIGKILL)
        # Well within the 600 s after which the restarter would have looked.
        wait_for(lambda: restores(server, nb.kernel_id), 120, "the restore after SIGKILL",
                 interval=0.2)
        assert restores(server, nb.kernel_id)[-1]["ok"] is True
        assert nb.ok("print(kept)").strip().endswith("[1, 2, 3]")
        assert kernel_pid(nb) != pid
        # A restart the user asks for is not a death: it restarts once, without a restore.
        status, _ = server.api(f"/api/kernels/{nb.kernel_id}/restart", "POST")
        assert status == 200
        assert nb.ok("print('kept' in globals())").strip().endswith("False")
        assert len(restores(server, nb.kernel_id)) == 1
        nb.close()


def whole_gpu_job(agent: AgentProcess) -> subprocess.Popen[str]:
    """A one-GPU job on a node of two GPUs that each run a notebook: one of them must move."""
    return subprocess.Popen(
        [sys.executable, "-m", "node_agent", "--socket", agent.socket, "run", "--gpus", "1",
         "--timeout", "120", "--", "sleep", "1"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )


def test_cell_cut_off_by_a_move_ends_and_is_named(tmp_path: Path) -> None:
    with AgentProcess(tmp_path / "agent", "2x2GiB", ["--poll-interval", "0.2",
                                                       "--migrate-grace", "90"]) as agent, \
            running_server(tmp_path / "server", agent.socket, FAST) as server:
        stay = server.open_notebook("stay.ipynb")
        nb = server.open_notebook("busy.ipynb")
        gpu = server.kernel_status(nb.kernel_id)["gpu"]["uuid"]
        # No explicit checkpoint: every completed cell leaves one.
        nb.ok("saved = 'before'")
        cell = nb.send("unsaved = 'after'\nimport time\ntime.sleep(600)")
        job = whole_gpu_job(agent)
        try:
            pending = wait_for(
                lambda: (s := server.kernel_status(nb.kernel_id))["state"] == "move-pending" and s,
                30, "a countdown while the cell runs", interval=0.1,
            )
            assert pending["deadline"] > time.time() and pending["gpu"]["uuid"] == gpu
            # Said in the future tense, with a clock time that stays true (no frozen "in 30 s").
            said = pending["reason"]
            assert said.startswith("To move from GPU ") and " to free GPU " in said, said
            assert "moved from" not in said and " s (" not in said, said
            assert "once the running cell ends. If it has not ended by " in said, said
            # The cut-off cell gets its reply: the page shows no [*] forever.
            reply = nb.wait(cell, timeout=60)
            assert reply.status == "error", reply
            # Why first, then where the cell was: never a bare traceback before the reason.
            assert reply.traceback[0].startswith(
                "gpufrac: cell [2] unsaved = 'after' was cut off because this kernel is moving "
                "to another GPU"), reply.traceback
            event = wait_for(lambda: (r := restores(server, nb.kernel_id)) and r[-1], 90,
                             "the move to finish", interval=0.2)
            assert job.wait(60) == 0
        finally:
            if job.poll() is None:
                job.kill()
        kinds = server.events(nb.kernel_id)
        assert kinds.index("move_pending") < kinds.index("migrating") < kinds.index("restored")
        assert event["ok"] is False and event["interrupted_cell"].startswith("[2] unsaved = 'after'")
        assert "re-run" in event["message"] and event.get("notebook") == "busy.ipynb"
        status = server.kernel_status(nb.kernel_id)
        assert status["state"] == "restore-incomplete" and status["gpu"]["uuid"] != gpu
        assert status["restore"]["interrupted_cell"] == event["interrupted_cell"]
        output = nb.ok("print(saved, 'unsaved' in globals())")
        assert "before False" in output and "was cut off" in output
        stay.close()
        nb.close()


def test_shut_down_by_its_user_during_a_moves_countdown_it_stays_shut_down(
        tmp_path: Path) -> None:
    """The user's shutdown wins over a move waiting for the running cell: the move does not
    restart the kernel, and the notebook's next kernel starts fresh, as after any shutdown."""
    with AgentProcess(tmp_path / "agent", "2x2GiB", ["--poll-interval", "0.2",
                                                       "--migrate-grace", "90"]) as agent, \
            running_server(tmp_path / "server", agent.socket,
                           FAST + "c.GpuFrac.migrate_grace_period = 60\n") as server:
        stay = server.open_notebook("stay.ipynb")
        nb = server.open_notebook("busy.ipynb")
        nb.ok("saved = 'before'")
        nb.send("import time\ntime.sleep(600)")
        job = whole_gpu_job(agent)
        try:
            wait_for(lambda: server.kernel_status(nb.kernel_id)["state"] == "move-pending", 30,
                     "a countdown while the cell runs", interval=0.1)
            sessions = server.get("/api/sessions")
            session = next(s for s in sessions if s["kernel"]["id"] == nb.kernel_id)
            nb.close()
            assert server.api(f"/api/sessions/{session['id']}", "DELETE")[0] == 204
            # The move's end is the job's start: the kernel's GPU is freed by its shutdown.
            assert job.wait(60) == 0, job.stderr.read() if job.stderr else ""
        finally:
            if job.poll() is None:
                job.kill()
        # The move's waiting ends with the shutdown, not with the grace period (a minute).
        wait_for(lambda: f"kernel {nb.kernel_id}: shut down by its user while a move waited"
                 in server.log_text(), 10, "the move to see the shutdown", interval=0.1)
        log = server.log_text()
        assert f"kernel {nb.kernel_id}: restarting" not in log, log
        assert f"gpufrac event migrating for kernel {nb.kernel_id}" not in log, log
        assert server.api(f"/api/kernels/{nb.kernel_id}")[0] == 404
        fresh = server.open_notebook("busy.ipynb")
        assert fresh.ok("print('saved' in globals())").strip().endswith("False")
        assert "restored" not in server.events(fresh.kernel_id)
        fresh.close()
        stay.close()


def test_lost_agent_is_said_and_a_fresh_agent_gets_the_lease_back(tmp_path: Path) -> None:
    agent = AgentProcess(tmp_path / "agent", "2x2GiB", ["--poll-interval", "0.2"]).start()
    try:
        with running_server(tmp_path / "server", agent.socket,
                            FAST + "c.GpuFrac.embedded_agent = False\n") as server:
            nb = server.open_notebook("n.ipynb")
            nb.ok("x = 1")
            before = server.kernel_status(nb.kernel_id)
            assert before["state"] == "guaranteed"
            agent.kill()
            lost_at = time.monotonic()
            status = wait_for(
                lambda: (s := server.kernel_status(nb.kernel_id))["state"] == "agent-unreachable"
                and s, 5, "the widget's state to say the agent is unreachable", interval=0.1,
            )
            assert time.monotonic() - lost_at <= 5
            assert f"gpufrac-agent serve --socket {agent.socket}" in status["reason"], status
            assert "agent unreachable" in nb.ok("%gpu")
            wait_for(lambda: "agent_unreachable" in server.events(nb.kernel_id), 5,
                     "the agent_unreachable event", interval=0.1)
            # A fresh agent with another state directory knows no leases: the server registers
            # the kernel's again, on the GPU where it runs.
            fresh = AgentProcess(tmp_path / "fresh", "2x2GiB", ["--poll-interval", "0.2"])
            with contextlib.suppress(FileNotFoundError):
                os.unlink(agent.socket)
            fresh.socket = agent.socket
            fresh.start()
            try:
                status = wait_for(
                    lambda: (s := server.kernel_status(nb.kernel_id))["state"] == "guaranteed" and s,
                    30, "the lease to be registered again", interval=0.2,
                )
                leases = fresh.client().leases()
                assert [lease["kernel_id"] for lease in leases] == [nb.kernel_id]
                assert leases[0]["pids"] == [kernel_pid(nb)]
                assert status["gpu"]["uuid"] == before["gpu"]["uuid"]
                assert nb.ok("print(x)").strip().endswith("1")
            finally:
                fresh.stop()
            nb.close()
    finally:
        agent.stop()


def test_embedded_agent_is_restarted_with_its_leases(tmp_path: Path) -> None:
    sock = str(tmp_path / "run" / "agent.sock")
    config = (FAST + 'c.GpuFrac.embedded_agent_simulate = "2x2GiB"\n'
              "c.GpuFrac.embedded_agent_nvml = False\n")
    with running_server(tmp_path / "server", sock, config) as server:
        nb = server.open_notebook("n.ipynb")
        lease = server.kernel_status(nb.kernel_id)["lease"]
        pid = int(server.log_text().split("started embedded GPU agent (pid ")[1].split(")")[0])
        os.kill(pid, signal.SIGKILL)
        # The embedded agent may be back before a poll sees the state: the events keep it.
        try:
            wait_for(lambda: any(e["event"] == "agent_unreachable"
                                 for e in server.kernel_status(nb.kernel_id)["events"]),
                     10, "the lost agent to be reported", interval=0.1)
        except AssertionError as err:
            raise AssertionError(f"{err}; server log:\n{server.log_text()[-6000:]}") from None
        status = wait_for(
            lambda: (s := server.kernel_status(nb.kernel_id))["state"] == "guaranteed" and s,
            60, "the embedded agent to be back", interval=0.2,
        )
        # Same socket, same state directory: the very same lease.
        assert status["lease"]["id"] == lease["id"]
        assert server.log_text().count("started embedded GPU agent") == 2
        nb.close()


def test_stale_leases_of_a_gone_server_are_released_at_start(tmp_path: Path) -> None:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    with AgentProcess(tmp_path / "agent", "1x2GiB") as agent:
        stale = agent.client().create_lease(
            client=f"jupyter-server-{socket.gethostname()}-{gone.pid}", request="0.75",
            kind="notebook", kernel_id="k-gone",
        )
        with running_server(tmp_path / "server", agent.socket, FAST) as server:
            wait_for(lambda: all(lease["id"] != stale["id"] for lease in agent.client().leases()),
                     10, "the stale lease to be released", interval=0.2)
            nb = server.open_notebook("n.ipynb")
            # 0.25 + 0.75 would have filled the GPU: now the default request fits with room.
            assert server.kernel_status(nb.kernel_id)["state"] == "guaranteed"
            nb.close()


def test_kernel_without_gpu_gets_one_when_room_appears(tmp_path: Path) -> None:
    with AgentProcess(tmp_path / "agent", "1x2GiB", ["--poll-interval", "0.2"]) as agent:
        blocker = agent.client().create_lease(client="someone", request="1", kind="job")
        with running_server(tmp_path / "server", agent.socket, FAST) as server:
            nb = server.open_notebook("n.ipynb")
            assert server.kernel_status(nb.kernel_id)["state"] == "no-gpu"
            nb.ok("kept = [1, 2, 3]")
            agent.client().release(blocker["id"])
            status = wait_for(
                lambda: (s := server.kernel_status(nb.kernel_id))["gpu"] and s,
                30, "the kernel to get a GPU share", interval=0.2,
            )
            assert status["lease"]["kernel_id"] == nb.kernel_id
            wait_for(lambda: restores(server, nb.kernel_id), 30, "the restore", interval=0.2)
            output = nb.ok("import os\nprint(kept, os.environ['CUDA_VISIBLE_DEVICES'])")
            assert f"[1, 2, 3] {status['gpu']['uuid']}" in output, output
            nb.close()
