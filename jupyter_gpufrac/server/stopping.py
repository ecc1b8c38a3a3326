"""Before the server stops: every kernel's checkpoint made durable within a grace, and said."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from jupyter_gpufrac import contract
from jupyter_gpufrac.server.kernel_channel import checkpoint, checkpoint_status
from jupyter_gpufrac.server.kernels import KernelGpu
from jupyter_gpufrac.server.notebook_states import clock
from jupyter_gpufrac.wake import unix_address
from node_agent.peers import peer_credentials

# A kernel that runs a cell is asked this often whether the last completed cell's checkpoint
# is written (on its control channel, answered while the cell runs).
STATUS_POLL_S = 0.2
# Lease states in which the kernel's checkpoint was made durable before it gave its GPU back
# (a frozen kernel's CUDA calls would wait for a thaw: it is not asked again).
KEPT_STATES = ("parked", "freezing", "thawing")
# The longest question `jupyter gpufrac flush` may send.
MAX_LINE = 1024


@dataclass
class Outcome:
    """What one kernel's checkpoint holds once the server is done making it durable."""

    kernel_id: str
    notebook: str | None
    durable: bool
    # The cell and time of the last durable checkpoint: what the notebook resumes.
    cell: int | None
    time: float | None
    # Why it is not durable, or what the durable state does not hold; None: all of it.
    why: str | None

    def line(self) -> str:
        """One line of the server's log."""
        name = f"kernel {self.kernel_id}" + (f" ({self.notebook})" if self.notebook else "")
        if self.cell is not None or self.time is not None:
            point = f"after cell [{self.cell}] at {clock(self.time)}"
        else:
            point = "no checkpoint at all"
        if self.durable:
            return f"{name}: durable, {point}" + (f"; {self.why}" if self.why else "")
        return f"{name}: not made durable ({self.why}); its last durable checkpoint: {point}"


async def make_durable(kernels: list[tuple[str, Any, KernelGpu]], grace: float
                       ) -> list[Outcome]:
    """Make every kernel's checkpoint durable, all at once, within ``grace`` seconds: an idle
    kernel checkpoints now (durable when it answers), one running a cell finishes writing the
    checkpoint of the last cell it completed. Never raises."""
    deadline = time.monotonic() + grace
    found = await asyncio.gather(*(_one(kernel_id, kernel, gpu, deadline)
                                   for kernel_id, kernel, gpu in kernels),
                                 return_exceptions=True)
    outcomes = []
    for (kernel_id, _, gpu), outcome in zip(kernels, found, strict=True):
        if isinstance(outcome, BaseException):
            outcome = Outcome(kernel_id, _notebook(gpu), False, None, None,
                              f"{type(outcome).__name__}: {outcome}")
        outcomes.append(outcome)
    return outcomes


def _notebook(gpu: KernelGpu) -> str | None:
    return gpu.notebook.path if gpu.notebook is not None else None


async def _one(kernel_id: str, kernel: Any, gpu: KernelGpu, deadline: float) -> Outcome:
    def outcome(durable: bool, why: str | None) -> Outcome:
        point = gpu.recovery_point or {}
        return Outcome(kernel_id, _notebook(gpu), durable, point.get("durable_cell"),
                       point.get("durable_time"), why)

    if not gpu.hooked:
        return outcome(False, "its kernel does not load the jupyter_gpufrac extension, so it "
                              "keeps no checkpoint")
    if gpu.checkpoints_off:
        return outcome(False, f"checkpoints are off: {gpu.checkpoints_off}")
    state = getattr(kernel, "execution_state", None)
    durable, why = True, None
    if (gpu.lease or {}).get("state") in KEPT_STATES:
        pass  # parked: its checkpoint was made durable before it gave its GPU back
    elif state in ("idle", "starting"):
        durable, why = await checkpoint(kernel, max(deadline - time.monotonic(), 0.1))
    elif state == "busy":
        durable = await _written(kernel, deadline)
        why = ("a cell was running: what it did is not in the checkpoint" if durable else
               "a cell was running and the checkpoint of the cell before it was still being "
               "written when the grace ended")
    else:
        durable, why = False, f"its kernel is {state or 'not running'}"
    await asyncio.to_thread(gpu.look_at_checkpoint)
    return outcome(durable, why or None)


async def _written(kernel: Any, deadline: float) -> bool:
    """Whether a busy kernel's background write ends before ``deadline``."""
    while (remaining := deadline - time.monotonic()) > 0:
        status = await checkpoint_status(kernel, min(remaining, 1.0))
        if status is not None and not status.get("writing"):
            return not status.get("error")
        await asyncio.sleep(STATUS_POLL_S)
    return False


def log_outcomes(log: logging.Logger, outcomes: list[Outcome], seconds: float, grace: float,
                 why: str) -> None:
    """The server's log: which kernels' checkpoints were made durable and which not, and why."""
    for outcome in outcomes:
        (log.info if outcome.durable else log.warning)("gpufrac: %s: %s", why, outcome.line())
    durable = sum(o.durable for o in outcomes)
    log.info("gpufrac: %s: %d of %d kernels' checkpoints durable in %.1f s (grace %g s)", why,
             durable, len(outcomes), seconds, grace)


class FlushSocket:
    """The socket `jupyter gpufrac flush` asks (a pod's preStop hook): in the server's runtime
    folder, the user's alone; only a peer of the server's own uid is answered."""

    def __init__(self, folder: str, flush: Callable[[], Awaitable[list[Outcome]]],
                 log: logging.Logger) -> None:
        self.path = Path(folder) / contract.FLUSH_SOCKET.format(pid=os.getpid())
        self._flush = flush
        self._log = log
        self._server: asyncio.AbstractServer | None = None

    async def start(self) -> None:
        """Listen; a folder where it cannot is said in the log (flush then finds no server)."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        try:
            # A runtime folder deep enough leaves no room in an AF_UNIX address for the name.
            with unix_address(str(self.path)) as address:
                self._server = await asyncio.start_unix_server(self._serve, path=address)
            os.chmod(self.path, 0o600)
        except OSError as exc:
            self._log.warning("gpufrac: `jupyter gpufrac flush` cannot reach this server: "
                              "%s: %s", self.path, exc)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            sock = writer.get_extra_info("socket")
            if sock is None or peer_credentials(sock)[1] != os.geteuid():
                return
            line = await asyncio.wait_for(reader.readline(), 10)
            if line.strip() != b"flush" or len(line) > MAX_LINE:
                writer.write(json.dumps({"error": "expected the line 'flush'"}).encode() + b"\n")
                return
            outcomes = await self._flush()
            writer.write(json.dumps({"kernels": [asdict(o) for o in outcomes]}).encode() + b"\n")
            await writer.drain()
        except (OSError, asyncio.TimeoutError, ValueError) as exc:
            self._log.info("gpufrac: a flush request failed: %s", exc)
        finally:
            writer.close()
