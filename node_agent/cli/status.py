"""gpufrac-agent status: the node's GPUs and the leases one may see."""

from __future__ import annotations

import json

from traitlets import Bool

from node_agent.cli.command import GpuFracAgent
from node_agent.client import AgentClient, AgentError
from node_agent.status import render_status, status_document


class StatusApp(GpuFracAgent):
    name = "gpufrac-agent status"
    description = "Show the node's GPUs and the leases you may see (root and admins: all)."

    json = Bool(False, help="The stable JSON document for scripts.").tag(config=True)

    flags = {**GpuFracAgent.flags,
             "json": ({"StatusApp": {"json": True}}, "The stable JSON document for scripts.")}

    def execute(self) -> int:
        self.no_arguments()
        client = AgentClient(self.socket, state_dir=self.state_dir)
        try:
            if self.json:
                print(json.dumps(status_document(client), indent=2))
            else:
                print(render_status(client.node(), client.leases()))
        except AgentError as exc:
            self.unreachable(exc)
            return 1
        return 0
