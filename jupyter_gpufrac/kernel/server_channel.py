"""The kernel's end of the server's questions: a comm target that answers each ask once."""

from __future__ import annotations

from typing import Any

from jupyter_gpufrac import contract


def answer(hook: Any, data: Any) -> dict[str, Any]:
    """The answer to one ask (``{"ask": "checkpoint"}``); unknown asks name what is expected."""
    from jupyter_gpufrac.kernel.checkpoint import CheckpointError

    ask = data.get("ask") if isinstance(data, dict) else None
    if ask == contract.ASK_CHECKPOINT:
        try:
            return {"ok": True, "checkpoint": hook.checkpoint(trigger="server").to_json()}
        except CheckpointError as exc:
            return {"ok": False, "error": str(exc)}
    if ask == contract.ASK_RESTORE_REPORT:
        return {"ok": True, "report": hook.restore_report}
    if ask == contract.ASK_PARK:
        try:
            return {"ok": True, **hook.park_for_server()}
        except CheckpointError as exc:
            return {"ok": False, "error": str(exc)}
    return {"ok": False, "error": f"ask: expected one of {', '.join(contract.ASKS)}, got {ask!r}"}


def _manager() -> Any:
    try:
        from comm import get_comm_manager

        return get_comm_manager()
    except Exception:  # not inside ipykernel (plain IPython): nobody can ask
        return None


def register(hook: Any) -> bool:
    """Answer the server's comms; False where the kernel has no comm manager."""
    manager = _manager()
    if manager is None:
        return False

    def opened(comm: Any, msg: dict[str, Any]) -> None:
        # Shell messages are handled between cells, so a checkpoint here sees a settled namespace.
        # The asker closes the comm: a close from here would reach every frontend on IOPub,
        # and JupyterLab reports a close of a comm it never saw as an error.
        comm.send(answer(hook, msg.get("content", {}).get("data")))

    def checkpoint_status(stream: Any, ident: Any, parent: dict[str, Any]) -> None:
        # In ipykernel's control thread: answered while a cell runs too.
        hook.ip.kernel.session.send(stream, contract.CHECKPOINT_STATUS_REPLY,
                                    hook.checkpointer.status(), parent, ident)

    manager.register_target(contract.COMM_TARGET, opened)
    _control_handlers(hook)[contract.CHECKPOINT_STATUS_REQUEST] = checkpoint_status
    return True


def _control_handlers(hook: Any) -> dict[str, Any]:
    """ipykernel's handlers of control requests (a throwaway dict outside ipykernel)."""
    handlers = getattr(getattr(hook.ip, "kernel", None), "control_handlers", None)
    return handlers if isinstance(handlers, dict) else {}


def unregister(hook: Any) -> None:
    """Stop answering (the extension is unloaded)."""
    manager = _manager()
    if manager is not None:
        manager.targets.pop(contract.COMM_TARGET, None)
    _control_handlers(hook).pop(contract.CHECKPOINT_STATUS_REQUEST, None)
