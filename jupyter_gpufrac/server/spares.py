"""Pre-warmed spare kernel processes that a move or a recovery adopts instead of a cold start."""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from jupyter_gpufrac import contract

MIB = 2**20
# What a spare is expected to hold before one was measured (python + ipykernel + debugpy is
# about 45 MiB; with a CPU build of torch about 240 MiB, a CUDA build maps more).
SPARE_RSS_WITH_TORCH = 512 * MIB
SPARE_RSS_WITHOUT = 96 * MIB
# A spare is started only while the memory available is at least this many spares.
MEMORY_FACTOR = 8
# A ready spare is stopped when available memory falls below this many spares.
MEMORY_FLOOR_FACTOR = 2
# Spares start a little after the launch that wanted them, not in its way (CPU, disk).
START_DELAY_S = 2.0
# How long a launch waits for a spare that is still importing before starting cold.
READY_WAIT_S = 2.0
# How long the spare may take to take its launch order.
ORDER_ACK_S = 5.0
# A spare not ready by then is stuck: it is reaped.
READY_DEADLINE_S = 120.0
# Spares of one kernelspec that die before they are ready: after this many, none are started.
MAX_FAILURES = 3
# How often a ready spare is looked at (alive, memory).
WATCH_EVERY_S = 5.0
POLL_S = 0.005

# The modules a kernel imports at start, imported by every spare of an ipykernel kernelspec.
KERNEL_MODULES = ("ipykernel.kernelapp", "ipykernel.debugger")
# With our extension: the kernel hook and what a restore uses.
HOOK_MODULES = ("jupyter_gpufrac.kernel.hook", "jupyter_gpufrac.kernel.magics")
LAUNCHER_MODULES = ("ipykernel_launcher", "ipykernel")
# Variables every launch sets anew: a spare can take any value of them, since nothing it
# imports reads them (CUDA reads CUDA_VISIBLE_DEVICES when it initialises, not at import).
# JPY_PARENT_PID is not one: ipykernel reads it at import (its parent poller's default).
PER_LAUNCH = frozenset({*contract.LAUNCH_VARIABLES, "CUDA_VISIBLE_DEVICES", "JPY_SESSION_NAME"})
# The spare's side. The current folder ('') leaves sys.path first, as in ipykernel_launcher:
# nothing is imported from wherever the server runs.
BOOTSTRAP = (
    "import sys; sys.path = sys.path[1:] if sys.path[:1] == [''] else sys.path; "
    "from jupyter_gpufrac.server.spares import spare_main; spare_main()"
)


def expected_rss(imports: Iterable[str]) -> int:
    """What one spare is expected to hold in memory before one was measured."""
    return SPARE_RSS_WITH_TORCH if "torch" in imports else SPARE_RSS_WITHOUT


def available_memory() -> int:
    """Memory the machine can give without swapping (psutil's ``available``)."""
    import psutil

    return int(psutil.virtual_memory().available)


def default_enabled(imports: Iterable[str], available: int | None = None) -> bool:
    """The default of ``c.GpuFrac.spare_kernels``: on when the memory available now is at least
    MEMORY_FACTOR spares' worth."""
    free = available_memory() if available is None else available
    return free >= MEMORY_FACTOR * expected_rss(imports)


def python_executable(argv0: str) -> str:
    """The interpreter a kernelspec's argv[0] names, as jupyter_client resolves it."""
    major, minor = sys.version_info[:2]
    if argv0 in ("python", f"python{major}", f"python{major}.{minor}"):
        return sys.executable
    return os.path.expanduser(argv0)


@dataclass(frozen=True)
class SpareKey:
    """Which launches a spare can serve: one interpreter, one launcher module, one kernelspec env."""

    executable: str
    module: str
    spec_env: tuple[tuple[str, str], ...]
    imports: tuple[str, ...]


def spare_env(key: SpareKey, base: Mapping[str, str]) -> dict[str, str]:
    """The spare's environment until its order: the server's with the kernelspec's, no launch's.

    ``CUDA_VISIBLE_DEVICES=""``: should anything initialise CUDA before the order anyway, it
    finds no GPU rather than someone else's.
    """
    env = {k: v for k, v in base.items() if k not in PER_LAUNCH and not k.startswith("GPUFRAC_")}
    env.update(dict(key.spec_env))
    env.pop("PYTHONEXECUTABLE", None)  # as jupyter_client's _finalize_env
    env["CUDA_VISIBLE_DEVICES"] = ""
    # What jupyter_client's launch_kernel gives a kernel of this server (read at import).
    env["JPY_PARENT_PID"] = str(os.getpid())
    return env


def env_differences(spare: Mapping[str, str], launch: Mapping[str, str]) -> list[str]:
    """Names (never values: they may be secrets) of variables a launch wants otherwise than the
    spare started with, other than the per-launch ones."""
    names = (set(spare) | set(launch)) - PER_LAUNCH
    return sorted(n for n in names if not n.startswith("GPUFRAC_") and spare.get(n) != launch.get(n))


class Spare:
    """One spare process: importing, ready, then given one launch order (or reaped)."""

    def __init__(self, key: SpareKey, process: subprocess.Popen[bytes], status_fd: int,
                 env: dict[str, str]) -> None:
        self.key = key
        self.process = process
        self.env = env
        self.started = time.monotonic()
        self.ready_info: dict[str, Any] | None = None
        self.messages: list[dict[str, Any]] = []
        self._fd: int | None = status_fd
        self._pending = b""

    @property
    def pid(self) -> int:
        return int(self.process.pid)

    def alive(self) -> bool:
        return self.process.poll() is None

    def read_status(self) -> None:
        """Take in what the spare said on its status pipe (never blocks)."""
        while self._fd is not None:
            try:
                chunk = os.read(self._fd, 65536)
            except BlockingIOError:
                return
            except OSError:
                chunk = b""
            if not chunk:
                self.close_status()
                return
            *lines, self._pending = (self._pending + chunk).split(b"\n")
            for line in lines:
                try:
                    message = json.loads(line)
                except ValueError:
                    continue
                if isinstance(message, dict):
                    self.messages.append(message)
                    if message.get("ready"):
                        self.ready_info = message

    def ready(self) -> bool:
        self.read_status()
        return self.ready_info is not None and self.alive()

    def close_status(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = None

    def kill(self) -> None:
        """SIGKILL its process group (a spare holds nothing worth a polite stop)."""
        self.close_status()
        if self.process.returncode is None:  # not reaped: the pid is still its own
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except OSError:
                with contextlib.suppress(OSError):
                    self.process.kill()
        if self.process.stdin is not None:
            with contextlib.suppress(OSError):
                self.process.stdin.close()

    async def reap(self, timeout: float = 5.0) -> None:
        """Kill and wait for it, so no zombie or orphan is left."""
        self.kill()
        deadline = time.monotonic() + timeout
        while self.process.poll() is None and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        if self.process.poll() is None:
            await asyncio.get_running_loop().run_in_executor(None, self.process.wait)

    async def wait_ready(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while not self.ready():
            if not self.alive() or time.monotonic() >= deadline:
                return False
            await asyncio.sleep(POLL_S * 4)
        return True

    async def order(self, argv: Sequence[str], env: Mapping[str, str], cwd: str) -> str | None:
        """Send the launch order and wait for the spare to take it; None, or what went wrong."""
        stdin = self.process.stdin
        if stdin is None:
            return "no order pipe"
        payload = json.dumps({"argv": list(argv), "env": dict(env), "cwd": cwd}).encode()
        seen = len(self.messages)

        def send() -> None:
            # The close ends the order: the spare reads until EOF, then fd 0 stays at EOF, as a
            # normal kernel's stdin does (jupyter_client closes it at once).
            stdin.write(payload)
            stdin.close()

        try:
            await asyncio.wait_for(asyncio.get_running_loop().run_in_executor(None, send),
                                   ORDER_ACK_S)
        except (OSError, ValueError) as err:
            return f"the order pipe broke ({err})"
        except asyncio.TimeoutError:
            return "the spare did not read its order"
        deadline = time.monotonic() + ORDER_ACK_S
        while True:
            self.read_status()
            for message in self.messages[seen:]:
                if message.get("started"):
                    self.close_status()
                    return None
                if message.get("error"):
                    return f"the spare refused its order: {message['error']}"
            if self._fd is None:
                return f"the spare exited (status {self.process.poll()})"
            if time.monotonic() >= deadline:
                return "the spare did not take its order in time"
            await asyncio.sleep(POLL_S)


class SparePool:
    """At most one ready spare per kernelspec in use, and at most ``max_spares`` in all.

    Everything runs on the server's event loop. A spare is started in the background a little
    after a launch of its kernelspec (so one is ready before the first move), and again after
    one was adopted. Spares are reaped by :meth:`stop`; should the server die without it, each
    spare reads EOF on its order pipe and exits by itself.
    """

    def __init__(self, imports: Sequence[str], max_spares: int, log: logging.Logger, *,
                 start_delay: float = START_DELAY_S, ready_wait: float = READY_WAIT_S) -> None:
        self.imports = tuple(dict.fromkeys(str(name) for name in imports))
        self.max_spares = max(0, int(max_spares))
        self.log = log
        self.start_delay = start_delay
        self.ready_wait = ready_wait
        self.stopped = False
        self.adopted = 0
        self._spares: dict[SpareKey, Spare] = {}
        self._starting: dict[SpareKey, asyncio.Task[None]] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._failures: dict[SpareKey, int] = {}
        self._rss: dict[SpareKey, int] = {}
        # How long the last spare of each key took to be ready after it was started.
        self._ready_seconds: dict[SpareKey, float] = {}
        self._said: set[str] = set()
        log.info("gpufrac: spare kernels on: up to %d, pre-importing %s", self.max_spares,
                 ", ".join(self.imports) or "nothing besides ipykernel")

    # -- which launches ------------------------------------------------------------------

    def key_for(self, argv: Sequence[str], spec_env: Mapping[str, str] | None,
                load_extension: bool) -> SpareKey | None:
        """The key of a kernelspec a spare can serve: ``[python, -m, ipykernel_launcher, ...]``."""
        argv = [str(arg) for arg in argv]
        if len(argv) < 3 or argv[1] != "-m" or argv[2] not in LAUNCHER_MODULES or "{" in argv[0]:
            return None
        imports = (*KERNEL_MODULES, *(HOOK_MODULES if load_extension else ()), *self.imports)
        env = tuple(sorted((str(k), str(v)) for k, v in (spec_env or {}).items()))
        return SpareKey(python_executable(argv[0]), argv[2], env, tuple(dict.fromkeys(imports)))

    def spare(self, key: SpareKey) -> Spare | None:
        """The spare kept for ``key``, ready or not."""
        return self._spares.get(key)

    def pids(self) -> list[int]:
        return [spare.pid for spare in self._spares.values()]

    # -- starting ------------------------------------------------------------------------

    def want(self, key: SpareKey) -> None:
        """Make sure a spare for ``key`` exists or is on its way (in the background)."""
        if self.stopped or self.max_spares == 0 or key in self._starting:
            return
        spare = self._spares.get(key)
        if spare is not None:
            if spare.alive():
                return
            self._forget(spare, f"exited with status {spare.process.returncode}")
        if self._failures.get(key, 0) >= MAX_FAILURES:
            self._say_once(f"gave up {key}", "gpufrac: no more spare kernels for %s: %d failed "
                           "to start (see the log above)", key.executable, MAX_FAILURES)
            return
        if len(self._spares) + len(self._starting) >= self.max_spares:
            self._say_once("full", "gpufrac: %d spare kernels kept (c.GpuFrac.max_spare_kernels); "
                           "no spare for %s", self.max_spares, key.executable)
            return
        task = asyncio.get_running_loop().create_task(self._start_later(key))
        self._starting[key] = task
        self._track(task)

    async def _start_later(self, key: SpareKey) -> None:
        try:
            await asyncio.sleep(self.start_delay)
            if self.stopped or key in self._spares:
                return
            rss = self._rss.get(key) or expected_rss(key.imports)
            available = available_memory()
            if available < MEMORY_FACTOR * rss:
                self._say_once("memory", "gpufrac: no spare kernel started: %d MiB available, "
                               "less than %d spares of %d MiB", available // MIB, MEMORY_FACTOR,
                               rss // MIB)
                return
            spare = self._start(key)
            if spare is not None:
                self._spares[key] = spare
                self._track(asyncio.get_running_loop().create_task(self._watch(spare)))
        finally:
            self._starting.pop(key, None)

    def _start(self, key: SpareKey) -> Spare | None:
        env = spare_env(key, os.environ)
        read_fd, write_fd = os.pipe()
        try:
            process = subprocess.Popen(
                [key.executable, "-c", BOOTSTRAP, str(write_fd), json.dumps(list(key.imports))],
                stdin=subprocess.PIPE, env=env, pass_fds=(write_fd,),
                # Its own session and process group, as jupyter_client starts kernels: an
                # interrupt or a kill of the adopted kernel reaches what it started too.
                start_new_session=True,
            )
        except OSError as err:
            os.close(read_fd)
            self._failures[key] = self._failures.get(key, 0) + 1
            self.log.warning("gpufrac: could not start a spare kernel with %s: %s", key.executable, err)
            return None
        finally:
            os.close(write_fd)
        os.set_blocking(read_fd, False)
        self.log.info("gpufrac: starting spare kernel %s (%s, pre-importing %s)", process.pid,
                      key.executable, ", ".join(key.imports))
        return Spare(key, process, read_fd, env)

    async def _watch(self, spare: Spare) -> None:
        """Say when it is ready; reap it when it dies, gets stuck, or memory runs short."""
        ready = await spare.wait_ready(READY_DEADLINE_S)
        key = spare.key
        if self._spares.get(key) is not spare:
            return  # adopted or reaped meanwhile
        if not ready:
            self._failures[key] = self._failures.get(key, 0) + 1
            self._forget(spare, "was not ready in time" if spare.alive() else
                         f"exited with status {spare.process.poll()} before it was ready")
            await spare.reap()
            return
        self._failures.pop(key, None)
        self._ready_seconds[key] = time.monotonic() - spare.started
        info = spare.ready_info or {}
        rss = _rss(spare.pid)
        if rss:
            self._rss[key] = rss
        self.log.info("gpufrac: spare kernel %s ready in %.1f s (%d MiB)", spare.pid,
                      float(info.get("seconds") or 0.0), rss // MIB)
        failed = info.get("failed") or {}
        if failed:
            self._say_once(f"failed {key}", "gpufrac: spare kernels of %s could not import %s",
                           key.executable, "; ".join(f"{k}: {v}" for k, v in failed.items()))
        while self._spares.get(key) is spare:
            await asyncio.sleep(WATCH_EVERY_S)
            if self._spares.get(key) is not spare:
                return
            if not spare.alive():
                self._forget(spare, f"exited with status {spare.process.returncode}")
                self.want(key)
                return
            if available_memory() < MEMORY_FLOOR_FACTOR * (rss or expected_rss(key.imports)):
                self._forget(spare, "was stopped to give its memory back (memory is short)")
                await spare.reap()
                return

    # -- adopting ------------------------------------------------------------------------

    async def adopt(self, key: SpareKey, argv: Sequence[str], env: Mapping[str, str],
                    cwd: str) -> subprocess.Popen[bytes] | None:
        """A spare turned into the kernel of this launch, or None: then launch as usual.

        Whatever the outcome, a replacement is on its way. ``argv`` is the launch command,
        ``env`` its whole environment (JPY_PARENT_PID included), ``cwd`` its folder.
        """
        if self.stopped:
            return None
        spare = self._spares.get(key)
        if spare is None or not (spare.ready() or await self._worth_waiting(spare)):
            if spare is not None and not spare.alive():
                self._forget(spare, f"exited with status {spare.process.returncode}")
            self.log.info("gpufrac: no spare kernel ready for %s; starting one cold", key.executable)
            self.want(key)
            return None
        self._spares.pop(key, None)
        self.want(key)
        try:
            problem = self._mismatch(spare, argv, env) or await spare.order(argv, env, cwd)
        except BaseException:
            # Cancelled (or worse) mid-order: it must not live on as a kernel nobody owns.
            spare.kill()
            self._track(asyncio.get_running_loop().create_task(spare.reap()))
            raise
        if problem is not None:
            self.log.info("gpufrac: spare kernel %s not used: %s", spare.pid, problem)
            await spare.reap()
            return None
        self.adopted += 1
        return spare.process

    async def _worth_waiting(self, spare: Spare) -> bool:
        """Wait for a spare still importing when it should be ready within ``ready_wait``
        (judged by how long the last one took): then it still beats a cold start."""
        took = self._ready_seconds.get(spare.key)
        left = self.ready_wait if took is None else took - (time.monotonic() - spare.started)
        if not spare.alive() or left > self.ready_wait:
            return False
        return await spare.wait_ready(self.ready_wait)

    @staticmethod
    def _mismatch(spare: Spare, argv: Sequence[str], env: Mapping[str, str]) -> str | None:
        key = spare.key
        if len(argv) < 3 or argv[1] != "-m" or argv[2] != key.module:
            return f"the launch is not `python -m {key.module}`"
        if python_executable(argv[0]) != key.executable:
            return f"the launch runs {argv[0]}, the spare {key.executable}"
        differ = env_differences(spare.env, env)
        if differ:
            return "the launch's environment differs in " + ", ".join(differ[:8])
        return None

    # -- stopping ------------------------------------------------------------------------

    async def stop(self) -> None:
        """Reap every spare and start none again (server shutdown)."""
        self.stopped = True
        current = asyncio.current_task()
        tasks = [task for task in self._tasks if task is not current]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        spares, self._spares = list(self._spares.values()), {}
        await asyncio.gather(*(spare.reap() for spare in spares), return_exceptions=True)
        if spares:
            self.log.info("gpufrac: reaped %d spare kernel(s)", len(spares))

    # -- bookkeeping ---------------------------------------------------------------------

    def _forget(self, spare: Spare, why: str) -> None:
        if self._spares.get(spare.key) is spare:
            del self._spares[spare.key]
        spare.close_status()
        self.log.info("gpufrac: spare kernel %s %s", spare.pid, why)

    def _track(self, task: asyncio.Task[None]) -> None:
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            self.log.error("gpufrac: spare kernel task failed", exc_info=task.exception())

    def _say_once(self, topic: str, message: str, *args: object) -> None:
        if topic not in self._said:
            self._said.add(topic)
            self.log.info(message, *args)


def _rss(pid: int) -> int:
    import psutil

    try:
        return int(psutil.Process(pid).memory_info().rss)
    except psutil.Error:
        return 0


# -- the spare's side ---------------------------------------------------------------------


def _say(status: Any, message: dict[str, Any]) -> None:
    status.write(json.dumps(message) + "\n")
    status.flush()


def spare_main() -> None:
    """In the spare (BOOTSTRAP): import, say ready, wait for one order, become that kernel.

    Never touches CUDA: a process that imported torch but did not initialise CUDA can still be
    given any GPU through CUDA_VISIBLE_DEVICES. The order comes on stdin, a pipe only the server
    holds; EOF without one (the server stopped, or died) ends the spare.
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
    raw = sys.stdin.buffer.read()
    if not raw:
        return
    try:
        order = json.loads(raw)
        argv = [str(arg) for arg in order["argv"]]
        env = {str(k): str(v) for k, v in dict(order["env"]).items()}
        if len(argv) < 3 or argv[1] != "-m":
            raise ValueError(f"expected [python, -m, module, ...], got {argv[:3]}")
        os.chdir(str(order["cwd"]))
    except Exception as err:
        _say(status, {"error": f"{type(err).__name__}: {err}"})
        raise SystemExit(1) from err
    # The environment of the launch, wholly (CUDA_VISIBLE_DEVICES and GPUFRAC_* included), and
    # what the imports changed in it, as they would have in a kernel that imported them itself.
    env.update({k: v for k, v in os.environ.items() if start_env.get(k) != v})
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
