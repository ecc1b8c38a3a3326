"""The kernel provisioner: launches a kernel with its GPU environment, in a spare when it restores."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import os
import pathlib
import subprocess
import time
from typing import Any

from jupyter_client.provisioning import LocalProvisioner

from jupyter_gpufrac import contract
from jupyter_gpufrac.checkpoint_disk import clear_marker
from jupyter_gpufrac.kernel import store
from jupyter_gpufrac.server import resume
from jupyter_gpufrac.server.agent_link import AgentError, AgentLink
from jupyter_gpufrac.server.kernels import KernelGpu
from jupyter_gpufrac.server.launch import (
    DEFAULT_REQUEST,
    build_kernel_env,
    checkpoint_dir_of,
    gpu_variables,
    is_ipykernel,
    kernel_arguments,
    kernel_checkpoint_dir,
)
from jupyter_gpufrac.server.notebook_states import ENDED_CULLED
from jupyter_gpufrac.server.retention import mark_shut_down
from jupyter_gpufrac.server.settings import KernelSettings, standalone_settings
from jupyter_gpufrac.server.spares import Spare, SpareKey, SparePool
from jupyter_gpufrac.server.transport import use_private_sockets

EXTENSION_NAME = "jupyter_gpufrac"
# In the provisioner's saved info: the newest checkpoint generation the server saw.
GENERATION_INFO = "gpufrac_checkpoint_generation"
# A restoring launch's spare is replaced once its kernel reported the restore, or after this.
SPARE_AFTER_RESTORE_S = 120.0
# How long a kill waits for the process to be gone (memory freed, reaped) before it returns.
KILL_WAIT_S = 2.0


class GpuFracProvisioner(LocalProvisioner):
    """Launches a local kernel on the GPU the node agent leases to it.

    The kernel's GPU state (lease, GPUs, restart reasons) is :attr:`gpu`, a
    :class:`~jupyter_gpufrac.server.kernels.KernelGpu` kept across restarts; this class only
    puts it into the launch (environment, arguments, a spare process) and tells it the pid.
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        spec = self.kernel_spec
        metadata = getattr(spec, "metadata", None) or {}
        hooked = is_ipykernel(list(getattr(spec, "argv", []) or []),
                              str(getattr(spec, "language", "") or ""))
        self.gpu = KernelGpu(str(self.kernel_id), metadata, self.settings, self.log,
                             hooked=hooked, on_restored=self._restored)
        self._watching_restarts = False
        self._settings_cache: KernelSettings | None = None
        # jupyter_client's restarter of this kernel, which hands itself over as it starts.
        self.restarter: Any = None
        # A launch is under way (from pre_launch to post_launch): a process exit then is not
        # the kernel's death.
        self._launching = False
        # Tasks of this kernel's launches (exit watch, the spare wanted after a restore).
        self._exit_tasks: set[asyncio.Task[None]] = set()
        self._restore_reported = asyncio.Event()

    # -- who we work for ---------------------------------------------------------------

    def gpufrac_app(self) -> Any | None:
        """The ``GpuFrac`` extension of the server that owns this kernel, if any."""
        node: Any = self.parent
        while node is not None:
            manager = getattr(node, "extension_manager", None)
            if manager is not None:
                point = manager.extension_points.get(EXTENSION_NAME)
                return getattr(point, "app", None) if point is not None else None
            node = getattr(node, "parent", None)
        return None

    def settings(self) -> KernelSettings:
        """The server extension's settings, or stand-in ones outside a server."""
        app = self.gpufrac_app()
        if app is not None and getattr(app, "kernel_settings", None) is not None:
            settings: KernelSettings = app.kernel_settings
            return settings
        if self._settings_cache is None:
            self._settings_cache = standalone_settings(self.log)
        return self._settings_cache

    async def _restored(self) -> None:
        """The kernel of this launch reported its restore: the launch is done."""
        self._restore_reported.set()
        await self._let_restarter_look()

    async def _want_spare_after_restore(self) -> None:
        """The spare a restoring launch took is replaced once the kernel reported its restore
        (or gave up on it), not beside the restore: on a small machine a spare importing torch
        took the CPU the restore needed."""
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._restore_reported.wait(), SPARE_AFTER_RESTORE_S)
        self._want_spare()

    async def _let_restarter_look(self) -> None:
        # The restarter looks every few seconds; a kill before its next look would still
        # count as a failed start, and restart on new ports (cutting the open notebook's
        # connection). Let it look now: it sees the kernel alive, or does what it would have
        # done anyway.
        poll = getattr(self.restarter, "poll", None)
        if poll is not None:
            done = poll()
            if inspect.isawaitable(done):
                await done

    async def kill(self, restart: bool = False) -> None:
        """SIGKILL the kernel's process group, as jupyter_client does, then wait (briefly) until
        the process is gone: jupyter_client looks for that every 0.1 s, and a move or a
        restart waits for it."""
        process = self.process
        await super().kill(restart=restart)
        if process is None or not hasattr(os, "pidfd_open"):
            return
        try:
            fd = os.pidfd_open(process.pid)
        except OSError:
            return  # gone already
        loop = asyncio.get_running_loop()
        gone: asyncio.Future[None] = loop.create_future()

        def exited() -> None:
            if not gone.done():
                gone.set_result(None)

        loop.add_reader(fd, exited)
        try:
            await asyncio.wait_for(gone, KILL_WAIT_S)
        except asyncio.TimeoutError:
            pass  # jupyter_client waits on, and says so
        finally:
            loop.remove_reader(fd)
            os.close(fd)
        with contextlib.suppress(OSError):
            process.poll()  # reaped here: the manager's first look finds it gone

    def _watch_exit(self) -> None:
        """Have jupyter_client's restarter look as soon as this launch's process exits, not at
        its next poll (every ``time_to_dead``, 3 s): a killed kernel's restore starts at once.
        Without pidfds (Linux < 5.3), the restarter's own polls find it."""
        process = self.process
        if process is None or not hasattr(os, "pidfd_open"):
            return
        try:
            fd = os.pidfd_open(process.pid)
        except OSError:
            return  # gone already: the restarter's next poll finds it
        loop = asyncio.get_running_loop()

        def exited() -> None:
            loop.remove_reader(fd)
            os.close(fd)
            manager: Any = self.parent
            # A shutdown, a restart or another launch under way is not a death to act on.
            if (self.process is process and not self._launching and manager is not None
                    and not getattr(manager, "shutting_down", False)):
                task = loop.create_task(self._let_restarter_look())
                self._exit_tasks.add(task)
                task.add_done_callback(self._exit_tasks.discard)

        loop.add_reader(fd, exited)

    def _restarter_reports_here(self) -> None:
        """Make the kernel manager's restarter (whichever class is configured) hand itself to
        this provisioner as it starts: jupyter_client offers no public handle on it."""
        manager: Any = self.parent
        configured = getattr(manager, "restarter_class", None)
        if isinstance(configured, type) and not getattr(configured, "reports_to_gpufrac", False):
            manager.restarter_class = _reporting(configured)

    def get_stable_start_time(self, recommended: float = 10.0) -> float:
        """When jupyter_client's restarter counts the kernel as started for good (see
        :meth:`KernelGpu.stable_start_time`)."""
        return self.gpu.stable_start_time(recommended)

    # -- launch ------------------------------------------------------------------------

    async def pre_launch(self, **kwargs: Any) -> dict[str, Any]:
        """Get (or re-read) the lease and build the kernel's GPU environment and arguments."""
        self._launching = True
        app = self.gpufrac_app()
        if app is not None:
            # A kernel started while the server still starts its agent waits for it, rather
            # than running without a GPU and being restarted onto one a second later.
            await app.agent_ready(str(self.kernel_id))
        settings = self.settings()
        kernel_id = str(self.kernel_id)
        gpu = self.gpu
        if gpu.launches == 0 and app is not None:
            cwd = kwargs.get("cwd")
            await resume.plan(gpu, kwargs.get("env") or {}, str(cwd) if cwd else None,
                              self._running(app))
        hide_gpus = await gpu.prepare_launch(kwargs.get("env") or {})
        await resume.take_over(gpu)
        self._restarter_reports_here()
        spec = self.kernel_spec
        argv = list(getattr(spec, "argv", []) or [])
        load_ext = is_ipykernel(argv, str(getattr(spec, "language", "") or ""))
        checkpoint_dir = self._checkpoint_dir(settings, kernel_id)
        if gpu.checkpoints_off is None:
            # A kernel launched under this id is not shut down (whatever marked it before).
            clear_marker(pathlib.Path(checkpoint_dir))
            # At a restart, before the launch: the newest state this server can know of.
            await asyncio.to_thread(gpu.look_at_checkpoint)
            await asyncio.to_thread(resume.leave_record, gpu)
        kwargs["extra_arguments"] = kernel_arguments(kwargs.get("extra_arguments"), load_ext)
        if load_ext:
            # ipykernel takes Unix sockets from its connection file; other kernels may not.
            use_private_sockets(self.parent, kernel_id, self.log)
        kwargs["env"] = build_kernel_env(
            kwargs.get("env") or os.environ,
            kernel_id=kernel_id,
            socket_path=settings.socket_path,
            checkpoint_dir=checkpoint_dir,
            lease=gpu.lease,
            gpus=gpu.gpus,
            simulated=gpu.simulated,
            restart_reason=gpu.last_launch_reason,
            hide_gpus=hide_gpus,
            share_source=gpu.share_source,
            remembered_request=settings.remembered_request_path,
            default_share={"request": settings.default_request or DEFAULT_REQUEST,
                           "limit": settings.default_limit or None},
            no_lease_reason=gpu.no_gpu_reason,
            checkpoints_off=gpu.checkpoints_off,
            checkpoint_generation=gpu.checkpoint_generation,
            checkpoint_budgets=(settings.checkpoint_kernel_budget,
                                settings.checkpoint_user_budget,
                                settings.checkpoint_staging_budget),
            checkpoint_disk_shares=settings.checkpoint_disk_shares,
            resumable=resume.offer(gpu),
        )
        if kwargs["env"].get(contract.RESTORE) == "1":
            # Made ready at the directive (a move); else now, while the launch goes on.
            await self.prepare_spare()
        result: dict[str, Any] = await super().pre_launch(**kwargs)
        return result

    @staticmethod
    def _running(app: Any) -> list[str]:
        """This server's kernels: their states are theirs, never another kernel's to resume."""
        manager = getattr(getattr(app, "kernels", None), "kernel_manager", None)
        return list(manager.list_kernel_ids()) if manager is not None else []

    def _checkpoint_dir(self, settings: KernelSettings, kernel_id: str) -> str:
        """The kernel's checkpoint folder, made and checked; where it cannot be used the kernel
        starts without checkpoints (``gpu.checkpoints_off`` says why), never fails to start."""
        gpu = self.gpu
        gpu.checkpoints_off = settings.folder_problem
        if gpu.checkpoints_off is None:
            try:
                return kernel_checkpoint_dir(settings.checkpoint_root, kernel_id)
            except (OSError, store.UnsafeCheckpointError) as exc:
                gpu.checkpoints_off = str(exc)
                self.log.error("kernel %s: starts without checkpoints: %s", kernel_id, exc)
        return checkpoint_dir_of(settings.checkpoint_root, kernel_id)

    async def get_provisioner_info(self) -> dict[str, Any]:
        """jupyter_client's saved state, with the newest checkpoint generation seen."""
        info: dict[str, Any] = await super().get_provisioner_info()
        info[GENERATION_INFO] = self.gpu.checkpoint_generation
        return info

    async def load_provisioner_info(self, provisioner_info: dict[str, Any]) -> None:
        """Restore :meth:`get_provisioner_info`'s state."""
        await super().load_provisioner_info(provisioner_info)
        self.gpu.saw_generation(provisioner_info.get(GENERATION_INFO))

    async def launch_kernel(self, cmd: list[str], **kwargs: Any) -> Any:
        """Start the kernel in a pre-warmed spare process when this launch restores (a move or
        a recovery), else as jupyter_client does. The connection file, ports and kernel id are
        the launch's own either way, so the open notebook stays connected."""
        process = await self._adopt_spare(cmd, kwargs)
        if process is None:
            return await super().launch_kernel(cmd, **kwargs)
        self.process = process
        self.pid = process.pid
        try:
            self.pgid = os.getpgid(process.pid)
        except OSError:
            self.pgid = None
        self.cwd = kwargs.get("cwd", pathlib.Path.cwd())
        self.log.info("kernel %s: started in spare kernel process %s", self.kernel_id, process.pid)
        return self.connection_info

    def _spare_pool(self) -> tuple[SparePool, SpareKey] | None:
        """The server's spare pool and this kernelspec's key in it, when it can have spares."""
        app = self.gpufrac_app()
        pool = getattr(app, "spares", None) if app is not None else None
        if not isinstance(pool, SparePool):
            return None
        spec = self.kernel_spec
        argv = list(getattr(spec, "argv", []) or [])
        load_ext = is_ipykernel(argv, str(getattr(spec, "language", "") or ""))
        key = pool.key_for(argv, getattr(spec, "env", None), load_ext) if load_ext else None
        return None if key is None else (pool, key)

    async def _adopt_spare(self, cmd: list[str], kwargs: dict[str, Any]
                           ) -> subprocess.Popen[bytes] | None:
        """A spare turned into this launch's kernel, or None; a spare never fails a launch."""
        env = kwargs.get("env")
        # Only a restoring launch: the restore is what imports torch. A fresh kernel starts in
        # a fresh interpreter, as its user expects.
        if not isinstance(env, dict) or env.get(contract.RESTORE) != "1":
            return None
        # What a spare cannot honour (other streams, an independent kernel): launch as usual.
        popen_only = {k for k, v in kwargs.items() if v is not None and k not in
                      ("env", "cwd", "kernel_id", "extra_arguments", "independent")}
        if popen_only or kwargs.get("independent"):
            return None
        found = self._spare_pool()
        if found is None:
            return None
        pool, key = found
        launch_env = dict(env)
        launch_env["JPY_PARENT_PID"] = str(os.getpid())  # as jupyter_client's launch_kernel
        try:
            return await pool.adopt(key, [os.path.expanduser(arg) for arg in cmd], launch_env,
                                    str(kwargs.get("cwd") or os.getcwd()), str(self.kernel_id))
        except Exception:
            self.log.exception("kernel %s: spare kernel failed; starting it cold", self.kernel_id)
            return None

    async def prepare_spare(self, lease: dict[str, Any] | None = None) -> bool:
        """Make a spare ready for this kernel's coming restoring launch (a move, a restart after
        a kill): the packages its last checkpoint says it had imported, and on a GPU, CUDA's
        context on the one ``lease`` (default: the kernel's) runs it on. Whether one is."""
        found = self._spare_pool()
        gpu = self.gpu
        lease = lease if lease is not None else gpu.lease
        if found is None or gpu.checkpoints_off is not None or (
                lease is not None and lease.get("state") == "parked"):
            return False
        try:
            await asyncio.to_thread(gpu.look_at_checkpoint)  # its imports, as last checkpointed
            env = gpu_variables(lease, gpu.gpus) if lease is not None else {}
            return await found[0].prepare(found[1], str(self.kernel_id), gpu.imports, env,
                                          self._spare_prepared)
        except Exception:  # a spare never fails a launch
            self.log.exception("kernel %s: could not make a spare kernel ready", self.kernel_id)
            return False

    async def _spare_prepared(self, spare: Spare) -> None:
        """A spare made ready with CUDA's context holds GPU memory: registered with the
        kernel's lease (whose process it becomes), so the agent counts it there."""
        info = spare.prepared_info or {}
        lease = self.gpu.lease
        if not info.get("cuda") or lease is None:
            return
        try:
            await AgentLink(self.settings().socket_path).register_pid(str(lease["id"]), spare.pid)
        except AgentError as err:
            self.log.info("kernel %s: spare kernel %s not registered with its lease: %s",
                          self.kernel_id, spare.pid, err)

    def _want_spare(self) -> None:
        """A spare for this kernelspec from now on, started in the background."""
        try:
            found = self._spare_pool()
            if found is not None:
                found[0].want(found[1])
        except Exception:
            self.log.exception("kernel %s: could not ask for a spare kernel", self.kernel_id)

    async def post_launch(self, **kwargs: Any) -> None:
        """Register the kernel's pid with its lease; finish a move; tell the user where it runs."""
        self._launching = False
        self._watch_exit()
        await super().post_launch(**kwargs)
        if not self._watching_restarts and self.parent is not None:
            # The restarter keeps its callbacks across restarts: register once per kernel.
            self.parent.add_restart_callback(self.gpu.restarter_restarted, "restart")
            self._watching_restarts = True
        await self.gpu.launched(None if self.pid is None else int(self.pid))
        if self.gpu.last_launch_reason is None:
            self._want_spare()
        else:
            self._restore_reported.clear()
            task = asyncio.get_running_loop().create_task(self._want_spare_after_restore())
            self._exit_tasks.add(task)
            task.add_done_callback(self._exit_tasks.discard)
        settings = self.settings()
        if settings.on_launched is not None:
            settings.on_launched(str(self.kernel_id),
                                 {"reason": self.gpu.last_launch_reason, "pid": self.pid,
                                  "resumable": self.gpu.resumable,
                                  "notebook": self.gpu.notebook.path if self.gpu.notebook
                                  else None})

    # -- shutdown ----------------------------------------------------------------------

    async def cleanup(self, restart: bool = False) -> None:
        """At shutdown (not restart) give the lease back, and mark the checkpoint as its
        user's to drop after ``checkpoint_keep_seconds`` (not at a server stop: see
        :func:`~jupyter_gpufrac.server.retention.sweep`)."""
        if not restart:
            # A spare wanted after a restore, a restarter's look: moot for a kernel gone for good
            # (left pending, the closing loop would warn of each).
            for task in list(self._exit_tasks):
                task.cancel()
            found = self._spare_pool()
            if found is not None:
                found[0].forget_kernel(str(self.kernel_id))
            settings = self.settings()
            if self.gpu.culling:
                # jupyter_server's idle culler: a park to disk, which the notebook's next
                # kernel resumes (its record says so; nothing marks it shut down).
                await asyncio.to_thread(resume.leave_record, self.gpu, {
                    "how": ENDED_CULLED, "time": time.time()}, durable=True)
                self.log.info("kernel %s: culled for being idle; the next kernel of its "
                              "notebook resumes its checkpoint", self.kernel_id)
            await self.gpu.close()
            if (not settings.server_stopping and not self.gpu.culling
                    and self.gpu.checkpoints_off is None):
                await asyncio.to_thread(mark_shut_down, settings.checkpoint_root,
                                        str(self.kernel_id), settings.checkpoint_keep_seconds,
                                        self.log)
        await super().cleanup(restart=restart)


@functools.cache
def _reporting(restarter_class: Any) -> type:
    """``restarter_class``, whose instances hand themselves to their kernel's provisioner as
    they start (one subclass per class, made once)."""

    def start(self: Any) -> None:
        restarter_class.start(self)
        provisioner = getattr(self.kernel_manager, "provisioner", None)
        if isinstance(provisioner, GpuFracProvisioner):
            provisioner.restarter = self

    return type(f"GpuFrac{restarter_class.__name__}", (restarter_class,),
                {"start": start, "reports_to_gpufrac": True,
                 "__doc__": restarter_class.__doc__, "__module__": __name__})
