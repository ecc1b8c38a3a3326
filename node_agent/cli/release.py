"""gpufrac-agent release: give a lease back."""

from __future__ import annotations

from node_agent.cli.command import GpuFracAgent, UsageError
from node_agent.client import AgentClient, AgentError


class ReleaseApp(GpuFracAgent):
    name = "gpufrac-agent release"
    description = """Give a lease back (yours; root and admins: anyone's).

    gpufrac-agent release LEASE"""
    examples = "gpufrac-agent release l-3f9a0c1b2d4e"

    def execute(self) -> int:
        if len(self.extra_args) != 1:
            raise UsageError("expected one lease id, e.g. release l-3f9a0c1b2d4e, got "
                             f"{len(self.extra_args)} arguments")
        lease_id = self.extra_args[0]
        try:
            AgentClient(self.socket, state_dir=self.state_dir).release(lease_id)
        except AgentError as exc:
            self.unreachable(exc)
            return 1
        print(f"gpufrac-agent: released {lease_id}")
        return 0
