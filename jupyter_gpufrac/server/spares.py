"""Pre-warmed spare kernel processes that a move or a recovery adopts instead of a cold start."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
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
# A spare made ready for one kernel's launch (see SparePool.prepare) that no launch took by then
# is reaped: that move or recovery was given up.
PREPARED_KEEP_S = 600.0
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
    "from jupyter_gpufrac.server.spare_process import spare_main; spare_main()"
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
        # Made ready for one kernel's launch: its id, when, the GPU variables it was given (a
        # launch must want the same), and the spare's answer once it came.
        self.prepared_for: str | None = None
        self.prepared_at = 0.0
        self.prepared_env: dict[str, str] = {}
        self.prepared_info: dict[str, Any] | None = None
        self.prepared_told = False

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
                    if message.get("prepared"):
                        self.prepared_info = message

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

    async def send(self, message: dict[str, Any], *, last: bool = False) -> str | None:
        """Write one order line on the spare's stdin (``last``: then close it); None, or what
        went wrong."""
        stdin = self.process.stdin
        if stdin is None:
            return "no order pipe"
        payload = json.dumps(message).encode() + b"\n"

        def send() -> None:
            # The close after the launch leaves fd 0 at EOF, as a normal kernel's stdin is
            # (jupyter_client closes it at once).
            stdin.write(payload)
            stdin.flush()
            if last:
                stdin.close()

        try:
            await asyncio.wait_for(asyncio.get_running_loop().run_in_executor(None, send),
                                   ORDER_ACK_S)
        except (OSError, ValueError) as err:
            return f"the order pipe broke ({err})"
        except asyncio.TimeoutError:
            return "the spare did not read its order"
        return None

    async def prepare(self, kernel_id: str, imports: Sequence[str], env: Mapping[str, str]
                      ) -> str | None:
        """Make it ready for ``kernel_id``'s launch (see :meth:`SparePool.prepare`); it answers
        in its own time (:attr:`prepared_info`). None, or what went wrong."""
        self.prepared_for, self.prepared_at = kernel_id, time.monotonic()
        self.prepared_env = {**self.prepared_env, **env}
        return await self.send({"prepare": {"imports": list(imports), "env": dict(env)}})

    async def order(self, argv: Sequence[str], env: Mapping[str, str], cwd: str) -> str | None:
        """Send the launch order and wait for the spare to take it; None, or what went wrong."""
        seen = len(self.messages)
        problem = await self.send({"launch": {"argv": list(argv), "env": dict(env), "cwd": cwd}},
                                  last=True)
        if problem is not None:
            return problem
        # Made ready for this launch, it may still be making CUDA's context (torch imported
        # first), which it finishes before it reads the launch: it is waited for longer.
        deadline = time.monotonic() + (READY_DEADLINE_S if self.prepared_for else ORDER_ACK_S)
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
        # Spares made ready for one kernel's coming launch, by kernel id (see prepare).
        self._prepared: dict[str, Spare] = {}
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
        return [spare.pid for spare in [*self._spares.values(), *self._prepared.values()]]

    def status(self) -> dict[str, Any]:
        """What the spares are and hold, for people (the REST node view): each one's pid, state
        (importing, ready, or prepared for a kernel) and host memory, and the bounds."""
        listed: list[dict[str, Any]] = []
        for spare in self._spares.values():
            listed.append({"pid": spare.pid, "state": "ready" if spare.ready() else "importing",
                           "kernel_id": None, "bytes": _rss(spare.pid)})
        for kernel_id, spare in self._prepared.items():
            spare.read_status()
            info = spare.prepared_info or {}
            listed.append({"pid": spare.pid, "state": "prepared", "kernel_id": kernel_id,
                           "bytes": _rss(spare.pid), "imported": info.get("imported"),
                           "cuda": info.get("cuda")})
        return {"max": self.max_spares, "spares": listed, "starting": len(self._starting),
                "bytes": sum(int(item["bytes"]) for item in listed), "adopted": self.adopted,
                "imports": list(self.imports)}

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
        if len(self._spares) + len(self._prepared) + len(self._starting) >= self.max_spares:
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

    async def prepare(self, key: SpareKey, kernel_id: str, imports: Sequence[str],
                      env: Mapping[str, str],
                      on_prepared: Callable[[Spare], Awaitable[None]] | None = None) -> bool:
        """Make the spare of ``key`` ready for ``kernel_id``'s coming launch (a move, or a
        restart after a kill): it imports the installed packages among ``imports`` (what the
        kernel had imported) and, given the launch's GPU variables ``env`` (its
        CUDA_VISIBLE_DEVICES naming a GPU), makes CUDA's context there. It is kept for that
        launch alone (:meth:`adopt`); its replacement is :meth:`want`-ed once that launch is
        done (started beside it, it would slow it). Asked again for the same kernel, it imports
        what is new. False when no spare could be made ready.
        ``on_prepared`` is called once the spare has answered."""
        if self.stopped:
            return False
        spare = self._prepared.get(kernel_id)
        if spare is not None and (not spare.alive() or spare.key != key
                                  or any(spare.prepared_env.get(k, v) != v
                                         for k, v in env.items())):
            self._drop_prepared(kernel_id, "was made ready for another GPU or kernelspec")
            spare = None
        fresh = spare is None
        if spare is None:
            spare = self._spares.get(key)
            if spare is None or not spare.alive():
                self.want(key)
                return False
            del self._spares[key]
            self._prepared[kernel_id] = spare
        problem = await spare.prepare(kernel_id, imports, env)
        if problem is not None:
            self._drop_prepared(kernel_id, problem)
            return False
        if fresh:
            self.log.info("gpufrac: kernel %s: spare kernel %s made ready for its launch "
                          "(importing %d packages%s)", kernel_id, spare.pid, len(imports),
                          ", CUDA on " + env["CUDA_VISIBLE_DEVICES"]
                          if env.get("CUDA_VISIBLE_DEVICES") else "")
            self._track(asyncio.get_running_loop().create_task(
                self._watch_prepared(kernel_id, spare, on_prepared)))
        return True

    async def _watch_prepared(self, kernel_id: str, spare: Spare,
                              on_prepared: Callable[[Spare], Awaitable[None]] | None) -> None:
        """Say what the spare made ready did; reap it when no launch took it in time."""
        deadline = spare.prepared_at + PREPARED_KEEP_S
        called = False
        while self._prepared.get(kernel_id) is spare:
            spare.read_status()
            if not called and spare.prepared_info is not None:
                called = True
                self._tell_prepared(spare)
                if on_prepared is not None:
                    await on_prepared(spare)
            if not spare.alive():
                self._drop_prepared(kernel_id, f"exited with status {spare.process.returncode}")
                return
            if time.monotonic() >= deadline:
                self._drop_prepared(kernel_id, "was not launched in time")
                await spare.reap()
                return
            await asyncio.sleep(WATCH_EVERY_S / 10 if not called else WATCH_EVERY_S)
        if not called and spare.prepared_info is not None and on_prepared is not None:
            await on_prepared(spare)  # adopted as soon as it was ready

    def _tell_prepared(self, spare: Spare) -> None:
        """Log, once, what a spare made ready for a kernel did."""
        info = spare.prepared_info
        if info is None or spare.prepared_told:
            return
        spare.prepared_told = True
        self.log.info("gpufrac: spare kernel %s ready for kernel %s in %.1f s (imported %s%s; "
                      "CUDA: %s)", spare.pid, spare.prepared_for, float(info.get("seconds") or 0),
                      ", ".join(info.get("imported") or []) or "nothing new",
                      "; left to the kernel, which was there first: " + ", ".join(info["left"])
                      if info.get("left") else "",
                      info.get("cuda") or info.get("cuda_error") or "not used")
        if info.get("skipped"):
            self.log.info("gpufrac: spare kernel %s left to the kernel: %s", spare.pid,
                          "; ".join(f"{k}: {v}" for k, v in info["skipped"].items()))

    def _drop_prepared(self, kernel_id: str, why: str) -> None:
        spare = self._prepared.pop(kernel_id, None)
        if spare is not None:
            spare.close_status()
            self.log.info("gpufrac: spare kernel %s %s", spare.pid, why)
            self._track(asyncio.get_running_loop().create_task(spare.reap()))

    def forget_kernel(self, kernel_id: str) -> None:
        """The kernel shut down: a spare made ready for it goes."""
        self._drop_prepared(kernel_id, "was made ready for a kernel that shut down")

    # -- adopting ------------------------------------------------------------------------

    async def adopt(self, key: SpareKey, argv: Sequence[str], env: Mapping[str, str],
                    cwd: str, kernel_id: str | None = None) -> subprocess.Popen[bytes] | None:
        """A spare turned into the kernel of this launch, or None: then launch as usual.

        The spare made ready for ``kernel_id`` (see :meth:`prepare`) when its GPU variables are
        the launch's, else a ready one. Without one, a spare is on its way for the next launch;
        the replacement of one taken is :meth:`want`-ed once the launch is done. ``argv`` is
        the launch command, ``env`` its whole environment (JPY_PARENT_PID
        included), ``cwd`` its folder.
        """
        if self.stopped:
            return None
        spare = self._prepared.pop(kernel_id, None) if kernel_id is not None else None
        if spare is not None:
            differ = sorted(k for k, v in spare.prepared_env.items() if env.get(k) != v)
            if differ or spare.key != key or not spare.alive():
                why = (f"the launch wants other {', '.join(differ)}" if differ
                       else "it is of another kernelspec" if spare.key != key else "it exited")
                self.log.info("gpufrac: spare kernel %s made ready for kernel %s not used: %s",
                              spare.pid, kernel_id, why)
                await spare.reap()
                spare = None
        if spare is None:
            spare = self._spares.get(key)
            if spare is None or not (spare.ready() or await self._worth_waiting(spare)):
                if spare is not None and not spare.alive():
                    self._forget(spare, f"exited with status {spare.process.returncode}")
                self.log.info("gpufrac: no spare kernel ready for %s; starting one cold",
                              key.executable)
                self.want(key)
                return None
            self._spares.pop(key, None)
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
        self._tell_prepared(spare)
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
        spares = [*self._spares.values(), *self._prepared.values()]
        self._spares, self._prepared = {}, {}
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
