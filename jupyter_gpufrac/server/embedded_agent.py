"""The node agent the server starts itself when none answers, so a fresh laptop just works."""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
import time

from jupyter_gpufrac.server.agent_link import AgentLink, AgentUnavailable


class EmbeddedAgentError(RuntimeError):
    """The embedded agent did not come up; the message carries the end of its log."""


class EmbeddedAgent:
    """``gpufrac-agent serve`` as a child process of the server."""

    def __init__(
        self, socket_path: str, state_dir: str, fallback_simulate: str, log: logging.Logger,
        *, use_nvml: bool = True, node_scheduler: bool = True,
        max_workloads_per_gpu: int | None = None,
    ) -> None:
        self.socket_path = socket_path
        self.state_dir = state_dir
        self.fallback_simulate = fallback_simulate
        self.use_nvml = use_nvml
        self.node_scheduler = node_scheduler
        self.max_workloads_per_gpu = max_workloads_per_gpu
        self.log = log
        self.process: subprocess.Popen[bytes] | None = None
        self.log_path = os.path.join(state_dir, "agent.log")

    def command(self) -> list[str]:
        """The agent's command line: NVML when it initialises, else a simulated node."""
        command = [sys.executable, "-m", "node_agent", "serve", "--socket", self.socket_path]
        # It lives no longer than this server, however the server ends.
        command += ["--state-dir", self.state_dir, "--exit-with-parent"]
        if self.fallback_simulate:
            option = "--fallback-simulate" if self.use_nvml else "--simulate"
            command += [option, self.fallback_simulate]
        if not self.node_scheduler:
            command.append("--no-node-scheduler")
        if self.max_workloads_per_gpu is not None:
            command += ["--max-workloads-per-gpu", str(self.max_workloads_per_gpu)]
        return command

    async def start(self, deadline_s: float = 30.0) -> None:
        """Start the agent and wait until it answers at its socket, or raise before the deadline."""
        os.makedirs(self.state_dir, mode=0o700, exist_ok=True)
        os.makedirs(os.path.dirname(self.socket_path) or ".", mode=0o700, exist_ok=True)
        with open(self.log_path, "ab") as log_file:
            self.process = subprocess.Popen(  # our own interpreter and module
                self.command(),
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                # Its own session: a Ctrl-C at the terminal goes to the server, which stops us.
                start_new_session=True,
            )
        self.log.info("started embedded GPU agent (pid %s) at %s", self.process.pid, self.socket_path)
        link = AgentLink(self.socket_path, timeout=2.0)
        deadline = time.monotonic() + deadline_s
        while True:
            if self.process.poll() is not None:
                raise EmbeddedAgentError(
                    f"the embedded GPU agent exited with status {self.process.returncode}: "
                    f"{self.log_tail()}"
                )
            try:
                await link.node()
                return
            except AgentUnavailable:
                pass
            if time.monotonic() > deadline:
                await self.stop()
                raise EmbeddedAgentError(
                    f"the embedded GPU agent did not answer at {self.socket_path} within "
                    f"{deadline_s:g} s: {self.log_tail()}"
                )
            await asyncio.sleep(0.1)

    def exited(self) -> bool:
        """Whether the agent process is gone (killed, crashed, or never started)."""
        return self.process is None or self.process.poll() is not None

    def log_tail(self, lines: int = 8) -> str:
        """The last lines the agent wrote, for error messages."""
        try:
            with open(self.log_path, encoding="utf-8", errors="replace") as f:
                return " | ".join(f.read().strip().splitlines()[-lines:]) or "(no output)"
        except OSError:
            return "(no log)"

    async def stop(self, grace_s: float = 5.0) -> None:
        """SIGTERM, then SIGKILL after the grace period, or after what the agent says its
        freezes and thaws under way may still take, if longer: a driver call cut short is said
        to leave the driver out of step with the process it froze."""
        process, self.process = self.process, None
        if process is None or process.poll() is not None:
            return
        grace_s = max(grace_s, await self._freeze_grace())
        process.terminate()
        try:
            await asyncio.to_thread(process.wait, grace_s)
        except subprocess.TimeoutExpired:
            self.log.warning("embedded GPU agent (pid %s) ignored SIGTERM; killing it", process.pid)
            process.kill()
            await asyncio.to_thread(process.wait)
        self.log.info("stopped embedded GPU agent (pid %s)", process.pid)

    async def _freeze_grace(self) -> float:
        """Seconds the agent's freezes and thaws under way may still take (0: none, or it does
        not answer), and a little for its own stop."""
        try:
            node = await AgentLink(self.socket_path, timeout=2.0).node()
        except AgentUnavailable:
            return 0.0
        pending = float((node.get("freezing") or {}).get("stop_grace") or 0)
        return pending + 2.0 if pending > 0 else 0.0
