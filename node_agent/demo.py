"""`gpufrac-agent demo`: an agent on a simulated node, two notebooks spread out, then compacted for a job."""

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

            _say("a job asks for a whole GPU: gpufrac-agent run --gpus 1 -- python -c ...")
            _, cursor = client.directives(client="gpufrac-demo", after=-1, timeout=0)
            job = subprocess.Popen(
                [sys.executable, "-m", "node_agent", "--socket", sock, "run", "--gpus", "1", "--",
                 sys.executable, "-c",
                 "import os; print('   job: running on', os.environ['CUDA_VISIBLE_DEVICES'])"],
            )
            by_id = {nb.lease["id"]: nb for nb in notebooks}
            done = threading.Event()

            def follow() -> None:
                after = cursor
                while not done.is_set():
                    found, after = client.directives(client="gpufrac-demo", after=after,
                                                     timeout=1)
                    for d in found:
                        if d["kind"] == "migrate":
                            by_id[d["lease_id"]].migrate(d, labels)

            follower = threading.Thread(target=follow, daemon=True)
            follower.start()
            code = job.wait(timeout=60)
            done.set()
            follower.join(timeout=5)
            time.sleep(0.5)
            _say(f"the job finished (exit {code}); the notebooks stay compacted on one GPU")
            _show(client)
            return code
        finally:
            for nb in notebooks:
                nb.stop()
            agent.terminate()
            agent.wait(timeout=10)
