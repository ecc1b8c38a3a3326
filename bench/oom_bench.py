"""Recovery from an OOM kill end to end, with spare kernels on and off, as a ratio to a cold start.

Runs real agents (one simulated 2 GiB GPU each), real jupyter_servers and real ipykernel
kernels. Each round: a notebook with a 256 MiB guarantee (allowed to burst to the whole GPU)
builds its state (torch tensors, a model and its optimizer), then bursts to 1000 MB in a long
cell; an owner notebook on the same GPU grows within its 1 GiB guarantee into that loaned
memory; the agent asks the borrower to shrink and, after --reclaim-grace, kills it (cause
``reclaim``, the notebook's ``oom_killed``). The server restarts the kernel, which restores its
last checkpoint. Measured, each from the kill (the agent's ``killed`` directive):

- restart: until the restarted kernel is placed again (the server's ``placed`` event);
- restored: until the kernel says its variables are back (the ``restored`` event);
- answered: until the notebook has run a cell that checks those variables;
- cold start: from opening a notebook until ``import torch`` has run in its new kernel.

Side by side in one run, two agents and two servers, one without spare kernels and one with
(``c.GpuFrac.spare_kernels``; each kill there restarts in a ready spare, torch imported);
rounds alternate between them, and the table ends with the ratios spares/none.

    python bench/oom_bench.py --size 64 --repeat 5
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, NamedTuple

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.migration_bench import CHECK, STATE, cold_start, spare_ready  # noqa: E402
from harness.agent import AgentProcess, wait_for  # noqa: E402
from harness.jupyter import Notebook, Server, start_server, stop_server  # noqa: E402
from node_agent.client import AgentClient  # noqa: E402

# The owner: 1 GiB guaranteed, no bursting. Kernels without metadata are the borrowers.
KERNELSPECS = {"owner": {"gpufrac": {"request": "0.5", "limit": "0.5"}}}
CONFIG = (
    "c.GpuFrac.default_request = '0.125'\n"  # 256 MiB of the 2 GiB GPU
    "c.GpuFrac.default_limit = '1'\n"
    "c.GpuFrac.lease_poll_interval = 60\n"
)
AGENT_ARGS = ("--poll-interval", "0.1", "--reclaim-grace", "0.5", "--headroom", "0.25")
BURST = "big = torch.ones(1000 * 10**6 // 4)\nimport time\ntime.sleep(600)"
OWNER_GROWS = "mine = torch.ones(400 * 2**20 // 4)"


class Node(NamedTuple):
    """One mode's agent, server, and owner notebook (kept across rounds)."""

    mode: str
    agent: AgentProcess
    server: Server
    owner: Notebook


def lease_of(server: Server, kernel_id: str) -> str:
    return str(server.kernel_status(kernel_id)["lease"]["id"])


def after_kill(events: list[dict[str, Any]], name: str) -> float | None:
    """When ``name`` first happened after the kernel was killed (the server's clock)."""
    kinds = [e["event"] for e in events]
    if "oom_killed" not in kinds:
        return None
    start = kinds.index("oom_killed")
    return next((e["time"] for e in events[start:] if e["event"] == name), None)


def one_round(node: Node, nbytes: int, round_no: int) -> dict[str, float]:
    server, client = node.server, AgentClient(node.agent.socket)
    cold, nb = cold_start(server, f"borrower-{round_no}.ipynb", "import torch")
    nb.ok(STATE.format(n=nbytes))
    nb.ok("%gpu checkpoint")  # what it restores, complete before the kill
    lease = lease_of(server, nb.kernel_id)
    _, cursor = client.directives(lease=lease, after=-1, timeout=0)
    nb.send(BURST)
    wait_for(lambda: client.lease(lease)["bursting"], 60, "the borrower to burst", interval=0.05)
    if node.mode == "on":
        wait_for(lambda: spare_ready(server), 120, "a ready spare kernel", interval=0.1)
    node.owner.ok(OWNER_GROWS)

    def killed() -> dict[str, Any] | None:
        found, _ = client.directives(lease=lease, after=cursor, timeout=5)
        return next((d for d in found if d["kind"] == "killed"), None)

    directive = wait_for(killed, 60, "the borrower to be killed", interval=0)
    assert directive["cause"] == "reclaim", directive
    killed_at = float(directive["created"])

    def restored() -> list[dict[str, Any]] | None:
        events: list[dict[str, Any]] = server.kernel_status(nb.kernel_id)["events"]
        return events if after_kill(events, "restored") is not None else None

    events = wait_for(restored, 300, "the borrower to be restored", interval=0.02)
    nb.ok(CHECK + "\nassert 'big' not in globals()")
    answered = time.time() - killed_at
    restored_at, placed_at = after_kill(events, "restored"), after_kill(events, "placed")
    assert restored_at is not None
    nb.close()
    server.api(f"/api/kernels/{nb.kernel_id}", "DELETE")
    # The collector frees it: a checkpoint's pickler, in a reference cycle, still holds it.
    node.owner.ok("del mine\nimport gc\ngc.collect()")
    return {
        "answered": answered,
        "restored": restored_at - killed_at,
        "restart": (placed_at if placed_at is not None else restored_at) - killed_at,
        "cold": cold,
        "adopted": float(f"kernel {nb.kernel_id}: started in spare kernel" in server.log_text()),
    }


def report(label: str, rounds: list[dict[str, float]]) -> dict[str, float]:
    m = {key: statistics.median(r[key] for r in rounds) for key in rounds[0]}
    adopted = sum(int(r["adopted"]) for r in rounds)
    print(f"{label:>7} {m['restart']:>8.2f}s {m['restored']:>9.2f}s {m['answered']:>9.2f}s "
          f"{m['cold']:>10.2f}s {m['answered'] / m['cold']:>13.2f} {adopted:>5}/{len(rounds)}",
          flush=True)
    return m


def start_node(tmp: Path, mode: str) -> Node:
    agent = AgentProcess(tmp / f"agent-{mode}", "1x2GiB", AGENT_ARGS).start()
    try:
        config = CONFIG + f"c.GpuFrac.spare_kernels = {mode == 'on'}\n"
        server = start_server(tmp / f"server-{mode}", agent.socket, config, KERNELSPECS)
    except BaseException:
        agent.stop()
        raise
    owner = server.open_notebook(f"owner-{mode}.ipynb", kernel="owner")
    owner.ok("import torch")
    return Node(mode, agent, server, owner)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=64, help="the notebook's state in MB")
    parser.add_argument("--repeat", type=int, default=5, help="kills per server")
    parser.add_argument("--spares", choices=("both", "on", "off"), default="both",
                        help="servers with spare kernels, without, or both side by side")
    args = parser.parse_args()
    modes = {"both": ["off", "on"], "on": ["on"], "off": ["off"]}[args.spares]
    nodes: dict[str, Node] = {}
    with tempfile.TemporaryDirectory(prefix="gpufrac-bench-") as tmp:
        try:
            for mode in modes:
                nodes[mode] = start_node(Path(tmp), mode)
            print(f"state {args.size} MB; medians of {args.repeat}, each from the kill")
            print(f"{'spares':>7} {'restart':>9} {'restored':>10} {'answered':>10} "
                  f"{'cold start':>11} {'answered/cold':>13} {'spare':>7}")
            rounds: dict[str, list[dict[str, float]]] = {mode: [] for mode in modes}
            round_no = 0
            for _ in range(args.repeat):
                for mode in modes:  # alternating: drift on the machine hits both alike
                    round_no += 1
                    rounds[mode].append(one_round(nodes[mode], args.size * 10**6, round_no))
            medians = {mode: report(mode, rounds[mode]) for mode in modes}
            if len(modes) == 2:
                on, off = medians["on"], medians["off"]
                print(f"{'on/off':>7} {on['restart'] / off['restart']:>8.2f}x "
                      f"{on['restored'] / off['restored']:>9.2f}x "
                      f"{on['answered'] / off['answered']:>9.2f}x "
                      f"(saved {off['answered'] - on['answered']:.2f} s a kill)", flush=True)
        finally:
            for node in nodes.values():
                node.owner.close()
                stop_server(node.server)
                node.agent.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
