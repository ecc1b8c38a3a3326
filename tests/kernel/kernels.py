"""Start real ipykernels with the gpufrac extension and run cells in them (test helper)."""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from queue import Empty
from typing import Any

from jupyter_client.manager import KernelManager

REPO = Path(__file__).resolve().parents[2]


@dataclass
class CellOutput:
    """What one execute request produced."""

    status: str
    stdout: str = ""
    stderr: str = ""
    error: dict[str, Any] | None = None
    results: list[str] = field(default_factory=list)
    # The cell's number, as the notebook shows it ([n]); None for a silent request.
    execution_count: int | None = None

    @property
    def traceback(self) -> str:
        return "\n".join(self.error.get("traceback", [])) if self.error else ""

    @property
    def text(self) -> str:
        return "\n".join([self.stdout, self.stderr, *self.results, self.traceback])


class Kernel:
    """A blocking client on a running kernel."""

    def __init__(self, km: KernelManager) -> None:
        self.km = km
        self.client = km.client()
        self.client.start_channels()
        self.client.wait_for_ready(timeout=60)

    @property
    def pid(self) -> int:
        """The kernel process id."""
        return int(self.km.provisioner.pid)  # type: ignore[union-attr]

    def run(self, code: str, timeout: float = 60.0, silent: bool = False) -> CellOutput:
        msg_id = self.client.execute(code, silent=silent, store_history=not silent)
        out = CellOutput(status="?")
        while True:
            try:
                msg = self.client.get_iopub_msg(timeout=timeout)
            except Empty as exc:
                raise TimeoutError(f"no output from {code!r} within {timeout} s") from exc
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            kind, content = msg["msg_type"], msg["content"]
            if kind == "stream":
                if content["name"] == "stdout":
                    out.stdout += content["text"]
                else:
                    out.stderr += content["text"]
            elif kind == "error":
                out.error = content
            elif kind in ("execute_result", "display_data"):
                out.results.append(content["data"].get("text/plain", ""))
            elif kind == "status" and content["execution_state"] == "idle":
                break
        reply = self.client.get_shell_msg(timeout=timeout)
        while reply["parent_header"].get("msg_id") != msg_id:
            reply = self.client.get_shell_msg(timeout=timeout)
        out.status = reply["content"]["status"]
        out.execution_count = None if silent else reply["content"].get("execution_count")
        if out.error is None and out.status == "error":
            out.error = reply["content"]
        return out

    def ask(self, question: str, timeout: float = 30.0) -> dict[str, Any]:
        """Ask the kernel over the server's comm (kernel_channel's messages, a blocking client)."""
        from jupyter_gpufrac.server.kernel_channel import answer_in, ask_message, close_message

        comm_id, msg = ask_message(self.client.session, question)
        self.client.shell_channel.send(msg)
        while True:
            try:
                found = answer_in(self.client.get_iopub_msg(timeout=timeout), comm_id)
            except Empty as exc:
                raise TimeoutError(f"no answer to {question!r} within {timeout} s") from exc
            if found is not None:
                self.client.shell_channel.send(close_message(self.client.session, comm_id))
                return found

    def value(self, expression: str) -> Any:
        """Evaluate ``expression`` in the kernel and return ``repr`` evaluated here."""
        import ast

        out = self.run(f"print(repr({expression}))")
        assert out.status == "ok", out.text
        # Notices (restore message, directives) may come first: the value is the last line.
        return ast.literal_eval(out.stdout.strip().splitlines()[-1])


WRITTEN = ("__import__('jupyter_gpufrac.kernel', fromlist=['x'])._hook"
           ".checkpointer.flush({timeout})")


def wait_written(kernel: Kernel, timeout: float = 60.0) -> None:
    """Wait until the checkpoints the kernel took after its cells are on disk (they are written
    in the background: a kill right after a cell restores the one before it)."""
    out = kernel.run(WRITTEN.format(timeout=timeout), timeout=timeout + 10, silent=True)
    assert out.status == "ok", out.text


def kernel_env(extra: Mapping[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUFRAC_")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    # These kernels behave as on a machine without a GPU, even on one with (tests/gpu has those).
    env["CUDA_VISIBLE_DEVICES"] = ""
    env.update(extra)
    return env


@contextmanager
def running_kernel(extra_env: Mapping[str, str]) -> Iterator[Kernel]:
    """A real kernel with ``--ext=jupyter_gpufrac.kernel`` and the given GPUFRAC_* env."""
    km = KernelManager(kernel_name="python3")
    # The stock kernelspec says "python", which jupyter_client maps to sys.executable.
    km.start_kernel(extra_arguments=["--ext=jupyter_gpufrac.kernel"], env=kernel_env(extra_env))
    kernel = Kernel(km)
    try:
        yield kernel
    finally:
        kernel.client.stop_channels()
        km.shutdown_kernel(now=True)
