"""What a cell's error means here, said with its traceback: a cut-off by a move, a GPU memory failure."""

from __future__ import annotations

import contextlib
import sys
from typing import TYPE_CHECKING, Any

from jupyter_gpufrac.kernel import messages, torch_adapter
from jupyter_gpufrac.kernel.agent_client import make_client

if TYPE_CHECKING:
    from jupyter_gpufrac.kernel.hook import GpuFracHook


def error_handler(hook: GpuFracHook) -> Any:
    """A ``set_custom_exc`` handler: the usual traceback, after what a cut-off cell means and
    before what a GPU memory failure means here (other errors of the same classes are shown
    as IPython would)."""

    def handler(shell: Any, etype: type, value: BaseException, tb: Any,
                tb_offset: int | None = None) -> None:
        stb: list[str] = shell.InteractiveTB.structured_traceback(
            etype, value, tb, tb_offset=tb_offset
        )
        if isinstance(value, KeyboardInterrupt):
            # The user reads why first; the traceback only says where the cell was.
            if hook.moving():
                stb = [cut_off_text(hook), *stb]
            extra: list[str] = []
        else:
            source = messages.oom_source(value)
            extra = [] if source is None else [oom_explanation(hook, value, source)]
        # IPython ignores what a custom handler returns; _showtraceback is what showtraceback
        # ends with, and ipykernel turns it into the cell's error output and the reply.
        show = getattr(shell, "_showtraceback", None)
        if show is not None:
            show(etype, value, [*stb, *extra])
        else:
            print(shell.InteractiveTB.stb2text(stb), file=sys.stderr)
            print(*extra, file=sys.stderr)

    return handler


def cut_off_text(hook: GpuFracHook) -> str:
    """Why the running cell stopped, said before its traceback."""
    running = hook._running or {}
    cell = running.get("cell") or "this cell"
    return (f"gpufrac: cell {cell} was cut off because this kernel is moving to another "
            "GPU and the cell did not end in time. After the move the variables are as "
            "they were before this cell; re-run it then.")


def oom_explanation(hook: GpuFracHook, error: BaseException, source: str) -> str:
    """What a GPU memory failure means for this kernel: whose memory ran out, and why."""
    reserved = torch_adapter.reserved_bytes()
    shares: list[dict[str, Any]] = []
    if hook.env.has_lease:
        with contextlib.suppress(Exception):  # the explanation must come, agent or not
            node = make_client(hook.env.agent_socket, timeout=2.0).node()
            gpus: list[dict[str, Any]] = node.get("gpus", [])
            gpu = next((g for g in gpus if g.get("uuid") == hook.env.gpu_uuid), {})
            shares = list(gpu.get("shares", []))
    cause = messages.oom_cause(
        wanted=messages.oom_wanted(error), reserved=reserved, cap=hook.cap,
        gpu_free=torch_adapter.free_bytes(), shares=shares, own_lease=hook.env.lease_id,
    )
    return messages.oom_explanation(
        request=hook.request, limit=hook.limit,
        total=hook.env.gpu_total or torch_adapter.device_total(),
        reserved=reserved, allocated=torch_adapter.allocated_bytes(), cap=hook.cap,
        shrunk=hook.state.shrinking, has_lease=hook.env.has_lease, source=source,
        cause=cause,
    )
