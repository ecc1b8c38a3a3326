"""A SIGKILLed notebook's tensors back, as a ratio to a cold start plus a read of their bytes.

The read is from the disk, or on a GPU the copy over the host-to-device link.

Runs a real agent (a simulated node), real jupyter_servers and real ipykernel kernels. Each round:
a notebook makes S bytes of tensors (1 GiB each), checkpoints them (``%gpu checkpoint``: durable);
their blobs are dropped from the page cache (posix_fadvise), so the restore reads the disk; the
kernel is SIGKILLed; jupyter_client's restarter notices, the server restarts it and it restores
its checkpoint. Measured, side by side in one run (rounds alternate between a server with spare
kernels and one without):

- restore: from the SIGKILL until the restarted notebook has answered a cell that checks every
  tensor, sent when the server's ``restored`` event reaches this process (as it reaches Lab);
- cold start: from opening a notebook until its new kernel answered a first cell (``pass``);
- disk read: S bytes read from a file of this disk with an empty page cache, in 16 MiB reads;
- the goal (issue 35): restore / (cold start + S / disk read) <= 1.1.

``--gpu`` (on a machine with one): the tensors are made on the GPU, the page cache is left
alone, and the denominator's copy is the host-to-device copy of S bytes from pageable memory,
measured in a kernel of the run; the goal is the same.

    python bench/restore_bench.py --size 4096 --repeat 3
    python bench/restore_bench.py --gpu --size 16384 --repeat 3     # on a GPU machine
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.migration_bench import EventStream, cold_start  # noqa: E402
from harness.agent import AgentProcess, wait_for  # noqa: E402
from harness.jupyter import Notebook, Server, start_server, stop_server  # noqa: E402

MiB, GiB = 2**20, 2**30
READ_BLOCK = 16 * MiB
STATE = """
import os, torch
tensors = [torch.full(({n},), float(i), device={device!r}) for i in range({count})]
sums = [float(t.sum()) for t in tensors]
"""
CHECK = ("assert [float(t.sum()) for t in tensors] == sums\n"
         "assert all(t.device.type == {device!r} for t in tensors)")
FOLDER = "print('DIR', __import__('jupyter_gpufrac.kernel', fromlist=['x']).summary()['checkpoint_dir'])"
PID = "print('PID', os.getpid())"
H2D = """
import time, torch
_host = torch.empty({nbytes}, dtype=torch.uint8).fill_(1)
torch.cuda.synchronize()
_t0 = time.perf_counter()
_dev = _host.to("cuda")
torch.cuda.synchronize()
print("H2D", time.perf_counter() - _t0)
del _host, _dev
torch.cuda.empty_cache()
"""


def printed(nb: Notebook, code: str, tag: str) -> str:
    """What ``code`` printed after ``tag`` on its line."""
    return next(line.split(maxsplit=1)[1] for line in nb.ok(code).splitlines()
                if line.startswith(tag + " "))


def evict(folder: Path) -> None:
    """Drop the files under ``folder`` from the page cache (they are synced: a checkpoint's are)."""
    for path in folder.rglob("*"):
        if path.is_file() and not path.is_symlink():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def disk_read_seconds(folder: Path, nbytes: int) -> float:
    """Seconds to read a file of ``nbytes`` from this disk with an empty page cache."""
    path = folder / "raw-read.bin"
    block = os.urandom(READ_BLOCK)
    with open(path, "wb") as f:
        for start in range(0, nbytes, READ_BLOCK):
            f.write(block[:min(READ_BLOCK, nbytes - start)])
        f.flush()
        os.fsync(f.fileno())
    try:
        evict(folder)
        buffer = bytearray(READ_BLOCK)
        started = time.perf_counter()
        with open(path, "rb", buffering=0) as f:
            while f.readinto(buffer):
                pass
        return time.perf_counter() - started
    finally:
        path.unlink()


def one_round(server: Server, events: EventStream, nbytes: int, device: str,
              round_no: int) -> dict[str, float]:
    cold, empty = cold_start(server, f"empty-{round_no}.ipynb")
    empty.close()
    server.api(f"/api/kernels/{empty.kernel_id}", "DELETE")
    _, nb = cold_start(server, f"state-{round_no}.ipynb", "import torch")
    count = max(1, nbytes // GiB)
    nb.ok(STATE.format(n=nbytes // count // 4, device=device, count=count))
    nb.ok("%gpu checkpoint")
    folder = Path(printed(nb, FOLDER, "DIR"))
    pid = int(printed(nb, PID, "PID"))
    if device == "cpu":
        evict(folder)
    began = time.time()
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: events.arrived("restored", began), 600, "the restore", interval=0.005)
    nb.ok(CHECK.format(device=device), timeout=600)
    answered = time.time()
    status = server.kernel_status(nb.kernel_id)
    restore = status["restore"] or {}
    nb.close()
    server.api(f"/api/kernels/{nb.kernel_id}", "DELETE")
    return {"restore": answered - began, "cold": cold, "loaded": float(restore.get("seconds") or 0),
            "adopted": float(f"kernel {nb.kernel_id}: started in spare kernel" in server.log_text())}


def link_seconds(server: Server, nbytes: int) -> float:
    """Seconds of a host-to-device copy of ``nbytes`` from pageable memory, in a kernel."""
    _, nb = cold_start(server, "h2d.ipynb", "import torch")
    try:
        return float(printed(nb, H2D.format(nbytes=nbytes), "H2D"))
    finally:
        nb.close()
        server.api(f"/api/kernels/{nb.kernel_id}", "DELETE")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=4096, help="the tensors' bytes, in MiB")
    parser.add_argument("--repeat", type=int, default=3, help="kills per server")
    parser.add_argument("--gpu", action="store_true", help="tensors on the GPU (needs one)")
    parser.add_argument("--spares", choices=("both", "on", "off"), default="both",
                        help="servers with spare kernels, without, or both side by side")
    args = parser.parse_args()
    nbytes, device = args.size * MiB, "cuda" if args.gpu else "cpu"
    modes = {"both": ["off", "on"], "on": ["on"], "off": ["off"]}[args.spares]
    # The simulated node counts a kernel's whole memory: room for the state, twice.
    node = "1x80GiB" if args.gpu else f"1x{max(8, 3 * args.size // 1024)}GiB"
    with tempfile.TemporaryDirectory(prefix="gpufrac-bench-") as tmp:
        agent_args = ("--poll-interval", "0.1")
        with AgentProcess(Path(tmp) / "agent", node, agent_args) as agent:
            servers: dict[str, Server] = {}
            streams: dict[str, EventStream] = {}
            try:
                for mode in modes:
                    config = ("c.GpuFrac.lease_poll_interval = 60\n"
                              "c.GpuFrac.default_request = '0.5'\n"
                              "c.GpuFrac.default_limit = '1'\n"
                              f"c.GpuFrac.spare_kernels = {mode == 'on'}\n")
                    servers[mode] = start_server(Path(tmp) / f"server-{mode}", agent.socket, config)
                    streams[mode] = EventStream(servers[mode])
                rounds: dict[str, list[dict[str, float]]] = {mode: [] for mode in modes}
                copies = []
                for round_no in range(args.repeat):
                    for mode in modes:  # alternating: drift on the machine hits both alike
                        rounds[mode].append(one_round(servers[mode], streams[mode], nbytes,
                                                      device, round_no))
                    copies.append(link_seconds(servers[modes[0]], nbytes) if args.gpu
                                  else disk_read_seconds(Path(tmp), nbytes))
                copy = statistics.median(copies)
                what = "host-to-device copy" if args.gpu else "disk read"
                print(f"{args.size} MiB of tensors on {device}; {what} {copy:.2f} s "
                      f"({nbytes / copy / 1e9:.2f} GB/s); medians of {args.repeat}")
                print(f"{'spares':>7} {'restore':>9} {'loaded in':>10} {'cold start':>11} "
                      f"{'ratio':>6} {'goal':>6} {'spare':>6}")
                for mode in modes:
                    m = {key: statistics.median(r[key] for r in rounds[mode])
                         for key in rounds[mode][0]}
                    ratio = m["restore"] / (m["cold"] + copy)
                    adopted = sum(int(r["adopted"]) for r in rounds[mode])
                    print(f"{mode:>7} {m['restore']:>8.2f}s {m['loaded']:>9.2f}s "
                          f"{m['cold']:>10.2f}s {ratio:>6.2f} {'<= 1.1':>6} "
                          f"{adopted:>3}/{args.repeat}", flush=True)
            finally:
                for mode, server in servers.items():
                    if mode in streams:
                        streams[mode].close()
                    stop_server(server)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
