"""`jupyter gpufrac flush` reaches its server's socket however deep the runtime folder is."""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import time
from pathlib import Path

from jupyter_gpufrac.server.stopping import FlushSocket, Outcome
from jupyter_gpufrac.wake import ADDRESS_MAX


async def test_flush_answers_from_a_runtime_folder_deeper_than_a_socket_address(
        tmp_path: Path) -> None:
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True, mode=0o700)
    outcome = Outcome("k-1", "train.ipynb", True, 3, time.time(), None)
    asked: list[float] = []

    async def flush() -> list[Outcome]:
        asked.append(time.time())
        return [outcome]

    served = FlushSocket(str(deep), flush, logging.getLogger("test"))
    await served.start()
    try:
        assert len(os.fsencode(served.path)) > ADDRESS_MAX and served.path.is_socket()
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "jupyter_gpufrac", "flush", "--runtime-dir", str(deep),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
        out, err = await asyncio.wait_for(proc.communicate(), 60)
        assert proc.returncode == 0, err.decode()
        assert outcome.line() in out.decode() and len(asked) == 1
    finally:
        await served.stop()
    assert not served.path.exists()
