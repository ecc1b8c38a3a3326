"""Run a callback right after a module is imported (at once if it already is), via wrapt."""

from __future__ import annotations

import logging
import types
from collections.abc import Callable

import wrapt

log = logging.getLogger(__name__)


def after_import(name: str, callback: Callable[[types.ModuleType], None]) -> Callable[[], None]:
    """Call ``callback(module)`` once module ``name`` has finished importing, even when a
    cell imports it mid-way; returns what turns the callback off (wrapt keeps hooks for
    good). A failing callback is logged: the user's import must succeed whatever it does."""
    active = True

    def run(module: types.ModuleType) -> None:
        if not active:
            return
        try:
            callback(module)
        except Exception:
            log.exception("gpufrac: the after-import hook for %s failed", name)

    wrapt.register_post_import_hook(run, name)

    def off() -> None:
        nonlocal active
        active = False

    return off
