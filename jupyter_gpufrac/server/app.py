"""The ``GpuFrac`` server extension: config, the embedded agent, REST, events and directives."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import time
from typing import Any

import psutil
import zmq
from jupyter_server.extension.application import ExtensionApp
from traitlets import List, Unicode, default, validate

from jupyter_gpufrac import contract
from jupyter_gpufrac.kernel.budget import parse_budget
from jupyter_gpufrac.server.agent_link import (
    AgentError,
    AgentLink,
    AgentUnavailable,
    server_client_name,
    server_client_prefix,
)
from jupyter_gpufrac.server.agent_socket import default_agent_socket
from jupyter_gpufrac.server.checkpoint_folder import (
    CheckpointFolder,
    checkpoint_budgets,
    disk_budget_specs,
    staging_budget,
)
from jupyter_gpufrac.server.config_traits import (
    NotedBool,
    NotedFloat,
    NotedInt,
    NotedList,
    NotedUnicode,
)
from jupyter_gpufrac.server.directive_listener import DirectiveListener
from jupyter_gpufrac.server.embedded_agent import EmbeddedAgent
from jupyter_gpufrac.server.events import KernelEventLog
from jupyter_gpufrac.server.handlers import handlers, own_leases
from jupyter_gpufrac.server.keeper import StateKeeper
from jupyter_gpufrac.server.kernel_follower import KernelFollower
from jupyter_gpufrac.server.kernels import Kernels
from jupyter_gpufrac.server.launch import lease_gpus
from jupyter_gpufrac.server.notebook_states import ServerInfo, current_user, owner_problem
from jupyter_gpufrac.server.settings import (
    KernelSettings,
    agent_command,
    checkpoint_folder_problem,
    default_checkpoint_root,
)
from jupyter_gpufrac.server.spares import SparePool, default_enabled
from jupyter_gpufrac.server.stopping import FlushSocket
from node_agent.quantities import QuantityError, parse_quantity

_SIMULATE_SPEC = re.compile(r"^\s*\d+\s*x\s*\S+\s*$")
AGENT_CHECK_TIMEOUT_S = 2.0
# Restarting an embedded agent that keeps dying: at most once per this many seconds.
EMBEDDED_RESTART_EVERY_S = 5.0
RECONNECT_IVL_MS = 10  # a kernel socket's first retry; then doubling, up to:
RECONNECT_IVL_MAX_MS = 25
# The ranges of the settings in seconds.
HOUR = 3600.0
DAY = 24 * HOUR
YEAR = 365 * DAY
KEEP_AT_MOST_S = 10 * YEAR
MIN_SWEEP_INTERVAL_S = 0.1


class GpuFrac(ExtensionApp):
    """Makes notebook kernels first-class citizens of shared GPUs."""

    name = "jupyter_gpufrac"
    load_other_extensions = True

    # Bad c.GpuFrac settings, each a sentence naming the setting and what was expected.
    config_problems = List(Unicode())  # not a setting: what is wrong with them

    agent_socket = NotedUnicode(
        help="Unix socket of the node agent. Default: $GPUFRAC_AGENT_SOCKET, else the system "
        "agent's /run/gpufrac/agent.sock when it exists, else a per-user socket.",
    ).tag(config=True)

    default_request = NotedUnicode(
        "0.25",
        help="GPU memory a kernel is guaranteed when its kernelspec (metadata.gpufrac.request) "
        "and the user's last %gpu request say nothing: a fraction of one GPU (0.25) or memory "
        "(2500M, 4G, 4Gi, bytes).",
    ).tag(config=True)

    default_limit = NotedUnicode(
        "1",
        help="Most GPU memory a kernel may burst to when nothing more specific says: a fraction "
        "or memory, at least default_request. RUNAI_GPU_MEMORY_LIMIT in the server's "
        "environment takes precedence. Empty: the limit is the request (no bursting).",
    ).tag(config=True)

    migrate_grace_period = NotedFloat(
        30.0, min=0, max=DAY,
        help="Seconds a running cell may finish before a kernel that must move is restarted "
        "from its last checkpoint instead of a fresh one.",
    ).tag(config=True, unit="seconds")

    checkpoint_dir = NotedUnicode(
        help="Directory for kernel checkpoints (one 0700 subdirectory per kernel). "
        "Default: <jupyter data dir>/gpufrac/checkpoints.",
    ).tag(config=True)

    checkpoint_keep_seconds = NotedFloat(
        86400.0, min=0, max=KEEP_AT_MOST_S,
        help="Seconds a kernel's checkpoint is kept after its user shut the kernel down, then "
        "removed (at a server start, or by the periodic sweep). A server stop or crash marks "
        "nothing: the checkpoints of the kernels it ran are removed once nothing was written in "
        "them for this long (and for two checkpoint_sweep_interval), so a notebook reopened "
        "after a crash can still find its state. 0: removed at the next sweep.",
    ).tag(config=True, unit="seconds")

    checkpoint_sweep_interval = NotedFloat(
        3600.0, min=0, max=DAY,
        help="Seconds between sweeps of the checkpoint folder for expired checkpoints (see "
        "checkpoint_keep_seconds); each sweep also marks this server's running kernels' folders "
        "as in use, for other servers of yours sharing the folder. 0: only at server start.",
    ).tag(config=True, unit="seconds")

    checkpoint_kernel_budget = NotedUnicode(
        "25%",
        help="The most disk one kernel's checkpoint may take: a share of the space free for "
        "checkpoints (free disk under checkpoint_dir plus what your checkpoints there already "
        "take, measured again by each kernel as the disk fills and empties), like 25%, or a "
        "size like 20GiB, 500M or bytes. A "
        "checkpoint protects the variables that fit, smallest first, and names the others "
        "(%gpu, the panel, a restore). 0: nothing is protected.",
    ).tag(config=True)

    checkpoint_user_budget = NotedUnicode(
        "50%",
        help="The most disk all your kernels' checkpoints may take together (shut-down kernels' "
        "kept ones count too): a share of the space free for checkpoints (see "
        "checkpoint_kernel_budget), like 50%, or a size like 100GiB or bytes.",
    ).tag(config=True)

    checkpoint_staging_budget = NotedUnicode(
        "25%",
        help="The most memory one kernel's snapshot may copy at a cell's end, to be written in "
        "the background: its changed tensors and arrays (GPU ones into pinned host memory). A "
        "share of the host's RAM like 25%, or a size like 8GiB or bytes. Host tensors and "
        "watched arrays beyond it are written from where they are, kept if the notebook did not "
        "change them meanwhile; other variables over it are named as not protected (%gpu, the "
        "panel, a restore). 0: nothing is copied.",
    ).tag(config=True)

    resume = NotedUnicode(
        contract.RESUME_ALWAYS,
        help="What a new kernel of a notebook does with the state its earlier kernel left when "
        "that kernel did not end by its user's shutdown (its server or node went away, or "
        "jupyter_server culled it), found by any server that reads checkpoint_dir: 'always' "
        "resumes it (variables, cell numbers, random generators), 'ask' starts fresh and lets "
        "JupyterLab ask whether to restore it, 'never' starts fresh. `%gpu restore` in the "
        "fresh kernel takes it over either way.",
    ).tag(config=True)

    stop_grace_period = NotedFloat(
        20.0, min=0, max=HOUR,
        help="Seconds the server may spend, when it is told to stop (SIGTERM: Kubernetes, "
        "JupyterHub, systemd, `jupyter server stop`), making every kernel's checkpoint durable "
        "before it stops them; the log says which were and which not, and why. Keep it below "
        "what the stopper waits before SIGKILL (Kubernetes: terminationGracePeriodSeconds, 30 "
        "by default) less a few seconds for the kernels to stop.",
    ).tag(config=True)

    embedded_agent = NotedBool(
        True,
        help="Start a node agent as a child process when none answers at agent_socket at "
        "server start, and stop it with the server.",
    ).tag(config=True)

    embedded_agent_simulate = NotedUnicode(
        "2x16GiB",
        help="The node the embedded agent simulates when NVML does not initialise "
        "(COUNTxMEMORY, e.g. 2x16GiB or 4xH100-80GB). Empty: no fallback, NVML or nothing.",
    ).tag(config=True)

    embedded_agent_nvml = NotedBool(
        True,
        help="Whether the embedded agent tries NVML first. False: it always runs the simulated "
        "node of embedded_agent_simulate (a demo, or tests, on a machine with a GPU).",
    ).tag(config=True)

    node_scheduler = NotedBool(
        True,
        help="The embedded agent's node scheduler: spread burstable kernels (limit above "
        "request) over idle GPUs and move them back when room is needed. False: every kernel "
        "runs where it is planned; memory is still taken back from borrowers.",
    ).tag(config=True)

    max_workloads_per_gpu = NotedInt(
        None,
        allow_none=True,
        min=1,
        help="How many leases one GPU may run at once under the embedded agent (Run:ai's "
        "workloads per GPU). None: not enforced.",
    ).tag(config=True)

    embedded_agent_timeout = NotedFloat(
        30.0, min=0.1, max=HOUR,
        help="Seconds to wait for the embedded agent to answer before giving up on it.",
    ).tag(config=True, unit="seconds")

    lease_poll_interval = NotedFloat(
        5.0, min=0.1, max=HOUR,
        help="Seconds between looks for a GPU share for kernels that started without one, and "
        "for kernels idle past park_after (bursting and %gpu request changes come from the "
        "agent as they happen).",
    ).tag(config=True, unit="seconds")

    park_after = NotedFloat(
        900.0, min=0, max=YEAR,
        help="Seconds a notebook kernel may stay idle before it is parked: checkpointed, "
        "restarted without a GPU (CUDA untouched, tensors in host memory), its lease holding no "
        "GPU memory. Its variables and the open notebook stay; its next cell gets a GPU first "
        "(any with room) and then runs. 0 turns parking off.",
    ).tag(config=True, unit="seconds")

    agent_check_interval = NotedFloat(
        1.0, min=0.1, max=HOUR,
        help="Seconds between checks that the agent answers; a lost agent is shown within "
        "this plus two seconds, and the embedded agent is restarted.",
    ).tag(config=True, unit="seconds")

    spare_kernels = NotedBool(
        help="Keep a pre-started kernel process for each ipykernel kernelspec in use, with "
        "ipykernel, the kernel hook and spare_kernel_imports imported and CUDA not initialised: "
        "a kernel that moves to another GPU or is restored after a kill starts in it (same "
        "kernel id, ports and connection) instead of a cold interpreter, and a new spare starts "
        "in the background. Each spare is an idle interpreter (about 0.25 GiB with a CPU build "
        "of torch, more with a CUDA build), at most max_spare_kernels of them. Default: on when "
        "the memory available at server start is at least 8 spares' worth (a spare counted as "
        "0.5 GiB with torch, 96 MiB without: 4 GiB). Either way a spare starts only while 8 "
        "spares' worth is available (as measured on the last one) and a ready spare is stopped "
        "when less than 2 spares' worth is left.",
    ).tag(config=True)

    spare_kernel_imports = NotedList(
        Unicode(), ["torch"],
        help="Modules a spare kernel imports in advance, besides ipykernel and the kernel hook "
        "(never anything that initialises CUDA at import). A module the kernel's environment "
        "cannot import is skipped and named in the server log.",
    ).tag(config=True)

    max_spare_kernels = NotedInt(
        2, min=0, max=64,
        help="How many spare kernels the server keeps at most, one per kernelspec in use.",
    ).tag(config=True)

    @default("spare_kernels")
    def _default_spare_kernels(self) -> bool:
        enabled = default_enabled(self.spare_kernel_imports)
        if not enabled:
            self.log.info("gpufrac: spare kernels off: too little memory available for them")
        return enabled

    @default("agent_socket")
    def _default_agent_socket(self) -> str:
        return default_agent_socket(self.log)

    @default("checkpoint_dir")
    def _default_checkpoint_dir(self) -> str:
        return default_checkpoint_root()

    @validate("default_request", "default_limit")
    def _validate_quantity(self, proposal: Any) -> str:
        name = proposal.trait.name
        value = str(proposal.value).strip()
        if name == "default_limit" and value == "":
            return value
        try:
            parse_quantity(value, f"c.GpuFrac.{name}")
        except QuantityError as err:
            return self._bad_setting(proposal, f"{err.field}: {err.message}")
        return value

    @validate("resume")
    def _validate_resume(self, proposal: Any) -> str:
        value = str(proposal.value).strip().lower()
        if value not in contract.RESUME_MODES:
            return self._bad_setting(
                proposal, f"c.GpuFrac.resume: expected one of {', '.join(contract.RESUME_MODES)}, "
                f"got {proposal.value!r}")
        return value

    @validate("checkpoint_sweep_interval")
    def _validate_sweep_interval(self, proposal: Any) -> float:
        value = float(proposal.value)
        if 0 < value < MIN_SWEEP_INTERVAL_S:
            # A sweep walks the folder: a sweep every nanosecond is a busy server.
            return self._bad_setting(
                proposal, f"c.GpuFrac.checkpoint_sweep_interval: expected 0 (only at server "
                f"start) or seconds from {MIN_SWEEP_INTERVAL_S:g} to {DAY:g}, got {value!r}")
        return value

    @validate("checkpoint_kernel_budget", "checkpoint_user_budget", "checkpoint_staging_budget")
    def _validate_budget(self, proposal: Any) -> str:
        value = str(proposal.value).strip()
        try:
            parse_budget(value, f"c.GpuFrac.{proposal.trait.name}",
                         "the host's RAM" if proposal.trait.name == "checkpoint_staging_budget"
                         else "the free disk")
        except QuantityError as err:
            return self._bad_setting(proposal, f"{err.field}: {err.message}")
        return value

    def checkpoint_budgets(self, taken: int | None = None) -> tuple[int, int]:
        """(per-kernel, per-user) checkpoint budgets in bytes now (see ``checkpoint_budgets``)."""
        return checkpoint_budgets(self.checkpoint_dir, self.checkpoint_kernel_budget,
                                  self.checkpoint_user_budget, taken)

    def staging_budget(self) -> int:
        """The snapshot memory budget in bytes: a share of the host's RAM, or a size."""
        return staging_budget(self.checkpoint_staging_budget)

    @validate("agent_socket", "checkpoint_dir")
    def _validate_path(self, proposal: Any) -> str:
        value = os.path.expanduser(str(proposal.value).strip())
        if not value:
            return self._bad_setting(
                proposal, f"c.GpuFrac.{proposal.trait.name}: expected a path, got an empty string")
        if not os.path.isabs(value):
            return self._bad_setting(
                proposal,
                f"c.GpuFrac.{proposal.trait.name}: expected an absolute path, got {proposal.value!r}",
            )
        return value

    @validate("embedded_agent_simulate")
    def _validate_simulate(self, proposal: Any) -> str:
        value = str(proposal.value).strip()
        if value and not _SIMULATE_SPEC.match(value):
            return self._bad_setting(
                proposal, "c.GpuFrac.embedded_agent_simulate: expected COUNTxMEMORY like 2x16GiB "
                f"or 4xH100-80GB, got {proposal.value!r}")
        return value

    def _bad_setting(self, proposal: Any, problem: str) -> Any:
        """A setting that is wrong: noted, and its default kept so the rest of the extension
        runs."""
        self._note_problem(problem)
        return proposal.trait.default_value

    def bad_value(self, name: str, problem: str) -> None:
        """A value of the wrong type or out of range (config_traits): noted; the trait keeps
        its default, and every other setting stands."""
        self._note_problem(problem)

    def _note_problem(self, problem: str) -> None:
        """Said once in the log and in every kernel's widget; kernels get no GPU lease until
        it is fixed (a share from a default nobody chose would hide the mistake)."""
        if problem not in self.config_problems:
            self.config_problems.append(problem)
            self.log.error("jupyter_gpufrac: %s; kernels start without a GPU lease until it is "
                           "fixed and the server restarted", problem)

    def _reconnect_soon(self) -> None:
        """Make the server's kernel sockets (each page's too) reconnect within 25 ms, not ZMQ's
        100 ms. A move, a park or a kill's recovery restarts a kernel on the same ports, and
        an open page keeps its connection; until its IOPub socket has reconnected, what the
        new process prints is lost. A restore in a spare kernel can end in 80 ms, and a cell
        sent at once then lost its output (3 of 20 moves; none of 20 with this)."""
        context = getattr(getattr(self.serverapp, "kernel_manager", None), "context", None)
        if isinstance(context, zmq.Context):
            context.setsockopt(zmq.RECONNECT_IVL, RECONNECT_IVL_MS)
            context.setsockopt(zmq.RECONNECT_IVL_MAX, RECONNECT_IVL_MAX_MS)

    def check_limits(self) -> None:
        """request <= limit where both are of one kind (fractions, or bytes)."""
        if not self.default_limit:
            return
        request = parse_quantity(self.default_request, "c.GpuFrac.default_request")
        limit = parse_quantity(self.default_limit, "c.GpuFrac.default_limit")
        for a, b in ((request.fraction, limit.fraction), (request.nbytes, limit.nbytes)):
            if a is not None and b is not None and b < a:
                self._note_problem(f"c.GpuFrac.default_limit: must be at least default_request "
                                   f"({self.default_request}), got {self.default_limit}")
                return

    def check_folders(self) -> None:
        """The data and checkpoint folders must be the user's alone (a shared home or project
        folder may hold one another user made): else kernels start without checkpoints, and
        the log and the panel's config problems say which folder and how to fix it. Unlike
        other config problems this one does not withhold GPU leases."""
        problem = checkpoint_folder_problem(self.checkpoint_dir)
        if problem is None:
            problem = owner_problem(self.checkpoint_dir, self.kernel_settings.user)
        self.kernel_settings.folder_problem = problem
        if problem is None:
            return
        text = (f"checkpoints are off: {problem}, then restart the server; until then kernels "
                "start without checkpoints (a crash, a move or a park loses their variables) "
                "and no %gpu request is remembered")
        if text not in self.config_problems:
            self.config_problems.append(text)
        self.log.error("jupyter_gpufrac: %s", text)

    # -- wiring ------------------------------------------------------------------------

    def initialize_settings(self) -> None:
        """Events, the agent link and what every kernel's provisioner reads."""
        self.check_limits()
        km = getattr(self.serverapp, "kernel_manager", None)
        untracked = getattr(km, "untracked_message_types", None)
        if km is not None and isinstance(untracked, list):
            # The server's checkpoint-status questions are not the user's activity (park_after,
            # "restored until used"), nor a busy kernel in JupyterLab, which reads this list.
            km.untracked_message_types = [*untracked, *(
                kind for kind in (contract.CHECKPOINT_STATUS_REQUEST,
                                  contract.CHECKPOINT_STATUS_REPLY) if kind not in untracked)]
        # An empty string set in config skips validation (it equals the unset value): default.
        self.agent_socket = self.agent_socket or self._default_agent_socket()
        self.checkpoint_dir = self.checkpoint_dir or self._default_checkpoint_dir()
        event_logger = getattr(self.serverapp, "event_logger", None)
        if event_logger is not None:
            event_logger.register_event_schema(contract.EVENT_SCHEMA_PATH)
        self.events = KernelEventLog(event_logger, self.log)
        self.link = AgentLink(self.agent_socket)
        self.client_name = server_client_name()
        from jupyter_core.paths import jupyter_runtime_dir

        self.agent_state_dir = os.path.join(jupyter_runtime_dir(), "gpufrac-agent")
        # None while the agent answers; else why not, for the REST models and the events.
        self.agent_error: str | None = None
        self.embedded: EmbeddedAgent | None = None
        self.listener: DirectiveListener | None = None
        self.kernels = Kernels(getattr(self.serverapp, "kernel_manager", None))
        self._reconnect_soon()
        self._tasks: set[asyncio.Task[Any]] = set()
        self.spares = (SparePool(self.spare_kernel_imports, self.max_spare_kernels, self.log)
                       if self.spare_kernels else None)
        # While the server looks for (or starts) its agent, kernels wait for it to be set.
        self._agent_looking = False
        self._agent_checked = asyncio.Event()
        self.kernel_settings = KernelSettings(
            socket_path=self.agent_socket,
            client_name=self.client_name,
            default_request=self.default_request,
            default_limit=self.default_limit,
            checkpoint_root=self.checkpoint_dir,
            events=self.events,
            agent_command=agent_command(self.agent_socket, self.agent_state_dir),
            config_problems=tuple(self.config_problems),
            checkpoint_keep_seconds=self.checkpoint_keep_seconds,
            log=self.log,
            user=current_user(),
            notebook_root=self._notebook_root(),
            server=ServerInfo.here(),
            resume=self.resume,
        )
        # A size is given to each kernel as bytes; a share, as the share: each kernel measures
        # the disk again as it fills and empties (a disk full at the server's start must not
        # fix its kernels' budgets for the server's life).
        specs = disk_budget_specs(self.checkpoint_kernel_budget, self.checkpoint_user_budget)
        self.kernel_settings.checkpoint_disk_shares = {
            name: share for name, (share, _) in specs.items() if share is not None}
        (self.kernel_settings.checkpoint_kernel_budget,
         self.kernel_settings.checkpoint_user_budget) = (
            None if share is not None else int(nbytes or 0) for share, nbytes in specs.values())
        self.kernel_settings.checkpoint_staging_budget = self.staging_budget()
        self.check_folders()
        self.keeper = StateKeeper(self.kernels, self.kernel_settings, self.stop_grace_period,
                                  self.log)
        self.follower = KernelFollower(
            self.serverapp, self.kernels, self.events, self.keeper, self._spawn,
            lambda: self.agent_error, self.log, resume=self.resume,
            lease_poll_interval=self.lease_poll_interval, park_after=self.park_after,
        )
        self.kernel_settings.on_launched = self.follower.launched
        self.events.on_event = self.follower.account_changed
        self.keeper.follow_renames(event_logger)
        if km is not None:
            self.keeper.watch_culling(km)
        self._stopping: asyncio.Task[None] | None = None
        self.flush_socket: FlushSocket | None = None
        self.checkpoint_folder = CheckpointFolder(
            self.checkpoint_dir, self.checkpoint_keep_seconds, self.checkpoint_sweep_interval,
            self.kernels, self.kernel_settings, self.checkpoint_budgets, self.log)
        self.settings["gpufrac_app"] = self
        self.log.info(
            "gpufrac: agent socket %s, checkpoints in %s, client %s",
            self.agent_socket, self.checkpoint_dir, self.client_name,
        )

    def initialize_handlers(self) -> None:
        """``/api/gpufrac/node`` and ``/api/gpufrac/kernels/<id>``."""
        self.handlers.extend(handlers())

    async def _start_jupyter_server_extension(self, serverapp: Any) -> None:
        """Start (or find) the agent, then listen for directives and watch leases."""
        if getattr(self, "kernel_settings", None) is None:
            return  # not loaded (invalid configuration, already reported)
        if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            # Without a terminal (a Hub's spawner, systemd) jupyter_server leaves SIGINT alone,
            # and the spawner's SIGINT then ends the server with no cleanup: kernels and their
            # leases stay behind. Stop as on SIGTERM instead.
            signal.signal(signal.SIGINT, lambda *_: serverapp.stop(from_signal=True))
        await self.ensure_agent()
        await self.release_stale_leases()
        self.listener = DirectiveListener(
            self.link, self.client_name, serverapp.kernel_manager, self.kernels, self.events,
            self.migrate_grace_period, self.log,
        )
        self.follower.listener = self.listener
        self._spawn(self.listener.run())
        self._spawn(self.follower.watch_leases())
        self._spawn(self._watch_agent())
        self._spawn(self.checkpoint_folder.sweep_forever())
        if not self.kernel_settings.folder_problem:
            self._spawn(self.keeper.say_if_hard_links_refused())
        self.flush_socket = FlushSocket(serverapp.runtime_dir, self.keeper.flush, self.log)
        await self.flush_socket.start()

    async def agent_ready(self, kernel_id: str) -> None:
        """Wait until the server has found (or started) its agent; not past its deadline."""
        checked = getattr(self, "_agent_checked", None)
        if checked is None or checked.is_set() or not self._agent_looking:
            return  # not loaded, not looking (no start hook ran) or ready
        self.log.info("kernel %s: waiting for the GPU agent to start", kernel_id)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(checked.wait(), self.embedded_agent_timeout + 5)

    async def ensure_agent(self) -> None:
        """Use the agent at the socket; without one, start the embedded agent if configured."""
        self._agent_looking = True
        try:
            await self._ensure_agent()
        finally:
            self._agent_checked.set()

    async def _ensure_agent(self) -> None:
        try:
            await self.link.node()
            self.log.info("gpufrac: using the GPU agent at %s", self.agent_socket)
            return
        except AgentUnavailable as err:
            if not self.embedded_agent:
                self.log.warning(
                    "gpufrac: %s; kernels start without GPU leases until an agent runs", err
                )
                return
        agent = EmbeddedAgent(
            self.agent_socket, self.agent_state_dir, self.embedded_agent_simulate, self.log,
            use_nvml=self.embedded_agent_nvml, node_scheduler=self.node_scheduler,
            max_workloads_per_gpu=self.max_workloads_per_gpu,
        )
        try:
            await agent.start(self.embedded_agent_timeout)
        except Exception as err:
            self.log.error("gpufrac: could not start the embedded GPU agent: %s", err)
            return
        self.embedded = agent

    async def stop_extension(self) -> None:
        """Make every kernel's checkpoint durable, stop listening, stop the embedded agent (after
        giving back our kernels' leases). A second stop (SIGTERM during a Hub's SIGINT) waits
        for the first."""
        if getattr(self, "kernel_settings", None) is None:
            return
        if self._stopping is None:
            self._stopping = asyncio.ensure_future(self._stop())
        await asyncio.shield(self._stopping)

    async def _stop(self) -> None:
        # The server shuts its kernels down next: not their users' doing, so their checkpoints
        # are not marked (they expire like a crashed server's, by their last write), and the
        # next kernel of each notebook, on any server reading checkpoint_dir, resumes it.
        self.kernel_settings.server_stopping = True
        if self.flush_socket is not None:
            await self.flush_socket.stop()
        await self.keeper.stopping()
        if self.listener is not None:
            await self.listener.stop()
        if self.spares is not None:
            await self.spares.stop()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.embedded is not None:
            # The server shuts kernels down after its extensions: release their leases now,
            # while the agent still answers, so its ledger holds nothing stale next time.
            for _, gpu in self.kernels.items():
                lease, gpu.lease = gpu.lease, None
                if lease is not None:
                    try:
                        await self.link.release(str(lease["id"]))
                    except Exception as err:
                        self.log.info("gpufrac: lease %s not released: %s", lease["id"], err)
            await self.embedded.stop()
            self.embedded = None

    def _notebook_root(self) -> str:
        """The folder the server serves notebooks from (notebooks are named by paths in it)."""
        contents = getattr(self.serverapp, "contents_manager", None)
        root = getattr(contents, "root_dir", None) or getattr(self.serverapp, "root_dir", "")
        return os.path.abspath(str(root)) if root else ""

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            self.log.error("gpufrac: background task failed", exc_info=task.exception())

    # -- the agent's health ------------------------------------------------------------

    async def _watch_agent(self) -> None:
        """Notice a lost agent within seconds, restart the embedded one, reconcile on return."""
        link = AgentLink(self.agent_socket, timeout=AGENT_CHECK_TIMEOUT_S)
        last_restart = 0.0
        while True:
            await asyncio.sleep(self.agent_check_interval)
            try:
                last_restart = await self._check_agent(link, last_restart)
            except Exception:  # the watch must outlive any one bad answer
                self.log.exception("gpufrac: checking the GPU agent failed; checking again")

    async def _check_agent(self, link: AgentLink, last_restart: float) -> float:
        """One look at the agent; returns when the embedded agent was last restarted."""
        try:
            await link.node()
        except AgentUnavailable as err:
            if self.agent_error is None:
                self._agent_lost(str(err))
            embedded = self.embedded
            if (embedded is not None and embedded.exited()
                    and time.monotonic() - last_restart >= EMBEDDED_RESTART_EVERY_S):
                last_restart = time.monotonic()
                try:
                    await embedded.start(self.embedded_agent_timeout)
                except Exception as start_err:
                    self.log.error("gpufrac: restarting the embedded GPU agent failed: %s",
                                   start_err)
            return last_restart
        if self.agent_error is not None:
            await self._agent_back()
        return last_restart

    def agent_loss_text(self) -> str:
        """What people read while the agent does not answer, with what to do about it."""
        if self.embedded is not None:
            todo = "the server is restarting its embedded agent (same socket and state)"
        else:
            todo = f"start it with `{self.kernel_settings.agent_command}`"
        return (f"No GPU agent answers at {self.agent_socket}, so this kernel's GPU share "
                f"cannot be verified; {todo}.")

    def _agent_lost(self, error: str) -> None:
        self.agent_error = self.agent_loss_text()
        self.log.warning("gpufrac: %s (%s)", self.agent_error, error)
        for kernel_id, gpu in self.kernels.items():
            if gpu.lease is not None:
                self.events.emit(kernel_id, "agent_unreachable", self.agent_error,
                                 reason=error)

    async def _agent_back(self) -> None:
        """The agent answers again: make sure it knows every kernel's lease (a fresh one may not)."""
        self.agent_error = None
        self.log.info("gpufrac: the GPU agent at %s answers again", self.agent_socket)
        for kernel_id, gpu in self.kernels.items():
            if gpu.lease is None:
                continue
            try:
                outcome = await gpu.reregister()
            except AgentError as err:
                self.log.warning("kernel %s: lease check after the agent came back: %s",
                                 kernel_id, err)
                continue
            if outcome == "lost":
                self.events.emit(kernel_id, "no_gpu", gpu.no_gpu_reason or "",
                                 reason=gpu.no_gpu_reason or "")
                continue
            lease = gpu.lease or {}
            uuids = lease_gpus(lease)
            label = gpu.label(uuids[0] if uuids else None)
            text = {
                "kept": f"The GPU agent answers again and holds this kernel's share on {label}.",
                "recreated": f"The GPU agent came back without this kernel's share; it was "
                             f"registered again on {label}, where the kernel runs.",
                "moved": f"The GPU agent came back without this kernel's share and has room for "
                         f"it on {label}: the kernel restarts there with its variables.",
            }[outcome]
            self.events.emit(kernel_id, "agent_reachable", text, gpu_uuid=uuids[0] if uuids
                             else None, request=lease.get("request"), limit=lease.get("limit"))
            if outcome == "moved" and self.listener is not None:
                self._spawn(self.listener.restart_onto_lease(kernel_id, {
                    "cause": contract.CAUSE_PLACED, "message": text, "from_gpu": None,
                    "to_gpu": uuids[0] if uuids else None,
                }))

    async def release_stale_leases(self) -> None:
        """Give back, at once, leases that this user's earlier servers on this host left behind.

        A lease counts as stale when the server named in its client has exited and none of its
        processes runs; the agent would release it only after its orphan grace.
        """
        try:
            leases = own_leases(await self.link.leases())
        except AgentError:
            return
        prefix = server_client_prefix()
        for lease in leases:
            client = str(lease.get("client") or "")
            if lease.get("kind") != "notebook" or not client.startswith(prefix):
                continue
            server_pid = client[len(prefix):]
            if client == self.client_name or not server_pid.isdigit():
                continue
            if psutil.pid_exists(int(server_pid)) or any(
                psutil.pid_exists(int(pid)) for pid in lease.get("pids") or []
            ):
                continue
            try:
                await self.link.release(str(lease["id"]))
                self.log.info("gpufrac: released lease %s of kernel %s (its server %s is gone)",
                              lease["id"], lease.get("kernel_id"), server_pid)
            except AgentError as err:
                self.log.info("gpufrac: stale lease %s not released: %s", lease["id"], err)
