"""The kernel provisioner: a GPU lease before launch, the kernel's GPU environment, its pid after."""

from __future__ import annotations

import asyncio
import inspect
import os
import pathlib
import subprocess
import time
from typing import Any

import psutil
from jupyter_client.provisioning import LocalProvisioner

from jupyter_gpufrac import contract
from jupyter_gpufrac.server.agent_link import AgentError, AgentLink, AgentUnavailable
from jupyter_gpufrac.server.launch import (
    build_kernel_env,
    is_ipykernel,
    kernel_arguments,
    kernel_checkpoint_dir,
    lease_gpus,
    resolve_share,
)
from jupyter_gpufrac.server.settings import KernelSettings, standalone_settings
from jupyter_gpufrac.server.spares import SpareKey, SparePool
from node_agent.quantities import Quantity, format_bytes

EXTENSION_NAME = "jupyter_gpufrac"
# How long a kernel restarted in a spare after a kill waits for the agent to measure that the
# killed process is gone (at most one of its ticks), and how often it looks.
MEASURED_WAIT_S = 1.5
MEASURED_POLL_S = 0.05


class GpuFracConfigError(ValueError):
    """A request or limit the agent cannot accept: the kernel does not start, the message says why."""


def gpu_label(gpus: dict[str, dict[str, Any]], uuid: str | None) -> str:
    """``GPU 1`` (by index) for people; the UUID when the GPU is unknown."""
    if not uuid:
        return "no GPU"
    index = gpus.get(uuid, {}).get("index")
    return f"GPU {index}" if index is not None else uuid



class _Misconfigured(Exception):
    """The server's own settings are wrong: no lease is asked for until they are fixed."""

class GpuFracProvisioner(LocalProvisioner):
    """Launches a local kernel on the GPU the node agent leases to it.

    The lease is created at the first launch, kept across restarts (a restart after a
    migration lands on the lease's new GPU) and released when the kernel shuts down.

    Without a lease the kernel still starts, and a ``no_gpu`` event says why:

    - no agent answers at the socket: ``CUDA_VISIBLE_DEVICES`` is left as the server has
      it -- nothing on this node is managed, so there is nobody's memory to protect;
    - the agent answers but gives no lease (the node is full): ``CUDA_VISIBLE_DEVICES=""``,
      because the GPUs' memory is leased to others;
    - a request or limit the agent refuses as malformed (4xx naming ``request``/``limit``)
      fails the start with :class:`GpuFracConfigError` -- a configuration mistake must show.
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.lease: dict[str, Any] | None = None
        self.gpus: dict[str, dict[str, Any]] = {}
        self.simulated = False
        self.launches = 0
        # The launch whose kernel reported its restore: it started, whatever killed it next.
        self._restored_launch = -1
        # Set once the kernel shuts down for good: from then on it must never take a lease.
        self.closed = False
        self.no_gpu_reason: str | None = None
        self.last_launch_reason: dict[str, Any] | None = None
        self.last_launch_time = 0.0
        self.last_launch_started = 0.0
        self._restart_reason: dict[str, Any] | None = None
        self._moving = False
        self._watching_restarts = False
        # How often jupyter_client's restarter began a restart: whoever else would restart
        # the kernel checks it first, so that it never starts twice.
        self.restarter_restarts = 0
        self._settings_cache: KernelSettings | None = None
        # (request_spec, limit_spec) of the lease as created: a change means `%gpu request`.
        self.asked_share: tuple[str, str | None] | None = None
        # Where the share came from, for people: {"request": "kernelspec", "limit": ...}.
        self.share_source: dict[str, str | None] | None = None

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

    async def restored(self) -> None:
        """The kernel of this launch answered with its restore report: it started."""
        self._restored_launch = self.launches
        # The restarter looks every few seconds; a kill before its next look would still
        # count as a failed start. Let it look now (it sees the kernel alive, or does what
        # it would have done anyway).
        poll = getattr(getattr(self.parent, "_restarter", None), "poll", None)
        if poll is not None:
            done = poll()
            if inspect.isawaitable(done):
                await done

    def get_stable_start_time(self, recommended: float = 10.0) -> float:
        """When jupyter_client's restarter counts the kernel as started for good.

        Until then a death counts toward its restart limit (5, then the kernel is removed)
        and a restart takes new ports, which cuts the open notebook's connection. A kernel that
        reported its restore did start: a kill after that (a reclaim, an OOM, a SIGKILL) is
        not a crash loop. Otherwise, soon: a kernel the agent stops has run for a while.
        """
        return 0.0 if self._restored_launch == self.launches else min(recommended, 3.0)

    def request_restore(self, reason: dict[str, Any]) -> None:
        """The next launch restores the latest checkpoint and tells the kernel why it restarted."""
        self._restart_reason = dict(reason)

    def cancel_restore(self) -> None:
        """The restart asked for did not happen: the user's next restart must not restore."""
        self._restart_reason = None

    def _on_restarter_restart(self) -> None:
        """jupyter_client's restarter found the kernel dead: come back with its variables.

        A kill the agent announces brings a better reason first; this one covers the rest
        (a SIGKILL from outside, the kernel's own crash, the system's OOM killer).
        """
        self.restarter_restarts += 1
        if self._restart_reason is not None:
            return
        gpu = (self.lease or {}).get("physical_gpu")
        self._restart_reason = {
            "cause": contract.CAUSE_DIED,
            "message": "its process was killed or crashed (not by jupyter-gpufrac)",
            "from_gpu": gpu, "to_gpu": gpu,
        }

    @property
    def restore_pending(self) -> bool:
        """A restore was asked for and the kernel was not launched since."""
        return self._restart_reason is not None

    # -- launch ------------------------------------------------------------------------

    async def pre_launch(self, **kwargs: Any) -> dict[str, Any]:
        """Get (or re-read) the lease and build the kernel's GPU environment and arguments."""
        self.last_launch_started = time.time()
        app = self.gpufrac_app()
        if app is not None:
            # A kernel started while the server still starts its agent waits for it, rather
            # than running without a GPU and being restarted onto one a second later.
            await app.agent_ready(str(self.kernel_id))
        settings = self.settings()
        link = AgentLink(settings.socket_path)
        kernel_id = str(self.kernel_id)
        reason, self._restart_reason = self._restart_reason, None
        lease: dict[str, Any] | None = None
        hide_gpus = False
        self.no_gpu_reason = None
        try:
            if settings.config_problems and self.lease is None:
                raise _Misconfigured("; ".join(settings.config_problems))
            node = await link.node()
            self.gpus = {gpu["uuid"]: gpu for gpu in node.get("gpus", [])}
            self.simulated = bool(node.get("simulated"))
            if self.lease is not None:
                lease = await self._reread_lease(link)
            if lease is None:
                lease = await self._create_lease(link, settings, kwargs.get("env") or {})
                self.asked_share = (str(lease.get("request_spec")), lease.get("limit_spec"))
            died = reason is None or reason.get("cause") == contract.CAUSE_DIED
            if died and lease.get("state") == "killed":
                # The restarter got here before the server heard of the kill: restore anyway.
                reason = {
                    "cause": contract.CAUSE_OOM_KILLED,
                    "message": lease.get("reason") or "The GPU agent stopped the kernel.",
                    "from_gpu": lease.get("physical_gpu"),
                    "to_gpu": lease.get("physical_gpu"),
                }
        except _Misconfigured as err:
            hide_gpus = True  # not a GPU nobody manages: a shared node's are leased to others
            self.no_gpu_reason = (
                f"jupyter-gpufrac's configuration has a problem, so this kernel started without "
                f"a GPU lease: {err}. Fix it in jupyter_server_config.py and restart the server."
            )
        except AgentError as err:  # AgentUnavailable included
            if self.lease is not None:
                # The agent went away (or failed) after we got our lease: stay where we ran.
                lease = self.lease
                self.log.warning("kernel %s: agent: %s; keeping its GPU", kernel_id, err)
            elif isinstance(err, AgentUnavailable):
                self.no_gpu_reason = (
                    f"No GPU agent answers at {settings.socket_path}, so this kernel started "
                    f"without a GPU lease ({err}). Start one with `{settings.agent_command}`; "
                    "the kernel gets a GPU share as soon as it answers."
                )
            elif err.status in (400, 422) and err.field in ("request", "limit", "devices"):
                raise GpuFracConfigError(
                    f"GPU {err.field} for kernel {kernel_id} was refused by the agent: {err.message}"
                ) from err
            else:
                hide_gpus = True
                self.no_gpu_reason = (f"The GPU agent gave this kernel no GPU: {err.message}. "
                                      "It gets one as soon as there is room.")

        self._moving = lease is not None and lease.get("state") == "migrating"
        self.lease = lease
        self.last_launch_reason = reason if lease is not None else None
        spec = self.kernel_spec
        argv = list(getattr(spec, "argv", []) or [])
        load_ext = is_ipykernel(argv, str(getattr(spec, "language", "") or ""))
        checkpoint_dir = kernel_checkpoint_dir(settings.checkpoint_root, kernel_id)
        kwargs["extra_arguments"] = kernel_arguments(kwargs.get("extra_arguments"), load_ext)
        kwargs["env"] = build_kernel_env(
            kwargs.get("env") or os.environ,
            kernel_id=kernel_id,
            socket_path=settings.socket_path,
            checkpoint_dir=checkpoint_dir,
            lease=lease,
            gpus=self.gpus,
            simulated=self.simulated,
            restart_reason=self.last_launch_reason,
            hide_gpus=hide_gpus,
            share_source=self.share_source,
            remembered_request=settings.remembered_request_path,
        )
        result: dict[str, Any] = await super().pre_launch(**kwargs)
        return result

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
        await self._until_agent_measured()
        launch_env = dict(env)
        launch_env["JPY_PARENT_PID"] = str(os.getpid())  # as jupyter_client's launch_kernel
        try:
            return await pool.adopt(key, [os.path.expanduser(arg) for arg in cmd], launch_env,
                                    str(kwargs.get("cwd") or os.getcwd()))
        except Exception:
            self.log.exception("kernel %s: spare kernel failed; starting it cold", self.kernel_id)
            return None

    async def _until_agent_measured(self) -> None:
        """Until the agent no longer counts a killed process's memory in this kernel's lease.

        It does until its next measurement (a tick), and a restore asks it for room: a kernel
        that restores within that tick, as one in a spare does, would get too little room and
        leave variables on disk. A move is not held up (its room is on the new GPU).
        """
        lease = self.lease
        if lease is None:
            return
        link = AgentLink(self.settings().socket_path)
        deadline = time.monotonic() + MEASURED_WAIT_S
        while lease.get("state") != "migrating" and int(lease.get("usage") or 0) > 0 and not any(
                _running(pid) for pid in lease.get("pids") or []):
            if time.monotonic() >= deadline:
                self.log.info("kernel %s: the agent has not measured its lease since the kill; "
                              "starting anyway", self.kernel_id)
                return
            await asyncio.sleep(MEASURED_POLL_S)
            try:
                lease = await link.lease(str(lease["id"]))
            except AgentError:
                return

    def _want_spare(self) -> None:
        """A spare for this kernelspec from now on, started in the background."""
        try:
            found = self._spare_pool()
            if found is not None:
                found[0].want(found[1])
        except Exception:
            self.log.exception("kernel %s: could not ask for a spare kernel", self.kernel_id)

    async def _reread_lease(self, link: AgentLink) -> dict[str, Any] | None:
        assert self.lease is not None
        try:
            return await link.lease(str(self.lease["id"]))
        except AgentError as err:
            if err.status == 404:
                self.log.warning(
                    "kernel %s: lease %s is gone; asking anew", self.kernel_id, self.lease["id"]
                )
                return None
            raise

    async def _create_lease(
        self, link: AgentLink, settings: KernelSettings, env: dict[str, str]
    ) -> dict[str, Any]:
        metadata = getattr(self.kernel_spec, "metadata", None) or {}
        share = resolve_share(
            metadata, settings.last_request(), os.environ, settings.default_request,
            settings.default_limit,
        )
        totals = [int(gpu["memory_total"]) for gpu in self.gpus.values() if gpu.get("memory_total")]
        limit = share.effective_limit(min(totals) if totals else None)
        self.share_source = {"request": share.request_source,
                             "limit": share.limit_source if limit is not None else None}
        self.log.info(
            "kernel %s: asking for request %s (%s), limit %s (%s)", self.kernel_id,
            share.request.spec, share.request_source, limit.spec if limit else None,
            share.limit_source,
        )

        def wire(quantity: Quantity | None) -> str | None:
            return None if quantity is None else quantity.spec

        return await link.create_notebook_lease(
            request=share.request.spec,
            limit=wire(limit),
            client=settings.client_name,
            kernel_id=str(self.kernel_id),
            name=env.get("JPY_SESSION_NAME", ""),
            compute_request=wire(share.compute_request),
            compute_limit=wire(share.compute_limit),
        )

    async def acquire_lease(self) -> dict[str, Any] | None:
        """A lease for a kernel running without one, once the agent has room; None if not yet.

        The kernel keeps running where it is: the caller restarts it onto the lease (with its
        variables), since a process cannot change GPUs.
        """
        if self.closed:
            return None
        settings = self.settings()
        link = AgentLink(settings.socket_path)
        try:
            node = await link.node()
            self.gpus = {gpu["uuid"]: gpu for gpu in node.get("gpus", [])}
            self.simulated = bool(node.get("simulated"))
            lease = await self._create_lease(link, settings, {})
        except AgentError:
            return None
        if self.closed:
            # The kernel shut down while the lease was being made: nobody would release it.
            await self._give_back(settings, str(lease["id"]))
            return None
        self.asked_share = (str(lease.get("request_spec")), lease.get("limit_spec"))
        self.lease, self.no_gpu_reason = lease, None
        return lease

    async def reregister(self) -> str:
        """Make sure the agent knows this kernel's lease (a fresh agent may not); say what was done.

        Returns ``kept`` (the agent has it), ``recreated`` (same GPU, pid registered again),
        ``moved`` (the new lease is on another GPU: the kernel must restart onto it) or
        ``lost`` (the agent gives no lease now).
        """
        if self.lease is None:
            return "lost"
        settings = self.settings()
        link = AgentLink(settings.socket_path)
        try:
            self.lease = await link.lease(str(self.lease["id"]))
            return "kept"
        except AgentError as err:
            if err.status != 404:
                raise
        running_on = lease_gpus(self.lease)
        self.lease = None
        lease = await self.acquire_lease()
        if lease is None:
            self.no_gpu_reason = ("The GPU agent restarted without this kernel's lease and has no "
                                  "room for it now; it gets one as soon as there is room.")
            return "lost"
        if lease_gpus(lease) != running_on:
            return "moved"
        if self.pid is not None:
            self.lease = await link.register_pid(str(lease["id"]), int(self.pid))
        return "recreated"

    async def post_launch(self, **kwargs: Any) -> None:
        """Register the kernel's pid with its lease; finish a move; tell the user where it runs."""
        await super().post_launch(**kwargs)
        settings = self.settings()
        kernel_id = str(self.kernel_id)
        if not self._watching_restarts and self.parent is not None:
            # The restarter keeps its callbacks across restarts: register once per kernel.
            self.parent.add_restart_callback(self._on_restarter_restart, "restart")
            self._watching_restarts = True
        self.launches += 1
        self.last_launch_time = time.time()
        if self.lease is not None and self.pid is not None:
            link = AgentLink(settings.socket_path)
            try:
                lease = await link.register_pid(str(self.lease["id"]), int(self.pid))
                if self._moving:
                    lease = await link.migrated(str(self.lease["id"]))
                self.lease = lease
            except (AgentUnavailable, AgentError) as err:
                self.log.warning("kernel %s: could not register pid %s: %s", kernel_id, self.pid, err)
            self._moving = False
        self._announce_launch(settings)
        self._want_spare()
        if settings.on_launched is not None:
            settings.on_launched(kernel_id, {"reason": self.last_launch_reason, "pid": self.pid})

    def _announce_launch(self, settings: KernelSettings) -> None:
        kernel_id = str(self.kernel_id)
        if self.lease is None:
            settings.events.emit(
                kernel_id, "no_gpu", self.no_gpu_reason or "This kernel runs without a GPU.",
                reason=self.no_gpu_reason or "",
            )
            return
        lease = self.lease
        uuids = lease_gpus(lease)
        uuid = uuids[0] if uuids else None
        figures = {
            "gpu_uuid": uuid,
            "gpu_index": self.gpus.get(uuid or "", {}).get("index"),
            "request": lease.get("request"),
            "limit": lease.get("limit"),
            "usage": lease.get("usage"),
        }
        reason = self.last_launch_reason
        moved = (contract.CAUSE_MIGRATED, contract.CAUSE_REQUEST_CHANGED)
        if reason is not None and reason.get("cause") in moved:
            source, target = reason.get("from_gpu"), reason.get("to_gpu") or uuid
            settings.events.emit(
                kernel_id, "migrated",
                f"{_text(reason.get('message')) or 'Moved from ' + gpu_label(self.gpus, source)}"
                "; restoring its variables.",
                reason=reason.get("message") or "",
                from_gpu_index=self.gpus.get(source or "", {}).get("index"),
                to_gpu_index=self.gpus.get(target or "", {}).get("index"),
                **figures,
            )
            return
        request, limit = int(lease.get("request") or 0), int(lease.get("limit") or 0)
        restarted = " after it was stopped, restoring its variables" if reason is not None else ""
        settings.events.emit(
            kernel_id, "placed",
            f"Running on {gpu_label(self.gpus, uuid)}{restarted} with {format_bytes(request)} "
            f"guaranteed, bursting up to {format_bytes(limit)}.",
            reason=(reason or {}).get("message") or "",
            **figures,
        )

    # -- shutdown ----------------------------------------------------------------------

    async def cleanup(self, restart: bool = False) -> None:
        """At shutdown (not restart) give the lease back."""
        if not restart:
            self.closed = True
        await super().cleanup(restart=restart)
        if restart or self.lease is None:
            return
        settings = self.settings()
        lease_id = str(self.lease["id"])
        self.lease = None
        await self._give_back(settings, lease_id)
        settings.events.forget(str(self.kernel_id))

    async def _give_back(self, settings: KernelSettings, lease_id: str) -> None:
        try:
            await AgentLink(settings.socket_path).release(lease_id)
        except AgentUnavailable:
            self.log.info("kernel %s: agent gone; lease %s not released", self.kernel_id, lease_id)
        except AgentError as err:
            if err.status != 404:
                self.log.warning("kernel %s: releasing lease %s: %s", self.kernel_id, lease_id, err)


def _running(pid: object) -> bool:
    """Whether a process of that pid runs (a zombie has ended)."""
    try:
        return bool(psutil.Process(int(str(pid))).status() != psutil.STATUS_ZOMBIE)
    except (psutil.Error, ValueError):
        return False


def _text(message: object) -> str:
    """A reason without its final full stop, to continue the sentence."""
    return str(message or "").strip().rstrip(".")
