"""Run a callback right after ``import torch`` finishes, even when a cell imports it mid-way."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import logging
import sys
import threading
import types
from collections.abc import Callable, Sequence
from typing import Any

log = logging.getLogger(__name__)


class _CallbackLoader(importlib.abc.Loader):
    """Delegates to the real loader, then runs the callback and puts the real loader back."""

    def __init__(self, real: Any, callback: Callable[[types.ModuleType], None]) -> None:
        self._real = real
        self._callback = callback

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        module: types.ModuleType | None = self._real.create_module(spec)
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        # The module must look exactly as if we were never there (importlib.resources and
        # friends use __loader__ / __spec__.loader).
        module.__loader__ = self._real
        if module.__spec__ is not None:
            module.__spec__.loader = self._real
        self._real.exec_module(module)
        try:
            self._callback(module)
        except Exception:  # the user's import must succeed whatever our callback does
            log.exception("gpufrac: the after-import hook for %s failed", module.__name__)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


class ImportWatcher(importlib.abc.MetaPathFinder):
    """A meta path finder that only wraps the loader of the watched top-level modules."""

    def __init__(self, names: Sequence[str], callback: Callable[[types.ModuleType], None]) -> None:
        self._names = set(names)
        self._callback = callback
        self._local = threading.local()

    def find_spec(
        self, fullname: str, path: Sequence[str] | None = None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in self._names or getattr(self._local, "busy", False):
            return None
        self._local.busy = True  # find the real spec through the other finders
        try:
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    break
            else:
                return None
        finally:
            self._local.busy = False
        if spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _CallbackLoader(spec.loader, self._callback)
        return spec

    def install(self) -> None:
        """Put the watcher first on ``sys.meta_path``."""
        if self not in sys.meta_path:
            sys.meta_path.insert(0, self)

    def uninstall(self) -> None:
        """Take the watcher off ``sys.meta_path``."""
        while self in sys.meta_path:
            sys.meta_path.remove(self)
