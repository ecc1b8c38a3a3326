"""AgentClient and AsyncAgentClient against a real agent: calls, errors, restarts, cancellation."""

from __future__ import annotations

import asyncio
import gc
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from unix_users import as_user

from harness.agent import AgentProcess, full_listen_queue
from jupyter_gpufrac.server.agent_link import AgentLink
from node_agent.client import (
    AgentClient,
    AgentError,
    AgentUnavailable,
    AsyncAgentClient,
    UnsafeSocket,
    serve_command,
)

from .conftest import Holder

NOBODY = 65534


def open_fds() -> int:
    """Descriptors this process holds, after whatever earlier tests left to the collector."""
    gc.collect()
    return len(os.listdir("/proc/self/fd"))


@pytest.fixture
def silent(tmp_path: Path) -> Iterator[str]:
    """A socket that accepts connections (the kernel queues them) and never answers."""
    path = str(tmp_path / "silent.sock")
    with socket.socket(socket.AF_UNIX) as listener:
        listener.bind(path)
        listener.listen(16)
        yield path


def test_both_clients_call_every_endpoint(
    start_agent: Callable[..., AgentProcess], holders: Callable[..., Holder]
) -> None:
    agent = start_agent()
    holder, other = holders(), holders()
    with AgentClient(agent.socket) as c:
        assert len(c.node()["gpus"]) == 2 and c.ping()
        lease = c.create_lease(client="sync", request="0.25", limit="0.5", kernel_id="k1",
                               name="one")
        assert (lease["request_spec"], lease["kernel_id"], lease["name"]) == ("0.25", "k1", "one")
        assert c.register_pid(lease["id"], holder.pid)["pids"] == [holder.pid]
        assert c.report_usage(lease["id"], 2**20) is None
        assert c.resize(lease["id"], limit="0.75")["limit_spec"] == "0.75"
        assert c.lease(lease["id"])["id"] == lease["id"]
        # From now on: past the notice of the resize above.
        assert c.directives(client="sync", after=-1, timeout=0) == ([], 1)
        assert "gpufrac" in c.metrics()
        with pytest.raises(AgentError, match="guaranteed, not moving"):
            c.migrated(lease["id"])
        assert c.request("GET", "/v1/leases/" + lease["id"])["id"] == lease["id"]

    async def calls() -> tuple[str, dict[str, Any]]:
        async with AsyncAgentClient(agent.socket) as a:
            assert len((await a.node())["gpus"]) == 2 and await a.ping()
            mine = await a.create_lease(client="async", request="0.25", kernel_id="k2")
            assert (await a.resize(mine["id"], request="0.5"))["request_spec"] == "0.5"
            assert {x["id"] for x in await a.leases()} == {lease["id"], mine["id"]}
            assert await a.directives(lease=mine["id"], after=-1, timeout=0) == ([], 2)
            assert "gpufrac" in await a.metrics()
            assert (await a.register_pid(mine["id"], other.pid))["pids"] == [other.pid]
            assert await a.report_usage(mine["id"], 2**20) is None
            with pytest.raises(AgentError, match="guaranteed, not moving"):
                await a.migrated(mine["id"])
            # Calls at once share nothing but the client.
            many = await asyncio.gather(*(a.lease(lease["id"]) for _ in range(10)))
            assert {x["id"] for x in many} == {lease["id"]}
            await a.release(lease["id"])
            return mine["id"], await a.request("GET", "/v1/leases/" + mine["id"])

    mine_id, answer = asyncio.run(calls())
    assert answer["id"] == mine_id
    assert [x["id"] for x in agent.client().leases()] == [mine_id]


def test_a_refusal_arrives_as_agent_error_naming_the_field(
    start_agent: Callable[..., AgentProcess],
) -> None:
    agent = start_agent()
    with pytest.raises(AgentError) as sync_err:
        agent.client().create_lease(client="t", request="abc")

    async def refused() -> list[AgentError]:
        a = AsyncAgentClient(agent.socket)
        errors = []
        for call in (a.create_lease(client="t", request="abc"), a.lease("l-none")):
            try:
                await call
            except AgentError as exc:
                errors.append(exc)
        return errors

    async_err, missing = asyncio.run(refused())
    for err in (sync_err.value, async_err):
        assert type(err) is AgentError
        assert (err.status, err.field) == (400, "request")
        assert "expected a share of one GPU" in err.message and str(err).startswith("request: ")
    assert (missing.status, missing.field) == (404, "lease")


def test_no_agent_at_the_socket_says_how_to_start_one(tmp_path: Path) -> None:
    sock, state = str(tmp_path / "none.sock"), str(tmp_path / "state")
    hint = f"start one with `{serve_command(sock, state)}`"
    with pytest.raises(AgentUnavailable) as sync_err:
        AgentClient(sock, state_dir=state).node()

    async def absent() -> AgentUnavailable:
        with pytest.raises(AgentUnavailable) as err:
            await AsyncAgentClient(sock, state_dir=state).leases()
        return err.value

    for err in (sync_err.value, asyncio.run(absent())):
        assert (err.path, err.state_dir, err.reason) == (sock, state, "No such file or directory")
        assert f"no gpufrac agent answers at {sock}" in str(err) and hint in str(err)
    assert not AgentClient(sock).ping()


def test_a_folder_others_may_write_is_refused_before_connecting(tmp_path: Path) -> None:
    folder = tmp_path / "open"
    folder.mkdir()
    folder.chmod(0o777)
    path = str(folder / "agent.sock")
    with socket.socket(socket.AF_UNIX) as impostor:
        impostor.bind(path)
        impostor.listen(4)
        impostor.setblocking(False)
        with pytest.raises(UnsafeSocket, match="writable by group or others"):
            AgentClient(path).node()
        with pytest.raises(UnsafeSocket, match="writable by group or others") as err:
            asyncio.run(AsyncAgentClient(path).node())
        assert err.value.field == "socket"
        with pytest.raises(BlockingIOError):
            impostor.accept()  # nobody connected


def test_a_cancelled_long_poll_leaves_no_thread_or_socket(
    start_agent: Callable[..., AgentProcess],
) -> None:
    agent = start_agent()
    threads = threading.active_count()

    async def cancel_polls() -> None:
        link = AgentLink(agent.socket, timeout=2.0)
        await link.node()  # httpx loaded and the client built before counting
        fds = open_fds()
        for _ in range(5):
            poll = asyncio.create_task(link.directives(client="c", after=0, wait=30.0))
            await asyncio.sleep(0.2)
            assert not poll.done()
            assert open_fds() == fds + 1, "the poll holds one connection"
            started = time.monotonic()
            poll.cancel()
            with pytest.raises(asyncio.CancelledError):
                await poll
            assert time.monotonic() - started < 1.0
            assert open_fds() == fds
        assert threading.active_count() == threads
        assert (await link.directives(client="c", after=-1, wait=0))[0] == []

    asyncio.run(cancel_polls())
    assert threading.active_count() == threads


def test_a_long_poll_may_outwait_the_call_timeout(start_agent: Callable[..., AgentProcess]) -> None:
    agent = start_agent()

    async def both() -> list[tuple[list[dict[str, Any]], int]]:
        sync = asyncio.to_thread(AgentClient(agent.socket, timeout=0.5).directives,
                                 client="c", after=0, timeout=1.5)
        later = AsyncAgentClient(agent.socket, timeout=0.5).directives(client="c", timeout=1.5)
        return list(await asyncio.gather(sync, later))

    started = time.monotonic()
    assert asyncio.run(both()) == [([], 0), ([], 0)]
    assert time.monotonic() - started >= 1.4


def test_an_agent_that_never_answers_times_out(silent: str) -> None:
    started = time.monotonic()
    with pytest.raises(AgentUnavailable, match=r"\(timed out\)"):
        AgentClient(silent, timeout=0.5).node()
    with pytest.raises(AgentUnavailable, match=r"\(timed out\)"):
        asyncio.run(AsyncAgentClient(silent, timeout=0.5).node())
    assert time.monotonic() - started < 3


def test_the_async_client_also_waits_out_a_full_listen_queue(tmp_path: Path) -> None:
    path = str(tmp_path / "busy.sock")
    with full_listen_queue(path):
        started, cpu = time.monotonic(), time.process_time()
        with pytest.raises(AgentUnavailable, match="too busy: its listen queue stayed full"):
            asyncio.run(AsyncAgentClient(path, timeout=1.0).node())
        assert time.monotonic() - started >= 0.5
        # It backed off rather than spin on connect() for all that time.
        assert time.process_time() - cpu < 0.5


def test_one_connection_is_kept_and_replaced_after_the_agent_restarts(
    start_agent: Callable[..., AgentProcess],
) -> None:
    agent = start_agent()
    c = agent.client()
    c.node()  # httpx loaded, the client built
    c.close()
    before = open_fds()
    lease = c.create_lease(client="t", request="0.25")
    fds = open_fds()
    assert fds == before + 1, "the connection is kept"
    for _ in range(20):
        c.lease(lease["id"])
    assert open_fds() == fds, "calls reuse the kept connection"
    # Restarted between two calls: the kept connection is dead and replaced, not reused.
    agent.stop()
    agent.start()
    assert c.lease(lease["id"])["id"] == lease["id"]
    assert open_fds() == fds
    # Killed, and called while it is down: unavailable; then served again once it is back.
    agent.kill()
    with pytest.raises(AgentUnavailable, match="Connection refused"):
        c.node()
    agent.start()
    assert c.lease(lease["id"])["id"] == lease["id"]
    c.close()
    assert open_fds() == before

    async def async_after_restart() -> None:
        a = AsyncAgentClient(agent.socket)
        await a.node()
        agent.stop()
        agent.start()
        assert (await a.lease(lease["id"]))["id"] == lease["id"]

    asyncio.run(async_after_restart())


def test_a_kept_connection_is_never_lent_to_another_user(
    start_agent: Callable[..., AgentProcess],
) -> None:
    """The agent knows a caller by who opened the connection: a child that became another
    user must not speak on its parent's (root's) kept connection."""
    agent = start_agent()
    c = agent.client()
    c.create_lease(client="root", request="0.25")
    assert len(c.leases()) == 1  # a connection of root's is now kept
    assert as_user(NOBODY, c.leases) == {"ok": []}
    assert len(c.leases()) == 1


def test_threads_share_a_client(start_agent: Callable[..., AgentProcess]) -> None:
    agent = start_agent()
    c = agent.client(timeout=2.0)
    c.node()
    poll = threading.Thread(target=c.directives, kwargs={"client": "c", "timeout": 1.0})
    poll.start()
    started = time.monotonic()
    for _ in range(5):
        assert c.node()["gpus"]
    assert time.monotonic() - started < 0.9, "calls do not wait for the long poll"
    poll.join()
