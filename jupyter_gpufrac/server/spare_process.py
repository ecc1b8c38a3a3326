"""Inside a spare kernel process: import, get ready for one launch, then become that kernel.

Runs in the spare (see :mod:`spares`), which never imports the server. What it imports ahead of
a launch is only what is installed: nothing the user wrote runs in it before the kernel's own
restore does.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import site
import sys
import sysconfig
import threading
import time
from typing import Any


def installed_roots() -> list[str]:
    """The folders installed packages live in: the interpreter's library, its site-packages and
    the user's (pip's ``--user``), as real paths."""
    paths = sysconfig.get_paths()
    roots = [paths[name] for name in ("stdlib", "platstdlib", "purelib", "platlib") if name in paths]
    roots += site.getsitepackages() if hasattr(site, "getsitepackages") else []
    if site.ENABLE_USER_SITE:
        roots.append(site.getusersitepackages())
    return sorted({os.path.realpath(root) for root in roots if root})


def _inside(path: str, roots: list[str]) -> bool:
    real = os.path.realpath(path)
    return any(real == root or real.startswith(root + os.sep) for root in roots)


def importable(name: str, roots: list[str]) -> str | None:
    """None when top-level package ``name`` may be imported ahead of a launch, else why not.

    Only an installed package may: one found in the notebook's folder, on a ``PYTHONPATH`` of
    the user's or installed in development mode (``pip install -e``) is the user's own code,
    and runs only when the kernel itself imports it. Finding it runs none of its code.
    """
    if not name.isidentifier() or name.startswith("_"):
        return "not a package name"
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError) as err:
        return f"not found: {err}"
    if spec is None:
        return "not installed here"
    places = ([spec.origin] if spec.origin and spec.has_location else []) + list(
        spec.submodule_search_locations or [])
    if not places:
        return "not a package on disk"
    outside = [place for place in places if not _inside(place, roots)]
    if outside:
        return f"not an installed package ({outside[0]}): it is imported by the kernel itself"
    return None


class Status:
    """The spare's status pipe to the server: one JSON line per message, from either thread;
    nothing is said once it is closed (the spare became a kernel)."""

    def __init__(self, fd: int) -> None:
        self._file = os.fdopen(fd, "w", encoding="utf-8")
        self._lock = threading.Lock()

    def say(self, message: dict[str, Any]) -> None:
        with self._lock:
            if not self._file.closed:
                self._file.write(json.dumps(message) + "\n")
                self._file.flush()

    def close(self) -> None:
        with self._lock:
            self._file.close()


class Importer:
    """Imports, in a thread of its own, the installed packages a launch's kernel had imported,
    in their order, so the spare goes on reading its orders: a launch that comes meanwhile
    stops it after the package in progress (which goes on beside the kernel's start, as it
    would in the kernel) rather than waiting for the rest."""

    def __init__(self, status: Status) -> None:
        self._status = status
        self._roots = installed_roots()
        self._lock = threading.Lock()
        self._queue: list[str] = []
        self._stopped = False
        self._thread: threading.Thread | None = None
        self._began = time.monotonic()
        self.imported: list[str] = []
        self.skipped: dict[str, str] = {}
        self.failed: dict[str, str] = {}
        self.cuda: str | None = None
        self.cuda_error: str | None = None

    def add(self, names: list[str]) -> None:
        """Import ``names`` too (those not imported already), after the ones queued."""
        with self._lock:
            self._queue += [n for n in names if n not in self._queue]
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="gpufrac-spare-imports",
                                                daemon=True)
                self._thread.start()

    def load(self, name: str) -> None:
        """Import one package, if installed; what happened is kept."""
        why = importable(name, self._roots)
        if why is not None:
            self.skipped[name] = why
            return
        try:
            importlib.import_module(name)
        except (Exception, SystemExit) as err:  # the kernel will meet it again: say so
            self.failed[name] = f"{type(err).__name__}: {err}"[:300]
            return
        self.imported.append(name)

    def _next(self) -> str | None:
        with self._lock:
            while self._queue and not self._stopped:
                name = self._queue.pop(0)
                if name not in sys.modules and name not in self.skipped and name not in self.failed:
                    return name
            if not self._stopped:
                self._thread = None
            return None

    def _run(self) -> None:
        while (name := self._next()) is not None:
            self.load(name)
        with self._lock:  # stopped, the launch said what was done: nothing more from here
            if not self._stopped:
                self._status.say(self.summary())

    def stop(self) -> dict[str, Any]:
        """The launch is there: no more imports after the one in progress; what was done."""
        with self._lock:
            self._stopped = True
            left = [n for n in self._queue if n not in sys.modules]
        return {**self.summary(), "left": left}

    def summary(self) -> dict[str, Any]:
        """What was done since the first ``prepare``, for the server (the latest it reads
        stands)."""
        return {"prepared": True, "seconds": time.monotonic() - self._began,
                "imported": list(self.imported), "skipped": dict(self.skipped),
                "failed": dict(self.failed), "left": [], "cuda": self.cuda,
                "cuda_error": self.cuda_error}


def prepare(order: dict[str, Any], importer: Importer) -> None:
    """Get ready for one launch: its GPU variables set (``env``: CUDA_VISIBLE_DEVICES and the
    frameworks' caps, read when a framework first touches the GPU), CUDA's context made on the
    GPU it names where torch sees one (torch imported first if the kernel had it), then the
    packages the kernel had imported (``imports``) imported in the background by
    ``importer``, which says what it did once done."""
    env = {str(k): str(v) for k, v in dict(order.get("env") or {}).items()}
    os.environ.update(env)
    names = [str(n) for n in order.get("imports") or []]
    if env.get("CUDA_VISIBLE_DEVICES") and importer.cuda is None:
        if "torch" in names and "torch" not in sys.modules:
            importer.load("torch")
        importer.cuda, importer.cuda_error = _cuda_context()
    importer.add(names)


def _cuda_context() -> tuple[str | None, str | None]:
    """Make CUDA's context on the GPU the launch runs on, with the restore's pinned buffers,
    where torch is imported and sees one: (the device's name, or None; what failed, or None)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None, None
    try:
        if not torch.cuda.is_available():
            return None, None
        torch.empty(1, device="cuda")
        torch.cuda.synchronize()
        from jupyter_gpufrac.kernel import stream

        stream.ring()  # pinning takes the driver a while: not in the restore's way
        return str(torch.cuda.get_device_name()), None
    except Exception as err:  # the kernel meets it again, and says so
        return None, f"{type(err).__name__}: {err}"[:300]


def spare_main() -> None:
    """In the spare (spares.BOOTSTRAP): import, say ready, then read orders on stdin, one JSON
    line each -- ``prepare`` any number of times, then ``launch``: become that kernel.

    Never touches CUDA before a ``prepare`` names a GPU. The orders come on stdin, a pipe only
    the server holds; EOF before a launch (the server stopped, or died) ends the spare.
    """
    status = Status(int(sys.argv[1]))
    began, start_env = time.monotonic(), dict(os.environ)
    failed: dict[str, str] = {}
    for name in json.loads(sys.argv[2]):
        try:
            importlib.import_module(name)
        except (Exception, SystemExit) as err:  # the kernel will not have it either: say so
            failed[name] = f"{type(err).__name__}: {err}"
    status.say({"ready": True, "seconds": time.monotonic() - began, "failed": failed})
    launch: dict[str, Any] | None = None
    importer: Importer | None = None
    prepared: set[str] = set()  # variables a prepare set: the launch sets them itself
    for line in iter(sys.stdin.buffer.readline, b""):
        try:
            message = json.loads(line)
            if "prepare" in message:
                order = dict(message["prepare"])
                prepared.update(str(k) for k in dict(order.get("env") or {}))
                importer = importer or Importer(status)
                prepare(order, importer)
                continue
            launch = dict(message["launch"])
            argv = [str(arg) for arg in launch["argv"]]
            env = {str(k): str(v) for k, v in dict(launch["env"]).items()}
            if len(argv) < 3 or argv[1] != "-m":
                raise ValueError(f"expected [python, -m, module, ...], got {argv[:3]}")
            os.chdir(str(launch["cwd"]))
        except Exception as err:
            status.say({"error": f"{type(err).__name__}: {err}"})
            raise SystemExit(1) from err
        break
    if launch is None:
        return
    if importer is not None:
        status.say(importer.stop())
    # The environment of the launch, wholly (CUDA_VISIBLE_DEVICES and GPUFRAC_* included), and
    # what the imports changed in it, as they would have in a kernel that imported them itself.
    env.update({k: v for k, v in os.environ.items()
                if start_env.get(k) != v and k not in prepared})
    for name in set(start_env) - set(os.environ):
        env.pop(name, None)
    # Never empty meanwhile: the import in progress, if any, may read it.
    for name in set(os.environ) - set(env):
        del os.environ[name]
    os.environ.update(env)
    status.say({"started": True})
    status.close()
    # As `python -m module args`: runpy sets argv[0] to the module's file, __main__ to it.
    sys.argv = [argv[0], *argv[3:]]
    import runpy

    runpy.run_module(argv[2], run_name="__main__", alter_sys=True)
