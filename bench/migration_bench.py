"""A planned move end to end, as a ratio to a cold start of an empty kernel plus a memcpy of its state.

Runs a real agent (simulated 2-GPU node), a real jupyter_server and real ipykernel kernels.
For each state size S: two notebooks are spread over both GPUs, the second holds the state
(torch tensors, a model and its optimizer); a whole-GPU job arrives and the second notebook
is moved. Measured:

- move: from the agent's migrate directive until the moved notebook answers a cell that checks
  its state, sent when the server's ``restored`` event reaches this process's subscription to
  the server's events (as it reaches JupyterLab);
- cold start: from opening a notebook until its new kernel has answered a first cell (`pass`);
- memcpy: S bytes copied into memory touched before, in this process (best of 3);
- the goal (issue 35): move / (cold start + S / memcpy) <= 1.0.

And where the move's time goes (see PHASES), from the agent's directive, the server's log and
events and the kernel's restore report, all on this host's clock; ``job`` is the time from the
job's start (its command's own start-up) until the agent's directive, not part of the move.

Side by side in one run, two servers on the same agent: one without spare kernels, one with
(``c.GpuFrac.spare_kernels``); rounds alternate between them, each move on the second starts
in a spare, and the table ends with the ratios spares/none.

    python bench/migration_bench.py --sizes 300,4096 --repeat 3
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import mmap
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import websocket

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from harness.agent import AgentProcess, wait_for  # noqa: E402
from harness.jupyter import Notebook, Server, start_server, stop_server  # noqa: E402
from node_agent.client import AgentClient  # noqa: E402

MiB = 2**20
STATE = """
import torch
torch.manual_seed(0)
state = {{"blob": torch.randn({n} // 4), "small": [torch.randn(64, 64) for _ in range(8)]}}
model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
opt = torch.optim.Adam(model.parameters())
model(torch.randn(4, 256)).sum().backward()
opt.step()
checksum = float(state["blob"].sum())
"""
CHECK = (
    "assert float(state['blob'].sum()) == checksum\n"
    "assert opt.param_groups[0]['params'][0] is model[0].weight"
)
# Where a move's time goes, each from the end of the one before: the agent's directive until the
# server says it is moving, its checkpoint, the launch of the new process (the old one stopped,
# a spare adopted or a cold one started), the kernel's start until its restore begins, the
# restore, until the server has its report and says so, and the notebook's next cell.
PHASES = ("directive", "checkpoint", "launch", "start", "restore", "report", "cell")
# jupyter_server's log lines begin "[I 2026-11-29 09:06:23.123 ServerApp]".
LOG_TIME = re.compile(r"^\[\w (\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3}) ")


class EventStream:
    """The server's jupyter_events, as JupyterLab hears them (``/api/events/subscribe``): when each
    gpufrac event of each kernel arrived here."""

    def __init__(self, server: Server) -> None:
        url = server.url.replace("http://", "ws://") + "/api/events/subscribe"
        self._ws = websocket.create_connection(
            url, header=[f"Authorization: token {server.token}"], timeout=60)
        self._ws.settimeout(None)  # minutes may pass between events: wait (and answer pings)
        self._seen: list[tuple[str, str, float]] = []
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        while True:
            try:
                message = json.loads(self._ws.recv())
            except (websocket.WebSocketException, OSError, ValueError):
                return
            if isinstance(message, dict) and message.get("kernel_id") and message.get("event"):
                with self._lock:
                    self._seen.append((str(message["kernel_id"]), str(message["event"]),
                                       time.time()))

    def arrived(self, event: str, since: float) -> tuple[str, float] | None:
        """(kernel id, when) of the first ``event`` that arrived after ``since``, or None."""
        with self._lock:
            return next(((kernel, at) for kernel, name, at in self._seen
                         if name == event and at >= since), None)

    def close(self) -> None:
        self._ws.close()


def cold_start(server: Server, name: str, first: str = "pass") -> tuple[float, Notebook]:
    """Seconds from opening a notebook until its new kernel answered ``first``."""
    t0 = time.perf_counter()
    nb = server.open_notebook(name)
    nb.ok(first)
    return time.perf_counter() - t0, nb


def memcpy_seconds(nbytes: int) -> float:
    """Seconds to copy ``nbytes`` into memory touched before (best of 3)."""
    source, target = mmap.mmap(-1, nbytes), mmap.mmap(-1, nbytes)
    best = float("inf")
    with memoryview(source) as src, memoryview(target) as dst:
        dst[:] = src  # both touched once
        for _ in range(3):
            started = time.perf_counter()
            dst[:] = src
            best = min(best, time.perf_counter() - started)
    source.close()
    target.close()
    return best


def spare_ready(server: Server) -> bool:
    """A spare kernel is ready that no move has taken yet (the server's log says both)."""
    log = server.log_text()
    return len(re.findall(r"spare kernel \d+ ready in", log)) > log.count("started in spare kernel")


def logged_at(server: Server, text: str) -> float | None:
    """When the server last logged a line containing ``text`` (unix seconds), or None."""
    found = None
    for line in server.log_text().splitlines():
        match = LOG_TIME.match(line)
        if match and text in line:
            found = datetime.datetime.strptime(match.group(1), "%Y-%m-%d %H:%M:%S.%f").timestamp()
    return found


def directive_created(socket: str, lease: str) -> float | None:
    """When the agent created the migrate directive of ``lease`` (its own clock, this host's)."""
    found, _ = AgentClient(socket).directives(lease=lease, after=0, timeout=0)
    return next((float(d["created"]) for d in found if d.get("kind") == "migrate"), None)


def one_round(server: Server, events: EventStream, socket: str, nbytes: int, round_no: int,
              spares: bool) -> dict[str, float]:
    cold, first = cold_start(server, f"first-{round_no}.ipynb")
    _, second = cold_start(server, f"second-{round_no}.ipynb", "import torch")
    second.ok(STATE.format(n=nbytes))
    if spares:
        wait_for(lambda: spare_ready(server), 120, "a ready spare kernel", interval=0.1)
    began = time.time()
    job = subprocess.Popen(
        [sys.executable, "-m", "node_agent", "--socket", socket, "run", "--gpus", "1", "--", "true"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    kernel, restored = wait_for(lambda: events.arrived("restored", began), 300,
                                "a notebook to be moved and restored", interval=0.005)
    mover = first if first.kernel_id == kernel else second
    mover.ok(CHECK if mover is second else "pass")
    answered = time.time()
    job.wait(120)
    status = server.kernel_status(mover.kernel_id)
    happened = {e["event"]: e["time"] for e in status["events"]}
    restore = status["restore"] or {}
    created = directive_created(socket, str(status["lease"]["id"])) or began
    restarting = logged_at(server, f"kernel {mover.kernel_id}: restarting") or happened["migrating"]
    restore_began = float(restore.get("time") or happened["migrated"])
    restore_s = float(restore.get("seconds") or 0.0)
    for nb in (first, second):
        nb.close()
        server.api(f"/api/kernels/{nb.kernel_id}", "DELETE")
    marks = [created, happened["migrating"], restarting, happened["migrated"], restore_began,
             restore_began + restore_s, restored, answered]
    return {
        "move": answered - created,
        "cold": cold,
        "job": created - began,
        **{phase: marks[i + 1] - marks[i] for i, phase in enumerate(PHASES)},
        "moved_state": float(mover is second),
        "adopted": float(f"kernel {mover.kernel_id}: started in spare kernel" in server.log_text()),
    }


def report(size: int, label: str, rounds: list[dict[str, float]], copy: float) -> dict[str, float]:
    m = {key: statistics.median(r[key] for r in rounds) for key in rounds[0]}
    ratio = m["move"] / (m["cold"] + copy)
    note = "" if m["moved_state"] else "  (the empty notebook was moved)"
    adopted = sum(int(r["adopted"]) for r in rounds)
    phases = " ".join(f"{m[phase]:>10.2f}" for phase in PHASES)
    print(f"{size:>6}MiB {label:>6} {m['move']:>7.2f}s {m['cold']:>7.2f}s {copy * 1e3:>7.0f}ms "
          f"{ratio:>6.2f} {phases} {m['job']:>6.2f} {adopted:>3}/{len(rounds)}{note}", flush=True)
    return m


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="300,4096", help="state sizes in MiB, comma-separated")
    parser.add_argument("--repeat", type=int, default=3, help="moves per size and server")
    parser.add_argument("--spares", choices=("both", "on", "off"), default="both",
                        help="servers with spare kernels, without, or both side by side")
    parser.add_argument("--keep", type=Path, default=None,
                        help="keep the servers' logs (and everything else) in this folder")
    args = parser.parse_args()
    sizes = [int(size) for size in args.sizes.split(",")]
    modes = {"both": ["off", "on"], "on": ["on"], "off": ["off"]}[args.spares]
    with (contextlib.nullcontext(str(args.keep)) if args.keep
          else tempfile.TemporaryDirectory(prefix="gpufrac-bench-")) as tmp:
        agent_args = ("--poll-interval", "0.1", "--migrate-grace", "300")
        with AgentProcess(Path(tmp) / "agent", "2x16GiB", agent_args) as agent:
            servers: dict[str, Server] = {}
            try:
                for mode in modes:
                    config = ("c.GpuFrac.lease_poll_interval = 60\n"
                              f"c.GpuFrac.spare_kernels = {mode == 'on'}\n")
                    servers[mode] = start_server(Path(tmp) / f"server-{mode}", agent.socket, config)
                events = {mode: EventStream(server) for mode, server in servers.items()}
                print(f"{'state':>9} {'spares':>6} {'move':>8} {'cold':>8} {'memcpy':>9} "
                      f"{'ratio':>6} " + " ".join(f"{phase:>10}" for phase in PHASES)
                      + f" {'job':>6} {'spare':>5}")
                round_no = 0
                for size in sizes:
                    rounds: dict[str, list[dict[str, float]]] = {mode: [] for mode in modes}
                    copies = []
                    for _ in range(args.repeat):
                        for mode in modes:  # alternating: drift on the machine hits both alike
                            round_no += 1
                            rounds[mode].append(one_round(servers[mode], events[mode],
                                                          agent.socket, size * MiB, round_no,
                                                          mode == "on"))
                        copies.append(memcpy_seconds(size * MiB))
                    copy = statistics.median(copies)
                    medians = {mode: report(size, mode, rounds[mode], copy) for mode in modes}
                    if len(modes) == 2:
                        on, off = medians["on"], medians["off"]
                        print(f"{size:>6}MiB {'on/off':>6} {on['move'] / off['move']:>7.2f}x "
                              + " " * 34 + " ".join(
                                  f"{on[p] / off[p] if off[p] > 0 else float('nan'):>9.2f}x"
                                  for p in PHASES)
                              + f"  (saved {off['move'] - on['move']:.2f} s a move)", flush=True)
            finally:
                for server in servers.values():
                    stop_server(server)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
