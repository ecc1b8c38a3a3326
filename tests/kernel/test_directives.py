"""The directive watcher against a real simulated agent: directives, absence, restarts."""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from harness.agent import AgentProcess, wait_for
from jupyter_gpufrac.kernel.directives import DirectiveWatcher
from jupyter_gpufrac.wake import ADDRESS_MAX, WakeReceiver, wake, wake_path
from node_agent.client import AgentClient


class Recorder:
    """Collects directives and wakes the test when one arrives."""

    def __init__(self) -> None:
        self.seen: list[Mapping[str, Any]] = []
        self.arrived = threading.Event()

    def __call__(self, directive: Mapping[str, Any]) -> None:
        self.seen.append(directive)
        self.arrived.set()


def test_watcher_survives_an_absent_agent(tmp_path: Path) -> None:
    client = AgentClient(str(tmp_path / "nobody.sock"), timeout=1.0)
    watcher = DirectiveWatcher(client, "l-x", Recorder(), poll_timeout=1.0)
    watcher.start()
    try:
        wait_for(lambda: watcher.failures >= 2, 10, "two failed polls")
        assert watcher.alive and watcher.available is False
        assert "no gpufrac agent answers" in (watcher.last_error or "")
    finally:
        watcher.stop()


def spread_lease(client: AgentClient) -> dict[str, Any]:
    """A notebook lease spread onto an idle GPU: physically apart from its bin-packed GPU."""
    client.create_lease(client="test", request="0.25", limit="0.5", kernel_id="k1")
    lease = client.create_lease(client="test", request="0.75", limit="1", kernel_id="k2")
    assert lease["physical_gpu"] != lease["logical_gpu"], lease
    return dict(lease)


def test_watcher_gets_migrate_and_survives_an_agent_restart(agent: AgentProcess) -> None:
    client = agent.client()
    lease = spread_lease(client)
    recorder = Recorder()
    watcher = DirectiveWatcher(AgentClient(agent.socket, timeout=2.0), lease["id"], recorder,
                               poll_timeout=1.0, started=time.time() - 1)
    watcher.start()
    try:
        wait_for(lambda: watcher.available is True, 10, "the first answered poll")
        agent.stop()
        wait_for(lambda: watcher.failures >= 1, 10, "a failed poll while the agent is down")
        agent.start()  # same state directory: the lease survives the restart
        wait_for(lambda: watcher.available is True, 15, "polling to resume")
        # A job that needs a whole GPU compacts the spread notebook back: a migrate directive.
        client.create_lease(client="job", kind="job", request="1")
        assert recorder.arrived.wait(15)
        assert recorder.seen[0]["kind"] == "migrate"
        assert recorder.seen[0]["lease_id"] == lease["id"]
        assert watcher.alive
    finally:
        watcher.stop()


def test_a_restarted_kernel_does_not_replay_the_directive_that_moved_it(agent: AgentProcess) -> None:
    client = agent.client()
    lease = spread_lease(client)
    client.create_lease(client="job", kind="job", request="1")  # sends the migrate
    assert [d["kind"] for d in client.directives(lease=lease["id"], after=0, timeout=0)[0]] == [
        "migrate"]
    # The kernel that comes back on the new GPU starts its watcher right after the move.
    recorder = Recorder()
    watcher = DirectiveWatcher(AgentClient(agent.socket, timeout=2.0), lease["id"], recorder,
                               poll_timeout=0.2)
    watcher.start()
    try:
        wait_for(lambda: watcher.polls >= 3, 10, "a few polls")
        assert recorder.seen == []
    finally:
        watcher.stop()


def test_a_woken_watcher_reads_at_once_and_never_waits_on_the_agent(
        agent: AgentProcess, tmp_path: Path) -> None:
    """With a wake socket the server's long-poll is the lease's only one: a directive the
    kernel is not woken for waits for its next round; a wake-up brings it at once."""
    client = agent.client()
    lease = spread_lease(client)
    # A folder deeper than an AF_UNIX address can name, as JupyterHub's and pytest's can be.
    folder = tmp_path / ("d" * 60) / ("e" * 60)
    folder.mkdir(parents=True)
    path = wake_path(folder)
    assert len(path) > ADDRESS_MAX
    recorder = Recorder()
    watcher = DirectiveWatcher(AgentClient(agent.socket, timeout=2.0), lease["id"], recorder,
                               poll_timeout=60.0, started=time.time() - 1,
                               wake=WakeReceiver(path))
    watcher.start()
    try:
        wait_for(lambda: watcher.polls >= 1 and watcher.available is True, 10, "the first round")
        client.create_lease(client="job", kind="job", request="1")  # sends the migrate
        assert not recorder.arrived.wait(1.0), "the watcher long-polled the agent"
        assert wake(path)
        assert recorder.arrived.wait(5), "a wake-up did not bring the directive"
        assert [d["kind"] for d in recorder.seen] == ["migrate"]
    finally:
        watcher.stop(join_timeout=5)
    assert not watcher.alive
    assert not Path(path).exists(), "the socket outlived its kernel"
    assert not wake(path)

