"""REST handlers for the JupyterLab widget: ``/api/gpufrac/node`` and ``/api/gpufrac/kernels/<id>``."""

from __future__ import annotations

import asyncio
import json
import os
import time
from typing import Any

from jupyter_server.auth.decorator import authorized
from jupyter_server.base.handlers import APIHandler
from tornado import web

from jupyter_gpufrac.server.account import kernel_account
from jupyter_gpufrac.server.agent_link import AgentError, AgentUnavailable
from jupyter_gpufrac.server.kernel_channel import checkpoint_status
from jupyter_gpufrac.server.rest_models import kernel_model, node_model, resumable_model
from jupyter_gpufrac.server.resume import offered

AUTH_RESOURCE = "gpufrac"
# How long the kernel view waits for the kernel's checkpoint status (a control-channel answer
# takes milliseconds; a kernel that is not there answers nothing).
CHECKPOINT_STATUS_WAIT_S = 1.0
# A kernel that did not answer (without the extension, or its threads held) is asked again
# after this many seconds.
CHECKPOINT_STATUS_RETRY_S = 30.0
# Execution states of a kernel with no process to ask.
GONE = ("dead", "restarting", "autorestarting")


class GpuFracHandler(APIHandler):
    """Shared pieces: the extension app and JSON answers."""

    auth_resource = AUTH_RESOURCE

    @property
    def gpufrac(self) -> Any:
        return self.settings["gpufrac_app"]

    def write_json(self, model: dict[str, Any], status: int = 200) -> None:
        self.set_status(status)
        self.set_header("Content-Type", "application/json")
        self.finish(json.dumps(model))


def own_leases(leases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Only this user's leases (an admin's agent answers with everyone's)."""
    uid = os.getuid()
    return [lease for lease in leases if lease.get("owner_uid", uid) == uid]


class NodeHandler(GpuFracHandler):
    """The node's GPUs and this user's leases."""

    @web.authenticated
    @authorized
    async def get(self) -> None:
        app = self.gpufrac
        node, leases, error = None, [], None
        try:
            node = await app.link.node()
            leases = [self._with_account(lease) for lease in own_leases(await app.link.leases())]
        except AgentUnavailable as err:
            error = f"{app.agent_loss_text()} ({err})"
        except AgentError as err:
            error = f"The GPU agent answered with an error: {err}"
        agent = {
            "socket": app.link.socket_path,
            "embedded": app.embedded is not None,
            "available": error is None,
            "error": error,
        }
        spares = app.spares.status() if app.spares is not None else None
        self.write_json(node_model(node, leases, agent, list(app.config_problems), spares))

    def _with_account(self, lease: dict[str, Any]) -> dict[str, Any]:
        """A lease of this server's kernel, with the kernel's account as of this very lease:
        the node's table says what "This kernel" says."""
        app = self.gpufrac
        kernel_id = str(lease.get("kernel_id") or "")
        gpu = app.kernels.get(kernel_id) if kernel_id else None
        if gpu is None or gpu.lease is None or gpu.lease.get("id") != lease.get("id"):
            return lease
        kernel = self.kernel_manager.get_kernel(kernel_id)
        account = kernel_account(kernel, gpu, lease, app.events.events(kernel_id),
                                 agent_error=app.agent_error)
        return {**lease, "account": account}


class KernelHandler(GpuFracHandler):
    """One kernel's GPU state, lease and recent events."""

    @web.authenticated
    @authorized
    async def get(self, kernel_id: str) -> None:
        app = self.gpufrac
        km = self.kernel_manager
        if kernel_id not in km:
            self.write_json({"error": f"no kernel with id {kernel_id}"}, status=404)
            return
        kernel = km.get_kernel(kernel_id)
        gpu = app.kernels.get(kernel_id)
        status = None
        if gpu is not None and gpu.hooked:
            # Two stats, and the header read only when a checkpoint was written since.
            await asyncio.to_thread(gpu.look_at_checkpoint)
            if (getattr(kernel, "execution_state", None) not in GONE
                    and time.monotonic() >= gpu.ask_status_after):
                status = await checkpoint_status(kernel, CHECKPOINT_STATUS_WAIT_S)
                if status is None:  # asked again later, not at every poll of the panel
                    gpu.ask_status_after = time.monotonic() + CHECKPOINT_STATUS_RETRY_S
        lease = gpu.lease if gpu is not None else None
        agent_error = app.agent_error
        if gpu is not None and lease is not None:
            try:
                lease = await gpu.refresh()
            except AgentUnavailable:
                # Last known lease: the widget keeps showing where the kernel runs, unverified.
                agent_error = agent_error or app.agent_loss_text()
            except AgentError as err:
                self.log.info("kernel %s: lease not refreshed: %s", kernel_id, err)
        self.write_json(kernel_model(
            kernel_id, kernel, gpu, lease, app.events.events(kernel_id),
            agent_error=agent_error, notebook=await self._notebook(kernel_id),
            checkpoint_disk=await app.checkpoint_folder.disk_model(kernel_id),
            checkpoint_status=status,
            resumable=resumable_model(
                await asyncio.to_thread(offered, gpu) if gpu is not None else None,
                app.events.events(kernel_id)),
        ))

    async def _notebook(self, kernel_id: str) -> str | None:
        sessions = self.settings.get("session_manager")
        if sessions is None:
            return None
        try:
            for session in await sessions.list_sessions():
                if (session.get("kernel") or {}).get("id") == kernel_id:
                    return str(session.get("path") or "") or None
        except Exception as err:  # naming the notebook must not fail the status
            self.log.debug("kernel %s: sessions: %s", kernel_id, err)
        return None


class ResumeHandler(GpuFracHandler):
    """The user's answer to whether a kernel takes over its notebook's earlier state
    (c.GpuFrac.resume "ask"): ``{"choice": "restore"}`` or ``{"choice": "fresh"}``."""

    @web.authenticated
    @authorized
    async def post(self, kernel_id: str) -> None:
        app = self.gpufrac
        if kernel_id not in self.kernel_manager:
            self.write_json({"error": f"no kernel with id {kernel_id}"}, status=404)
            return
        try:
            body = json.loads(self.request.body or b"{}")
        except ValueError:
            body = None
        choice = body.get("choice") if isinstance(body, dict) else None
        if choice not in CHOICES:
            self.write_json({"field": "choice", "error": f"choice: expected one of "
                             f"{', '.join(CHOICES)}, got {str(choice)[:40]!r}"}, status=400)
            return
        gpu = app.kernels.get(kernel_id)
        state = await asyncio.to_thread(offered, gpu) if gpu is not None else None
        if gpu is None or state is None:
            self.write_json({"error": "no earlier state of this notebook waits for an answer: "
                             "it was taken over or declined already, or there was none"},
                            status=409)
            return
        gpu.resumable = None
        if choice == "fresh":
            await app.keeper.decline(gpu, state)
        else:
            await app.keeper.restore(kernel_id, gpu, state)
        self.write_json({"ok": True, "choice": choice})


CHOICES = ("restore", "fresh")


def handlers() -> list[tuple[str, type[APIHandler]]]:
    """URL patterns (under the server's base URL) and their handlers."""
    return [
        (r"/api/gpufrac/node", NodeHandler),
        (r"/api/gpufrac/kernels/(?P<kernel_id>[\w-]+)", KernelHandler),
        (r"/api/gpufrac/kernels/(?P<kernel_id>[\w-]+)/resume", ResumeHandler),
    ]
