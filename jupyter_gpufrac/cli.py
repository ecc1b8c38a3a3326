"""``jupyter gpufrac flush``: make every kernel's checkpoint durable now (a pod's preStop hook)."""

from __future__ import annotations

import argparse
import contextlib
import json
import socket
import sys
from pathlib import Path
from typing import Any

from jupyter_gpufrac import contract
from jupyter_gpufrac.wake import unix_address

# Exit statuses: every kernel durable; some not; no server answered.
DURABLE, NOT_ALL, NO_SERVER = 0, 1, 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="jupyter gpufrac",
        description="Commands for the jupyter-gpufrac server extension.")
    sub = parser.add_subparsers(dest="command", required=True)
    flush = sub.add_parser(
        "flush", help="make every kernel's checkpoint durable now",
        description="Ask the Jupyter servers of this user on this machine (found in the Jupyter "
        "runtime folder) to make every kernel's checkpoint durable, and print what each holds. "
        "Run it as a pod's preStop hook: the notebooks then resume wherever they are reopened. "
        f"Exit status {DURABLE}: every kernel durable; {NOT_ALL}: some not; {NO_SERVER}: no "
        "server answered.")
    flush.add_argument("--timeout", type=float, default=60.0, metavar="S",
                       help="seconds to wait for the servers' answers (default 60)")
    flush.add_argument("--runtime-dir", metavar="DIR",
                       help="the Jupyter runtime folder (default: `jupyter --runtime-dir`)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    folder = Path(args.runtime_dir) if args.runtime_dir else _runtime_dir()
    sockets = sorted(folder.glob(contract.FLUSH_SOCKET.format(pid="*")))
    answers = [answer for path in sockets if (answer := _ask(path, args.timeout)) is not None]
    if not answers:
        print(f"jupyter gpufrac flush: no Jupyter server with jupyter-gpufrac answered in {folder}",
              file=sys.stderr)
        return NO_SERVER
    from jupyter_gpufrac.server.stopping import Outcome

    status = DURABLE
    for kernels in answers:
        for raw in kernels:
            outcome = Outcome(str(raw.get("kernel_id")), raw.get("notebook"),
                              raw.get("durable") is True, raw.get("cell"), raw.get("time"),
                              raw.get("why"))
            print(outcome.line())
            if not outcome.durable:
                status = NOT_ALL
    return status


def _runtime_dir() -> Path:
    from jupyter_core.paths import jupyter_runtime_dir

    return Path(jupyter_runtime_dir())


def _ask(path: Path, timeout: float) -> list[dict[str, Any]] | None:
    """One server's kernels as it answered, or None (gone, or not answering in time)."""
    with contextlib.suppress(OSError, ValueError), \
            socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        with unix_address(str(path)) as address:
            sock.connect(address)
        sock.sendall(b"flush\n")
        data = b""
        while not data.endswith(b"\n") and (chunk := sock.recv(65536)):
            data += chunk
        found = json.loads(data).get("kernels")
        if isinstance(found, list):
            return [k for k in found if isinstance(k, dict)]
    return None
