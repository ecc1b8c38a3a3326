"""IPython extension that makes a notebook kernel a first-class citizen of a shared GPU."""

from __future__ import annotations

import logging
import os
from typing import Any

from jupyter_gpufrac.kernel import env as kenv

log = logging.getLogger(__name__)

_hook: Any = None  # the GpuFracHook of this kernel, while the extension is loaded


def _connection_file() -> str | None:
    try:
        from ipykernel.connect import get_connection_file

        return str(get_connection_file())
    except Exception:  # not running inside ipykernel (plain IPython, tests)
        return None


def load_ipython_extension(ip: Any) -> None:
    """``--ext=jupyter_gpufrac.kernel`` / ``%load_ext jupyter_gpufrac.kernel``."""
    global _hook
    if _hook is not None:
        return
    from jupyter_gpufrac.kernel.hook import GpuFracHook
    from jupyter_gpufrac.kernel.magics import GpuMagic

    environment = kenv.parse(os.environ, _connection_file())
    hook = GpuFracHook(ip, environment)
    magic = GpuMagic(hook)
    ip.register_magic_function(magic, magic_kind="line", magic_name="gpu")
    _hook = hook
    hook.start()
    for problem in environment.problems:
        log.warning("gpufrac: %s", problem)


def unload_ipython_extension(ip: Any) -> None:
    """``%unload_ext jupyter_gpufrac.kernel``."""
    global _hook
    if _hook is None:
        return
    _hook.stop()
    ip.magics_manager.magics["line"].pop("gpu", None)
    _hook = None


def checkpoint_now(*, full: bool = False) -> dict[str, Any]:
    """Checkpoint this kernel's namespace now; returns the summary (raises CheckpointError)."""
    if _hook is None:
        raise RuntimeError("jupyter_gpufrac.kernel is not loaded in this kernel")
    return dict(_hook.checkpoint(full=full).to_json())


def summary() -> dict[str, Any]:
    """This kernel's gpufrac state (lease, cap, last checkpoint, last restore) as a dict."""
    if _hook is None:
        return {"loaded": False}
    return {"loaded": True, **_hook.summary()}
