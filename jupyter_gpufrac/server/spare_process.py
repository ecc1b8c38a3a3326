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
import select
import site
import sys
import sysconfig
import time
from collections.abc import Callable
from typing import Any


def _say(status: Any, message: dict[str, Any]) -> None:
    status.write(json.dumps(message) + "\n")
    status.flush()


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


class Orders:
    """The order lines on stdin (fd 0), read without a buffer that could hide one: a launch that
    arrives while a preparation imports is seen between two imports."""

    def __init__(self, fd: int = 0) -> None:
        self._fd = fd
        self._buffer = b""
        self._eof = False

    def _read(self, timeout: float | None) -> None:
        ready, _, _ = select.select([self._fd], [], [], timeout)
        if ready:
            chunk = os.read(self._fd, 65536)
            self._buffer += chunk
            self._eof = not chunk

    def waiting(self) -> bool:
        """Whether a whole line (or EOF) is there to read now."""
        if b"\n" not in self._buffer and not self._eof:
            self._read(0)
        return b"\n" in self._buffer or self._eof

    def next(self) -> bytes:
        """The next line, waiting for it; b"" at EOF."""
        while b"\n" not in self._buffer and not self._eof:
            self._read(None)
        line, sep, self._buffer = self._buffer.partition(b"\n")
        return line + sep


def prepare(order: dict[str, Any], interrupted: Callable[[], bool] = lambda: False
            ) -> dict[str, Any]:
    """Get ready for one launch: its GPU variables set (``env``: CUDA_VISIBLE_DEVICES and the
    frameworks' caps, read when a framework first touches the GPU), CUDA's context made on the
    GPU it names where torch sees one, then the packages the kernel had imported (``imports``)
    imported where installed, until ``interrupted()`` says the launch is there: it does not
    wait for them (the kernel imports what it uses). What was done, for the server."""
    began = time.monotonic()
    env = {str(k): str(v) for k, v in dict(order.get("env") or {}).items()}
    os.environ.update(env)
    names = [str(n) for n in order.get("imports") or []]
    roots = installed_roots()
    imported: list[str] = []
    skipped: dict[str, str] = {}
    failed: dict[str, str] = {}
    left: list[str] = []

    def load(name: str) -> None:
        why = importable(name, roots)
        if why is not None:
            skipped[name] = why
            return
        try:
            importlib.import_module(name)
        except (Exception, SystemExit) as err:  # the kernel will meet it again: say so
            failed[name] = f"{type(err).__name__}: {err}"[:300]
            return
        imported.append(name)

    cuda = cuda_error = None
    if env.get("CUDA_VISIBLE_DEVICES"):
        if "torch" in names and "torch" not in sys.modules:
            load("torch")
        cuda, cuda_error = _cuda_context()
    for position, name in enumerate(names):
        if name in sys.modules or name in skipped or name in failed:
            continue
        if interrupted():
            left = [n for n in names[position:] if n not in sys.modules]
            break
        load(name)
    return {"prepared": True, "seconds": time.monotonic() - began, "imported": imported,
            "skipped": skipped, "failed": failed, "left": left, "cuda": cuda,
            "cuda_error": cuda_error}


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
    status = os.fdopen(int(sys.argv[1]), "w", encoding="utf-8")
    began, start_env = time.monotonic(), dict(os.environ)
    failed: dict[str, str] = {}
    for name in json.loads(sys.argv[2]):
        try:
            importlib.import_module(name)
        except (Exception, SystemExit) as err:  # the kernel will not have it either: say so
            failed[name] = f"{type(err).__name__}: {err}"
    _say(status, {"ready": True, "seconds": time.monotonic() - began, "failed": failed})
    launch: dict[str, Any] | None = None
    prepared: set[str] = set()  # variables a prepare set: the launch sets them itself
    orders = Orders()
    for line in iter(orders.next, b""):
        try:
            message = json.loads(line)
            if "prepare" in message:
                order = dict(message["prepare"])
                prepared.update(str(k) for k in dict(order.get("env") or {}))
                _say(status, prepare(order, orders.waiting))
                continue
            launch = dict(message["launch"])
            argv = [str(arg) for arg in launch["argv"]]
            env = {str(k): str(v) for k, v in dict(launch["env"]).items()}
            if len(argv) < 3 or argv[1] != "-m":
                raise ValueError(f"expected [python, -m, module, ...], got {argv[:3]}")
            os.chdir(str(launch["cwd"]))
        except Exception as err:
            _say(status, {"error": f"{type(err).__name__}: {err}"})
            raise SystemExit(1) from err
        break
    if launch is None:
        return
    # The environment of the launch, wholly (CUDA_VISIBLE_DEVICES and GPUFRAC_* included), and
    # what the imports changed in it, as they would have in a kernel that imported them itself.
    env.update({k: v for k, v in os.environ.items()
                if start_env.get(k) != v and k not in prepared})
    for name in set(start_env) - set(os.environ):
        env.pop(name, None)
    os.environ.clear()
    os.environ.update(env)
    _say(status, {"started": True})
    status.close()
    # As `python -m module args`: runpy sets argv[0] to the module's file, __main__ to it.
    sys.argv = [argv[0], *argv[3:]]
    import runpy

    runpy.run_module(argv[2], run_name="__main__", alter_sys=True)
