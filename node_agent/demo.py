"""`gpufrac-agent demo`: a simulated node, two notebooks spread out, compacted for a job, then frozen."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from node_agent.client import AgentClient
from node_agent.status import render_status

# A stand-in for a notebook kernel: holds some memory (simulated device memory) until killed.
_WORKER = (
    "import os, sys, time\n"
    "state = bytearray(int(sys.argv[1]) * 2**20)\n"
    "state[::4096] = b'x' * len(state[::4096])\n"
    "print('ready', flush=True)\n"
    "time.sleep(3600)\n"
)


def _say(text: str) -> None:
    print(f"\n\033[1m== {text}\033[0m" if sys.stdout.isatty() else f"\n== {text}", flush=True)


def _show(client: AgentClient) -> None:
    print(render_status(client.node(), client.leases()), flush=True)


class _Notebook:
    """One simulated kernel process and its lease, moved when the agent says so."""

    def __init__(self, client: AgentClient, name: str, mib: int) -> None:
        self.client, self.name, self.mib = client, name, mib
        self.lease = client.create_lease(client="gpufrac-demo", kind="notebook", request="0.25",
                                         limit="1", name=name)
        self.proc = self._start(self.lease["physical_gpu"])

    def _start(self, gpu: str) -> subprocess.Popen[str]:
        proc = subprocess.Popen([sys.executable, "-c", _WORKER, str(self.mib)],
                                env=dict(os.environ, CUDA_VISIBLE_DEVICES=gpu),
                                stdout=subprocess.PIPE, text=True)
        # Register before it allocates: the simulated GPU counts memory above this baseline.
        self.client.register_pid(self.lease["id"], proc.pid)
        assert proc.stdout is not None
        proc.stdout.readline()
        return proc

    def migrate(self, directive: dict[str, Any], labels: dict[str, str]) -> None:
        print(f"   {self.name}: migrate {labels[directive['from_gpu']]} -> "
              f"{labels[directive['to_gpu']]}: checkpoint, restart there, restore", flush=True)
        self.proc.kill()
        self.proc.wait()
        self.proc = self._start(directive["to_gpu"])
        self.lease = self.client.migrated(self.lease["id"])

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()


def _job(client: AgentClient, sock: str, gpus: int, by_id: dict[str, _Notebook],
         labels: dict[str, str]) -> int:
    """`gpufrac-agent run --gpus N`, the notebooks doing what the agent asks meanwhile."""
    _, cursor = client.directives(client="gpufrac-demo", after=-1, timeout=0)
    job = subprocess.Popen(
        [sys.executable, "-m", "node_agent", "--socket", sock, "run", "--gpus", str(gpus), "--",
         sys.executable, "-c",
         "import os, time; time.sleep(1)\n"
         "print('   job: ran on', os.environ['CUDA_VISIBLE_DEVICES'], flush=True)"],
    )
    done = threading.Event()

    def follow() -> None:
        after = cursor
        while not done.is_set():
            found, after = client.directives(client="gpufrac-demo", after=after, timeout=1,
                                             kinds=("migrate", "frozen", "unparked"))
            for d in found:
                nb = by_id[d["lease_id"]]
                if d["kind"] == "migrate":
                    nb.migrate(d, labels)
                elif d["kind"] == "frozen":
                    print(f"   {nb.name}: {d['reason']}", flush=True)
                elif d.get("thawed"):
                    print(f"   {nb.name}: {d['reason']} (pid {nb.proc.pid}, the same process)",
                          flush=True)

    follower = threading.Thread(target=follow, daemon=True)
    follower.start()
    code = job.wait(timeout=60)
    if gpus > 1:  # the thaws come once the job's lease is gone
        deadline = time.monotonic() + 10
        while (any(x["frozen"] for x in client.leases() if x["id"] in by_id)
               and time.monotonic() < deadline):
            time.sleep(0.1)
    time.sleep(0.3)
    done.set()
    follower.join(timeout=5)
    return code


def run_demo(spec: str) -> int:
    with tempfile.TemporaryDirectory(prefix="gpufrac-demo-") as tmp:
        sock = str(Path(tmp) / "agent.sock")
        _say(f"starting an agent on a simulated node ({spec})")
        agent = subprocess.Popen(
            [sys.executable, "-m", "node_agent", "serve", "--socket", sock, "--state-dir",
             str(Path(tmp) / "state"), "--simulate", spec, "--poll-interval", "0.2",
             "--log-level", "warning"],
            stdout=subprocess.PIPE, text=True,
        )
        assert agent.stdout is not None
        if "ready" not in agent.stdout.readline():
            print("the agent did not start", file=sys.stderr)
            return 1
        client = AgentClient(sock)
        notebooks: list[_Notebook] = []
        try:
            labels = {g["uuid"]: f"GPU {g['index']}" for g in client.node()["gpus"]}
            _say("two notebooks ask for 0.25 of a GPU each (limit 1.0)")
            print("   logically they are bin-packed onto one GPU; physically the agent "
                  "spreads them over idle GPUs so each can burst", flush=True)
            notebooks = [_Notebook(client, "notebook-a", 300), _Notebook(client, "notebook-b", 200)]
            time.sleep(0.5)  # a few polls, so the table shows what the processes hold
            _show(client)

            by_id = {nb.lease["id"]: nb for nb in notebooks}
            _say("a job asks for a whole GPU: gpufrac-agent run --gpus 1 -- python -c ...")
            code = _job(client, sock, 1, by_id, labels)
            _say(f"the job finished (exit {code}); the notebooks stay compacted on one GPU")
            _show(client)
            if code:
                return code
            _say("a job asks for both GPUs whole: the notebooks have nowhere to go, so they are "
                 "frozen (their processes keep everything in host memory) and thawed after it")
            code = _job(client, sock, 2, by_id, labels)
            time.sleep(0.5)
            _say(f"the job finished (exit {code}); the notebooks run again, nothing restarted")
            _show(client)
            return code
        finally:
            for nb in notebooks:
                nb.stop()
            agent.terminate()
            agent.wait(timeout=10)
