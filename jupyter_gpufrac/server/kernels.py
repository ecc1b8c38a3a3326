"""Each kernel's GPU state and its lifecycle: lease, GPUs, why it (re)started, what it asked for."""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

from jupyter_gpufrac import contract
from jupyter_gpufrac.kernel import store
from jupyter_gpufrac.kernel.state_file import recovery_point
from jupyter_gpufrac.notebook_record import Notebook
from jupyter_gpufrac.server.agent_link import AgentError, AgentLink, AgentUnavailable
from jupyter_gpufrac.server.launch import checkpoint_dir_of, lease_gpus, resolve_share
from jupyter_gpufrac.server.notebook_states import EarlierState
from jupyter_gpufrac.server.podinfo import cluster_gpus, reachable_gpus, read_podinfo
from jupyter_gpufrac.server.settings import KernelSettings
from jupyter_gpufrac.wake import wake, wake_path
from node_agent.quantities import Quantity, format_bytes


class GpuFracConfigError(ValueError):
    """A request or limit the agent cannot accept: the kernel does not start, the message says why."""


class _Misconfigured(Exception):
    """The server's own settings are wrong: no lease is asked for until they are fixed."""


def gpu_label(gpus: Mapping[str, Mapping[str, Any]], uuid: str | None) -> str:
    """``GPU 1`` (by index) for people; the UUID when the GPU is unknown."""
    if not uuid:
        return "no GPU"
    index = gpus.get(uuid, {}).get("index")
    return f"GPU {index}" if index is not None else uuid


class KernelGpu:
    """One kernel's GPU state, kept across its restarts, and every change made to it.

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

    def __init__(self, kernel_id: str, metadata: Mapping[str, Any],
                 settings: Callable[[], KernelSettings], log: logging.Logger, *,
                 hooked: bool = True,
                 on_restored: Callable[[], Awaitable[None]] | None = None) -> None:
        self.kernel_id = kernel_id
        self.metadata = metadata  # the kernelspec's: its share, if it names one
        # Whether the kernel loads our IPython extension: only such a kernel answers the
        # server's questions, checkpoints, restores and can be parked.
        self.hooked = hooked
        self.settings = settings
        self.log = log
        self._on_restored = on_restored
        self.lease: dict[str, Any] | None = None
        self.gpus: dict[str, dict[str, Any]] = {}
        self.simulated = False
        self.no_gpu_reason: str | None = None
        # (request_spec, limit_spec) of the lease as created: a change means `%gpu request`.
        self.asked_share: tuple[str, str | None] | None = None
        # Where the share came from, for people: {"request": "kernelspec", "limit": ...}.
        self.share_source: dict[str, str | None] | None = None
        # The request the last lease asked for (what the agent may have had no room for).
        self.asked_request: Quantity | None = None
        self.pid: int | None = None
        self.launches = 0
        self.last_launch_reason: dict[str, Any] | None = None
        self.last_launch_time = 0.0
        self.last_launch_started = 0.0
        # Set once the kernel shuts down for good: from then on it must never take a lease.
        self.closed = False
        # How often jupyter_client's restarter began a restart: whoever else would restart
        # the kernel checks it first, so that it never starts twice.
        self.restarter_restarts = 0
        # The launch whose kernel reported its restore: it started, whatever killed it next.
        self._restored_launch = -1
        self._restart_reason: dict[str, Any] | None = None
        self._moving = False
        # What the last restore brought back and lost (the REST model's ``restore``).
        self.last_restore: dict[str, Any] | None = None
        # When the kernel last could not be parked (its tensors did not fit in host memory,
        # its checkpoint failed): it is not tried again for a while.
        self.park_refused = 0.0
        # The newest checkpoint generation of this kernel the server saw, kept across its
        # restarts: a restore of an older one says so (a folder renamed or replaced).
        self.checkpoint_generation = 0
        self._state_seen: list[tuple[int, int, int] | None] | None = None
        # The committed checkpoint as its header says (checkpoint.recovery_point), or None.
        self.recovery_point: dict[str, Any] | None = None
        # The packages the kernel had imported, as its last checkpoint names them: a spare
        # kernel imports them before it restores it.
        self.imports: list[str] = []
        # When the kernel view may ask the kernel for its checkpoint status again (monotonic).
        self.ask_status_after = 0.0
        # Why this kernel's launches take no checkpoints (a folder others can write), or None.
        self.checkpoints_off: str | None = None
        # The notebook it serves (user, folder, path: from the session that started it, then
        # followed through renames), or None: a kernel of no notebook has no record.
        self.notebook: Notebook | None = None
        # When this kernel first launched: of a notebook's kernels the newest decides what a
        # later one resumes.
        self.first_launch = 0.0
        # A state an earlier kernel of the notebook left: to take over at the next launch, or
        # offered to the user (c.GpuFrac.resume "ask" and "never").
        self.resume_next: EarlierState | None = None
        self.resumable: EarlierState | None = None
        # jupyter_server's idle culler is shutting it down: parked to disk, not its user's doing.
        self.culling = False
        # When its record was last written (monotonic), for the heartbeat.
        self.record_written = 0.0

    # -- for people --------------------------------------------------------------------

    def label(self, uuid: str | None) -> str:
        """``GPU 1`` for a GPU of this node."""
        return gpu_label(self.gpus, uuid)

    def index(self, uuid: object) -> int | None:
        """The index of a GPU of this node, or None."""
        index = self.gpus.get(str(uuid or ""), {}).get("index")
        return None if index is None else int(index)

    def where(self) -> dict[str, Any]:
        """``gpu_uuid`` and ``gpu_index`` of the GPU the lease is on, or nothing."""
        uuids = lease_gpus(self.lease) if self.lease is not None else []
        return {"gpu_uuid": uuids[0], "gpu_index": self.index(uuids[0])} if uuids else {}

    # -- restarts ----------------------------------------------------------------------

    def request_restore(self, reason: dict[str, Any]) -> None:
        """The next launch restores the latest checkpoint and tells the kernel why it restarted."""
        self._restart_reason = dict(reason)

    def cancel_restore(self) -> None:
        """The restart asked for did not happen: the user's next restart must not restore."""
        self._restart_reason = None

    @property
    def restore_pending(self) -> bool:
        """A restore was asked for and the kernel was not launched since."""
        return self._restart_reason is not None

    def restarter_restarted(self) -> None:
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

    def saw_generation(self, generation: object) -> None:
        """The kernel has (or had) a committed checkpoint of ``generation``: remember the newest."""
        if (isinstance(generation, int) and not isinstance(generation, bool)
                and generation > self.checkpoint_generation):
            self.checkpoint_generation = generation

    def look_at_checkpoint(self) -> None:
        """Learn the kernel's recovery point (cell, time, generation, what is not protected)
        from its committed checkpoint's header (file I/O: call it in a thread); read again
        only when the state file, or when it was last found current, changed since."""
        settings = self.settings()
        if settings.folder_problem or self.checkpoints_off:
            return
        folder = checkpoint_dir_of(settings.checkpoint_root, self.kernel_id)
        seen: list[tuple[int, int, int] | None] = []
        for name in (store.STATE_FILE, store.SEEN_FILE):
            try:
                st = os.stat(os.path.join(folder, name), follow_symlinks=False)
            except OSError:
                seen.append(None)
                continue
            seen.append((st.st_ino, st.st_size, st.st_mtime_ns))
        if seen != self._state_seen:
            self._state_seen = seen
            # None yet, or removed: a restart would restore nothing (the newest generation seen
            # is kept, so that a state put back later is known to be older).
            self.recovery_point = None if seen[0] is None else recovery_point(Path(folder))
            if self.recovery_point is not None:
                self.imports = self.recovery_point.pop("imports")
                self.saw_generation(self.recovery_point["durable_generation"])

    async def restored(self) -> None:
        """The kernel of this launch answered with its restore report: it started."""
        self._restored_launch = self.launches
        if self._on_restored is not None:
            await self._on_restored()

    def stable_start_time(self, recommended: float) -> float:
        """When jupyter_client's restarter counts the kernel as started for good.

        Until then a death counts toward its restart limit (5, then the kernel is removed)
        and a restart takes new ports, which cuts the open notebook's connection. A kernel that
        reported its restore did start: a kill after that (a reclaim, an OOM, a SIGKILL) is
        not a crash loop. Otherwise, soon: a kernel the agent stops has run for a while.
        """
        return 0.0 if self._restored_launch == self.launches else min(recommended, 3.0)

    # -- launch ------------------------------------------------------------------------

    async def prepare_launch(self, env: Mapping[str, str]) -> bool:
        """Get (or re-read) the lease before a launch; returns whether to hide the GPUs.

        Sets :attr:`lease`, :attr:`last_launch_reason` and, without a lease,
        :attr:`no_gpu_reason`.
        """
        self.last_launch_started = time.time()
        settings = self.settings()
        link = AgentLink(settings.socket_path)
        reason, self._restart_reason = self._restart_reason, None
        lease: dict[str, Any] | None = None
        hide_gpus = False
        self.no_gpu_reason = None
        try:
            if settings.config_problems and self.lease is None:
                raise _Misconfigured("; ".join(settings.config_problems))
            await self._read_node(link)
            if self.lease is not None:
                lease = await self._reread_lease(link)
            if lease is None:
                lease = await self._create_lease(link, settings, env)
            if reason is not None and reason.get("cause") == contract.CAUSE_PARKED:
                lease, reason = await self._park(link, lease, reason)
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
                self.log.warning("kernel %s: agent: %s; keeping its GPU", self.kernel_id, err)
            elif isinstance(err, AgentUnavailable):
                self.no_gpu_reason = (
                    f"No GPU agent answers at {settings.socket_path}, so this kernel started "
                    f"without a GPU lease ({err}). Start one with `{settings.agent_command}`; "
                    "the kernel gets a GPU share as soon as it answers."
                )
            elif err.status in (400, 422) and err.field in ("request", "limit", "devices",
                                                             "logical_gpus", "reachable_gpus"):
                raise GpuFracConfigError(
                    f"GPU {err.field} for kernel {self.kernel_id} was refused by the agent: "
                    f"{err.message}"
                ) from err
            else:
                hide_gpus = True
                self.no_gpu_reason = self._no_room(err.message)
        self._moving = lease is not None and lease.get("state") == "migrating"
        self.lease = lease
        self.last_launch_reason = reason if lease is not None else None
        return hide_gpus

    def _no_room(self, why: str) -> str:
        """Why the agent gave no lease, naming the request and where it came from: a request
        remembered from another notebook is said to be one, with how to change it."""
        asked, source = self.asked_request, (self.share_source or {}).get("request")
        why = _text(why)
        if asked is None:
            return (f"The GPU agent gave this kernel no GPU lease: {why}. It gets one as soon "
                    "as there is room.")
        totals = [int(g["memory_total"]) for g in self.gpus.values() if g.get("memory_total")]
        what = str(asked)
        if asked.fraction is not None and totals:
            what += f" ({format_bytes(asked.bytes_of(max(totals)))})"
        if source == contract.SOURCE_REMEMBERED:
            return (f"The agent had no room for your remembered request of {what}: {why}. Your "
                    "`%gpu request --remember` in this environment is kept for new notebooks; "
                    "`%gpu request --reset` or a smaller `%gpu request` in this notebook changes "
                    "it, and this notebook gets a GPU as soon as there is room for its share.")
        came = contract.SOURCE_WORDS.get(source or "", source)
        return (f"The agent had no room for this kernel's request of {what} (from {came}): "
                f"{why}. It gets a GPU as soon as there is room.")

    async def _park(self, link: AgentLink, lease: dict[str, Any], reason: dict[str, Any]
                    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """The lease gives its GPU back for the parked launch; if the agent refuses, the kernel
        restarts where it was (its GPU tensors then wait in host memory for `%gpu reload`)."""
        # Why, for whoever reads the lease (`gpufrac-agent status`, the REST state): the
        # agent takes at most 200 characters.
        why = _text(reason.get("message"))
        try:
            return await link.park(str(lease["id"]), (why if len(why) <= 200
                                                      else why[:199] + "…") or None), reason
        except AgentError as err:
            if isinstance(err, AgentUnavailable):
                raise
            self.log.warning("kernel %s: the agent did not park lease %s: %s", self.kernel_id,
                             lease["id"], err)
            gpu = lease.get("physical_gpu")
            return lease, {"cause": contract.CAUSE_PLACED, "from_gpu": gpu, "to_gpu": gpu,
                           "message": f"it was to be parked, but the GPU agent refused "
                                      f"({err.message}), so it keeps its GPU"}

    def write_account(self, account: dict[str, Any]) -> None:
        """Leave the kernel its account (contract.ACCOUNT_FILE) in its own folder, where `%gpu`
        reads it: a file, not a message, so nothing reaches a kernel the server is restarting."""
        settings = self.settings()
        if settings.folder_problem or self.checkpoints_off:
            return  # nothing goes into a folder that is not the user's alone
        folder = Path(checkpoint_dir_of(settings.checkpoint_root, self.kernel_id))
        try:
            store.write_file(folder, contract.ACCOUNT_FILE, json.dumps(account).encode(),
                             durable=False, blobs=False)
        except (OSError, store.UnsafeCheckpointError) as exc:
            self.log.info("kernel %s: could not leave its account: %s", self.kernel_id, exc)

    def wake(self) -> bool:
        """Wake the kernel's directive thread (the agent addressed its lease): it reads the
        lease's directives at once. False when no kernel listens (dead, or starting)."""
        if self.checkpoints_off:
            return False  # its folder is not the user's alone: the kernel listens on none
        return wake(wake_path(checkpoint_dir_of(self.settings().checkpoint_root,
                                                self.kernel_id)))

    async def launched(self, pid: int | None) -> None:
        """The kernel process runs: register its pid with the lease, finish a move, say where."""
        settings = self.settings()
        self.pid = pid
        self.launches += 1
        self.last_launch_time = time.time()
        if self.lease is not None and pid is not None:
            link = AgentLink(settings.socket_path)
            try:
                lease = await link.register_pid(str(self.lease["id"]), pid)
                if self._moving:
                    lease = await link.migrated(str(self.lease["id"]))
                self.lease = lease
            except AgentError as err:  # AgentUnavailable included
                self.log.warning("kernel %s: could not register pid %s: %s", self.kernel_id,
                                 pid, err)
            self._moving = False
        self._announce_launch(settings)

    def _announce_launch(self, settings: KernelSettings) -> None:
        kernel_id = self.kernel_id
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
            "gpu_index": self.index(uuid),
            "request": lease.get("request"),
            "limit": lease.get("limit"),
            "usage": lease.get("usage"),
        }
        reason = self.last_launch_reason
        if lease.get("state") == "parked":
            settings.events.emit(
                kernel_id, "parked",
                f"{_text((reason or {}).get('message')) or 'Parked'}: it holds no GPU now and "
                "keeps its variables in host memory; its next cell gets a GPU first, then runs.",
                reason=(reason or {}).get("message") or "", request=lease.get("request"),
                limit=lease.get("limit"), seconds=(reason or {}).get("idle_s"),
            )
            return
        moved = (contract.CAUSE_MIGRATED, contract.CAUSE_REQUEST_CHANGED)
        if reason is not None and reason.get("cause") in moved:
            source, target = reason.get("from_gpu"), reason.get("to_gpu") or uuid
            settings.events.emit(
                kernel_id, "migrated",
                f"{_text(reason.get('message')) or 'Moved from ' + self.label(source)}"
                "; restoring its variables.",
                reason=reason.get("message") or "",
                from_gpu_index=self.index(source), to_gpu_index=self.index(target),
                **figures,
            )
            return
        request, limit = int(lease.get("request") or 0), int(lease.get("limit") or 0)
        restarted = ("" if reason is None else
                     ", resuming this notebook's state from its last checkpoint,"
                     if reason.get("cause") == contract.CAUSE_RESUMED
                     else " after it was stopped, restoring its variables")
        settings.events.emit(
            kernel_id, "placed",
            f"Running on {self.label(uuid)}{restarted} with {format_bytes(request)} "
            f"guaranteed, bursting up to {format_bytes(limit)}.",
            reason=(reason or {}).get("message") or "",
            **figures,
        )

    # -- the lease ---------------------------------------------------------------------

    async def _read_node(self, link: AgentLink) -> None:
        node = await link.node()
        self.gpus = {gpu["uuid"]: gpu for gpu in node.get("gpus", [])}
        self.simulated = bool(node.get("simulated"))

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

    async def _create_lease(self, link: AgentLink, settings: KernelSettings,
                            env: Mapping[str, str]) -> dict[str, Any]:
        # On Kubernetes: KAI's share for the pod, and its plan (the GPUs it gave the pod).
        pod = read_podinfo(os.environ)
        planned = cluster_gpus(os.environ, pod) if pod is not None else None
        share = resolve_share(
            self.metadata, settings.last_request(), os.environ, settings.default_request,
            settings.default_limit, pod.share() if pod is not None else None,
        )
        if pod is not None:
            self.log.info("kernel %s: in pod %s/%s, container %s; the cluster planned GPUs %s",
                          self.kernel_id, pod.namespace or "?", pod.name or "?", pod.container,
                          ", ".join(planned) if planned else "none")
        totals = [int(gpu["memory_total"]) for gpu in self.gpus.values() if gpu.get("memory_total")]
        limit = share.effective_limit(min(totals) if totals else None)
        self.share_source = {"request": share.request_source,
                             "limit": share.limit_source if limit is not None else None}
        self.asked_request = share.request
        self.log.info(
            "kernel %s: asking for request %s (%s), limit %s (%s)", self.kernel_id,
            share.request.spec, share.request_source, limit.spec if limit else None,
            share.limit_source,
        )

        def wire(quantity: Quantity | None) -> str | None:
            return None if quantity is None else quantity.spec

        lease = await link.create_notebook_lease(
            request=share.request.spec,
            limit=wire(limit),
            client=settings.client_name,
            kernel_id=self.kernel_id,
            name=env.get("JPY_SESSION_NAME", ""),
            compute_request=wire(share.compute_request),
            compute_limit=wire(share.compute_limit),
            devices=len(planned) if planned else 1,
            logical_gpus=planned,
            reachable_gpus=reachable_gpus(os.environ, planned) if pod is not None else None,
        )
        self.asked_share = (str(lease.get("request_spec")), lease.get("limit_spec"))
        return lease

    async def acquire_lease(self) -> dict[str, Any] | None:
        """A lease for a kernel running without one, once the agent has room; None if not yet.

        The kernel keeps running where it is: the caller restarts it onto the lease (with its
        variables), since a process cannot change GPUs.
        """
        lease = await self._new_lease()
        if lease is not None:
            self.lease, self.no_gpu_reason = lease, None
        return lease

    async def _new_lease(self) -> dict[str, Any] | None:
        """A lease made for this kernel, not yet its own (``self.lease``); None if no room."""
        if self.closed:
            return None
        settings = self.settings()
        link = AgentLink(settings.socket_path)
        try:
            await self._read_node(link)
            lease = await self._create_lease(link, settings, {})
        except AgentError:
            return None
        if self.closed:
            # The kernel shut down while the lease was being made: nobody would release it.
            await self._give_back(settings, str(lease["id"]))
            return None
        return lease

    async def refresh(self) -> dict[str, Any] | None:
        """The lease as the agent has it now (raises :class:`AgentError` when it cannot say)."""
        if self.lease is None:
            return None
        self.lease = await AgentLink(self.settings().socket_path).lease(str(self.lease["id"]))
        return self.lease

    async def reregister(self) -> str:
        """Make sure the agent knows this kernel's lease (a fresh agent may not); say what was done.

        Returns ``kept`` (the agent has it), ``recreated`` (same GPU, pid registered again),
        ``moved`` (the new lease is on another GPU: the kernel must restart onto it) or
        ``lost`` (the agent gives no lease now).
        """
        if self.lease is None:
            return "lost"
        try:
            await self.refresh()
            return "kept"
        except AgentError as err:
            if err.status != 404:
                raise
        running_on = lease_gpus(self.lease)
        self.lease = None
        lease = await self._new_lease()
        if lease is None:
            self.no_gpu_reason = ("The GPU agent restarted without this kernel's lease and has no "
                                  "room for it now; it gets one as soon as there is room.")
            return "lost"
        outcome = "moved" if lease_gpus(lease) != running_on else "recreated"
        if outcome == "recreated" and self.pid is not None:
            # The lease becomes the kernel's only with its pid: a status read in between would
            # show a share that no process is charged against.
            link = AgentLink(self.settings().socket_path)
            try:
                lease = await link.register_pid(str(lease["id"]), self.pid)
            except AgentError:
                self.lease = lease  # still this kernel's, to be released when it closes
                raise
        self.lease, self.no_gpu_reason = lease, None
        return outcome

    def parkable(self, now: float, wait: float) -> bool:
        """Whether an idle kernel may be parked now (``wait``: seconds after a refusal)."""
        return (self.hooked and self.lease is not None and self.lease.get("state") == "active"
                and self.launches > 0 and not self.closed and now - self.park_refused >= wait)

    def changed_share(self, request: str, limit: str | None) -> bool:
        """The agent says the lease's share is now ``request``/``limit``: whether the user changed
        it in the kernel (``%gpu request``), which then is where the share comes from."""
        spec = (request, limit)
        if self.asked_share is None or spec == self.asked_share:
            return False
        self.asked_share = spec
        self.share_source = {"request": contract.SOURCE_MAGIC, "limit": contract.SOURCE_MAGIC}
        return True

    async def close(self) -> None:
        """The kernel shut down for good: give the lease back; never take one again."""
        self.closed = True
        if self.lease is None:
            return
        settings = self.settings()
        lease_id = str(self.lease["id"])
        self.lease = None
        await self._give_back(settings, lease_id)
        settings.events.forget(self.kernel_id)

    async def _give_back(self, settings: KernelSettings, lease_id: str) -> None:
        try:
            await AgentLink(settings.socket_path).release(lease_id)
        except AgentUnavailable:
            self.log.info("kernel %s: agent gone; lease %s not released", self.kernel_id, lease_id)
        except AgentError as err:
            if err.status != 404:
                self.log.warning("kernel %s: releasing lease %s: %s", self.kernel_id, lease_id, err)


class Kernels:
    """This server's kernels' GPU states by kernel id. The kernel manager says which kernels
    exist; a kernel not started by the gpufrac provisioner has none."""

    def __init__(self, kernel_manager: Any | None) -> None:
        self.kernel_manager = kernel_manager

    def get(self, kernel_id: str) -> KernelGpu | None:
        """The kernel's GPU state, or None (no such kernel, or not ours)."""
        # jupyter_server's get_kernel answers an unknown id with an HTTP 404, not a KeyError:
        # a lease of the user's other server (its kernel unknown here) must not end a request.
        if self.kernel_manager is None or kernel_id not in self.kernel_manager:
            return None
        return gpu_of(self.kernel_manager.get_kernel(kernel_id))

    def items(self) -> list[tuple[str, KernelGpu]]:
        """(kernel id, GPU state) of every kernel of ours."""
        found: list[tuple[str, KernelGpu]] = []
        if self.kernel_manager is None:
            return found
        for kernel_id in list(self.kernel_manager.list_kernel_ids()):
            gpu = self.get(kernel_id)
            if gpu is not None:
                found.append((kernel_id, gpu))
        return found


def gpu_of(kernel: Any) -> KernelGpu | None:
    """The GPU state a kernel manager's provisioner keeps, if it is ours."""
    gpu = getattr(getattr(kernel, "provisioner", None), "gpu", None)
    return gpu if isinstance(gpu, KernelGpu) else None


def _text(message: object) -> str:
    """A reason without its final full stop, to continue the sentence."""
    return str(message or "").strip().rstrip(".")
