"""Follows the kubelet's PodResources: each container holding whole GPUs becomes a pinned job lease."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence

from node_agent.kubelet.claims import RESERVATION_NAMESPACES, whole_gpu_claims
from node_agent.kubelet.podresources import KubeletError, PodResourcesClient
from node_agent.service import Agent

log = logging.getLogger(__name__)


class KubeletWatch:
    """Asks the kubelet which devices each container holds, every ``interval`` seconds (v1 of
    the API has no watch), and hands the agent the containers with whole GPUs.

    While the kubelet cannot be asked (it restarts with its node's upgrades), the leases stay
    as they were: a pod's GPUs are not given away because nobody could say it still runs.
    """

    def __init__(self, agent: Agent, socket_path: str, resources: Sequence[str],
                 interval: float, reservations: Sequence[str] = RESERVATION_NAMESPACES) -> None:
        self.agent = agent
        self.socket_path = socket_path
        self.kubelet = PodResourcesClient(socket_path)
        self.resources = tuple(resources)
        self.reservations = tuple(reservations)
        self.interval = interval
        self.failing: str | None = None
        self._crashed: str | None = None  # the last unexpected error, logged once
        self._unknown: frozenset[str] = frozenset()
        self._task: asyncio.Task[None] | None = None

    async def poll_once(self) -> bool:
        """One look; whether the kubelet answered."""
        try:
            listed = await self.kubelet.list_devices()
        except KubeletError as exc:
            if self.failing is None:
                log.warning("cannot ask the kubelet (%s); pods' leases stay as they are until it "
                            "answers", exc)
            self.failing = str(exc)
            return False
        if self.failing is not None:
            log.info("the kubelet answers again on %s", self.socket_path)
            self.failing = None
        claims, unknown = whole_gpu_claims(listed, self.resources,
                                           {gpu.index: gpu.uuid for gpu in self.agent.gpus},
                                           self.reservations)
        if frozenset(unknown) != self._unknown and unknown:
            log.warning("pods hold devices %s that are no GPU of this node the agent sees (MIG "
                        "devices, or a device plugin naming GPUs another way): left alone",
                        ", ".join(sorted(set(unknown))))
        self._unknown = frozenset(unknown)
        self.agent.sync_cluster(claims)
        return True

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="gpufrac-kubelet")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        await self.kubelet.close()

    async def look(self) -> None:
        """:meth:`poll_once`, with an unexpected error logged (once while it repeats)."""
        try:
            await self.poll_once()
        except Exception as exc:
            if repr(exc) != self._crashed:
                log.exception("following the kubelet failed; trying again every %.1fs",
                              self.interval)
            self._crashed = repr(exc)
        else:
            self._crashed = None

    async def _run(self) -> None:
        while True:
            await self.look()
            await asyncio.sleep(self.interval)
