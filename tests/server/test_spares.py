"""Spare kernel processes: adopted by a restoring launch, replaced, never in a launch's way, reaped."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from jupyter_client.manager import AsyncKernelManager

from harness.agent import AgentProcess
from jupyter_gpufrac.server import spares
from jupyter_gpufrac.server.provisioner import GpuFracProvisioner
from jupyter_gpufrac.server.spares import SpareKey, SparePool

from .test_provisioner import process_view, write_kernelspec

# A stand-in for ipykernel_launcher: says what it was given, then waits for a signal.
PROBE = """
import json, os, sys, time
out = sys.argv[sys.argv.index("--out") + 1]
report = {"argv": sys.argv, "cwd": os.getcwd(), "pid": os.getpid(), "pgid": os.getpgid(0),
          "main": __name__, "env": dict(os.environ), "modules": sorted(sys.modules),
          "stdin": os.read(0, 10).decode()}
with open(out + ".tmp", "w") as f:
    json.dump(report, f)
os.replace(out + ".tmp", out)
time.sleep(120)
"""

USERS_MODULE = """
import os
with open(os.path.join(os.path.dirname(__file__), "imported.txt"), "a") as f:
    f.write(f"{os.getpid()} {os.environ.get('GPUFRAC_KERNEL_ID', '-')}\\n")
"""


@pytest.fixture
def probe(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The probe module importable by spares started from now on (they take os.environ)."""
    (tmp_path / "mods").mkdir()
    (tmp_path / "mods" / "spare_probe.py").write_text(PROBE)
    (tmp_path / "mods" / "slow_import.py").write_text("import time\ntime.sleep(30)\n")
    # The user's own code: importing it leaves a mark, with the process and kernel it ran in.
    (tmp_path / "mods" / "users_module.py").write_text(USERS_MODULE)
    path = os.pathsep.join(p for p in (str(tmp_path / "mods"), os.environ.get("PYTHONPATH")) if p)
    monkeypatch.setenv("PYTHONPATH", path)
    return tmp_path


def probe_key(imports: tuple[str, ...] = ("email.mime.text",)) -> SpareKey:
    return SpareKey(sys.executable, "spare_probe", (), (*spares.KERNEL_MODULES[:1], *imports))


@pytest.fixture
def pool(jp_asyncio_loop: asyncio.AbstractEventLoop) -> Iterator[SparePool]:
    made = SparePool(["email.mime.text"], 2, logging.getLogger("test-spares"), start_delay=0.0,
                     ready_wait=0.5)
    try:
        yield made
    finally:
        jp_asyncio_loop.run_until_complete(made.stop())


def launch_env(spare_env: dict[str, str], **extra: str) -> dict[str, str]:
    """What a launch gives: the spare's environment and this launch's own variables."""
    return {**spare_env, "CUDA_VISIBLE_DEVICES": "GPU-target", "GPUFRAC_KERNEL_ID": "k-1",
            "GPUFRAC_RESTORE": "1", **extra}


async def ready_spare(pool: SparePool, key: SpareKey) -> spares.Spare:
    pool.want(key)
    deadline = time.monotonic() + 60
    while pool.spare(key) is None:
        assert time.monotonic() < deadline, "no spare was started"
        await asyncio.sleep(0.02)
    spare = pool.spare(key)
    assert spare is not None and await spare.wait_ready(60), spare and spare.messages
    return spare


async def read_report(path: Path, timeout: float = 30) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, "the adopted process did not run the launch"
        await asyncio.sleep(0.02)
    report: dict[str, Any] = json.loads(path.read_text())
    return report


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


async def until_gone(pid: int, timeout: float = 15) -> None:
    deadline = time.monotonic() + timeout
    while not gone(pid):
        assert time.monotonic() < deadline, f"process {pid} still runs"
        await asyncio.sleep(0.05)


# -- the pool ----------------------------------------------------------------------------------


async def test_adopted_spare_becomes_the_launch_and_a_replacement_starts(
    probe: Path, pool: SparePool
) -> None:
    key = probe_key()
    spare = await ready_spare(pool, key)
    # Imported in advance, CUDA left alone: the spare was never pointed at a GPU.
    assert spare.env["CUDA_VISIBLE_DEVICES"] == ""
    out, cwd = probe / "report.json", probe / "notebooks"
    cwd.mkdir()
    argv = [sys.executable, "-m", "spare_probe", "-f", "conn.json", "--out", str(out)]
    process = await pool.adopt(key, argv, launch_env(spare.env), str(cwd))
    assert process is spare.process and pool.adopted == 1
    report = await read_report(out)
    assert report["pid"] == process.pid == report["pgid"]  # its own process group, as a kernel's
    assert report["main"] == "__main__" and report["cwd"] == str(cwd)
    assert report["argv"][1:] == argv[3:] and report["argv"][0].endswith("spare_probe.py")
    assert report["env"]["CUDA_VISIBLE_DEVICES"] == "GPU-target"
    assert report["env"]["GPUFRAC_KERNEL_ID"] == "k-1"
    assert report["env"]["JPY_PARENT_PID"] == str(os.getpid())
    assert "email.mime.text" in report["modules"] and "ipykernel.kernelapp" in report["modules"]
    assert report["stdin"] == ""  # at EOF, as a normal kernel's stdin
    # Nothing of the bootstrap is left open in the kernel: fds 0-2 and what the probe opened.
    fds = {int(fd) for fd in os.listdir(f"/proc/{process.pid}/fd")}
    assert fds <= {0, 1, 2, 3}, fds
    # A replacement is on its way, a new process.
    replacement = await ready_spare(pool, key)
    assert replacement.pid != process.pid
    # The adopted process is the provisioner's now: poll, signals to its group, wait.
    assert process.poll() is None
    os.killpg(process.pid, signal.SIGTERM)
    assert process.wait(10) == -signal.SIGTERM


async def prepared(spare: spares.Spare, timeout: float = 60) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        spare.read_status()
        if spare.prepared_info is not None:
            return spare.prepared_info
        assert spare.alive() and time.monotonic() < deadline, spare.messages
        await asyncio.sleep(0.02)


async def test_a_spare_made_ready_for_a_kernel_imports_what_it_had_imported_never_user_code(
    probe: Path, pool: SparePool
) -> None:
    key = probe_key()
    spare = await ready_spare(pool, key)
    imports = ["idna", "users_module", "email", "no_such_package"]
    gpu = {"CUDA_VISIBLE_DEVICES": "GPU-target", "CUPY_GPU_MEMORY_LIMIT": "1000"}
    told: list[spares.Spare] = []

    async def on_prepared(ready: spares.Spare) -> None:
        told.append(ready)

    assert await pool.prepare(key, "k-1", imports, gpu, on_prepared)
    info = await prepared(spare)
    # The installed package is imported; the user's module on PYTHONPATH is not (its code has
    # not run anywhere), nor is what is not installed; what was loaded already is skipped.
    assert info["imported"] == ["idna"]
    assert set(info["skipped"]) == {"users_module", "no_such_package"}
    assert "not an installed package" in info["skipped"]["users_module"]
    assert not (probe / "mods" / "imported.txt").exists()
    assert info["cuda"] is None  # no GPU here: nothing initialised
    # Kept for that kernel alone: counted, shown, and a replacement starts for the others.
    status = pool.status()
    assert [(s["pid"], s["state"], s["kernel_id"]) for s in status["spares"]
            if s["state"] == "prepared"] == [(spare.pid, "prepared", "k-1")]
    assert all(s["bytes"] > 0 for s in status["spares"])
    assert status["bytes"] == sum(s["bytes"] for s in status["spares"])
    replacement = await ready_spare(pool, key)
    assert replacement.pid != spare.pid
    # Asked again (the directive, then the launch), it imports only what is new.
    assert await pool.prepare(key, "k-1", [*imports, "yaml"], gpu)
    deadline = time.monotonic() + 60
    while sum(1 for m in spare.messages if m.get("prepared")) < 2:
        assert time.monotonic() < deadline, spare.messages
        spare.read_status()
        await asyncio.sleep(0.02)
    assert spare.prepared_info is not None and spare.prepared_info["imported"] == ["idna", "yaml"]
    out = probe / "report.json"
    argv = [sys.executable, "-m", "spare_probe", "--out", str(out)]
    process = await pool.adopt(key, argv, launch_env(spare.env, **gpu), str(probe), "k-1")
    assert process is spare.process
    report = await read_report(out)
    assert {"idna", "yaml"} <= set(report["modules"]) and "users_module" not in report["modules"]
    assert report["env"]["CUDA_VISIBLE_DEVICES"] == "GPU-target"
    assert report["env"]["CUPY_GPU_MEMORY_LIMIT"] == "1000"
    deadline = time.monotonic() + 30  # its watcher, polling, may see the answer only now
    while not told:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.02)
    assert told == [spare]
    assert pool.spare(key) is replacement  # the ready one was not taken
    os.killpg(process.pid, signal.SIGTERM)
    process.wait(10)


async def test_a_spare_made_ready_for_another_gpu_is_never_adopted(
    probe: Path, pool: SparePool, caplog: pytest.LogCaptureFixture
) -> None:
    key = probe_key()
    spare = await ready_spare(pool, key)
    assert await pool.prepare(key, "k-1", ["idna"], {"CUDA_VISIBLE_DEVICES": "GPU-a"})
    await prepared(spare)
    replacement = await ready_spare(pool, key)
    out = probe / "report.json"
    argv = [sys.executable, "-m", "spare_probe", "--out", str(out)]
    with caplog.at_level(logging.INFO, "test-spares"):
        process = await pool.adopt(key, argv, launch_env(spare.env, CUDA_VISIBLE_DEVICES="GPU-b"),
                                   str(probe), "k-1")
    # CUDA may hold the other GPU in it: reaped, and the launch takes the ready spare instead.
    assert f"spare kernel {spare.pid} made ready for kernel k-1 not used" in caplog.text
    assert "CUDA_VISIBLE_DEVICES" in caplog.text
    assert process is replacement.process
    await until_gone(spare.pid)
    report = await read_report(out)
    assert report["env"]["CUDA_VISIBLE_DEVICES"] == "GPU-b"
    os.killpg(process.pid, signal.SIGTERM)
    process.wait(10)


async def test_a_spare_made_ready_for_a_kernel_that_shuts_down_is_reaped(
    probe: Path, pool: SparePool
) -> None:
    key = probe_key()
    spare = await ready_spare(pool, key)
    assert await pool.prepare(key, "k-1", [], {})
    assert [s["state"] for s in pool.status()["spares"]].count("prepared") == 1
    pool.forget_kernel("k-1")
    await until_gone(spare.pid)
    assert "prepared" not in [s["state"] for s in pool.status()["spares"]]


async def test_no_ready_spare_or_a_dead_one_means_a_cold_launch(
    probe: Path, pool: SparePool
) -> None:
    key = probe_key()
    argv = [sys.executable, "-m", "spare_probe", "--out", str(probe / "never.json")]
    # None yet: a cold launch now, and a spare on its way for the next one.
    assert await pool.adopt(key, argv, {}, str(probe)) is None
    spare = await ready_spare(pool, key)
    os.kill(spare.pid, signal.SIGKILL)
    await until_gone(spare.pid)
    assert await pool.adopt(key, argv, launch_env(spare.env), str(probe)) is None
    replacement = await ready_spare(pool, key)
    assert replacement.pid != spare.pid
    assert not (probe / "never.json").exists()


async def test_a_spare_still_importing_is_kept_for_later(probe: Path, pool: SparePool) -> None:
    key = probe_key(("slow_import",))
    pool.want(key)
    await asyncio.sleep(0.3)
    spare = pool.spare(key)
    assert spare is not None
    argv = [sys.executable, "-m", "spare_probe", "--out", str(probe / "never.json")]
    began = time.monotonic()
    assert await pool.adopt(key, argv, launch_env(spare.env), str(probe)) is None
    assert time.monotonic() - began < 2  # waited ready_wait, not the import
    assert pool.spare(key) is spare and spare.alive()


@pytest.mark.parametrize("problem", ["env", "argv", "python", "pipe", "cwd"])
async def test_anything_off_about_the_spare_means_a_cold_launch(
    probe: Path, pool: SparePool, problem: str, caplog: pytest.LogCaptureFixture
) -> None:
    key = probe_key()
    spare = await ready_spare(pool, key)
    out = probe / "report.json"
    argv = [sys.executable, "-m", "spare_probe", "--out", str(out)]
    env, cwd = launch_env(spare.env), str(probe)
    if problem == "env":
        env["PYTHONHASHSEED"] = "7"  # read when the interpreter starts: the spare's is wrong
    elif problem == "argv":
        argv = [sys.executable, "-X", "dev", "-m", "spare_probe"]
    elif problem == "python":
        argv = ["/usr/bin/python3", "-m", "spare_probe"]
    elif problem == "pipe":
        assert spare.process.stdin is not None
        spare.process.stdin.close()
    elif problem == "cwd":
        cwd = str(probe / "missing")
    with caplog.at_level(logging.INFO, "test-spares"):
        assert await pool.adopt(key, argv, env, cwd) is None
    assert f"spare kernel {spare.pid} not used" in caplog.text
    if problem == "env":
        assert "PYTHONHASHSEED" in caplog.text and "'7'" not in caplog.text  # names, never values
    await until_gone(spare.pid)
    assert not out.exists()


async def test_stop_reaps_spares_and_pending_starts(probe: Path) -> None:
    pool = SparePool([], 2, logging.getLogger("test-spares"), start_delay=0.0)
    first = await ready_spare(pool, probe_key())
    second_key = probe_key(("slow_import",))
    pool.want(second_key)
    await asyncio.sleep(0.3)
    importing = pool.spare(second_key)
    assert importing is not None
    late = probe_key(("json",))
    pool.start_delay = 30.0
    pool.want(late)  # at most two: not even scheduled
    assert pool.spare(late) is None
    await pool.stop()
    for pid in (first.pid, importing.pid):
        await until_gone(pid, 5)
        assert not psutil.pid_exists(pid)  # reaped, not a zombie
    pool.want(probe_key())
    await asyncio.sleep(0.1)
    assert pool.pids() == []


def test_spares_exit_when_the_server_dies_without_reaping_them(probe: Path) -> None:
    """A server killed with SIGKILL cannot reap: each spare reads EOF on its order pipe."""
    script = textwrap.dedent("""
        import asyncio, logging, sys
        from jupyter_gpufrac.server.spares import SparePool, SpareKey
        async def main():
            pool = SparePool([], 2, logging.getLogger(), start_delay=0.0)
            key = SpareKey(sys.executable, "spare_probe", (), ("json",))
            pool.want(key)
            while pool.spare(key) is None or not pool.spare(key).ready():
                await asyncio.sleep(0.02)
            print(pool.spare(key).pid, flush=True)
            await asyncio.sleep(600)
        asyncio.run(main())
    """)
    server = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None
        pid = int(server.stdout.readline())
        assert psutil.pid_exists(pid)
        server.kill()
        server.wait(10)
        deadline = time.monotonic() + 15
        while psutil.pid_exists(pid) and not gone(pid):
            assert time.monotonic() < deadline, "the spare outlived its server"
            time.sleep(0.05)
    finally:
        server.kill()
        server.wait(10)


async def test_no_spare_while_memory_is_short(
    probe: Path, pool: SparePool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(spares, "available_memory", lambda: 5 * spares.SPARE_RSS_WITHOUT)
    pool.want(probe_key())
    await asyncio.sleep(0.2)
    assert pool.pids() == []


async def test_a_kernelspec_whose_spares_keep_failing_gets_none(
    pool: SparePool, caplog: pytest.LogCaptureFixture
) -> None:
    key = SpareKey("/nonexistent/python3", "ipykernel_launcher", (), ())
    with caplog.at_level(logging.INFO, "test-spares"):
        for _ in range(spares.MAX_FAILURES + 2):
            pool.want(key)
            await asyncio.sleep(0.05)
    assert caplog.text.count("could not start a spare kernel") == spares.MAX_FAILURES
    assert "no more spare kernels for /nonexistent/python3" in caplog.text
    assert pool.spare(key) is None


def test_default_rule_and_keys() -> None:
    with_torch = spares.MEMORY_FACTOR * spares.SPARE_RSS_WITH_TORCH
    assert spares.default_enabled(["torch"], available=with_torch)
    assert not spares.default_enabled(["torch"], available=with_torch - 1)
    assert spares.default_enabled([], available=spares.MEMORY_FACTOR * spares.SPARE_RSS_WITHOUT)
    pool = SparePool(["torch"], 2, logging.getLogger("test-spares"))
    argv = ["python", "-m", "ipykernel_launcher", "-f", "{connection_file}"]
    key = pool.key_for(argv, {"A": "1"}, load_extension=True)
    assert key is not None and key.executable == sys.executable  # as jupyter_client resolves it
    assert key.imports[-1] == "torch" and "jupyter_gpufrac.kernel.hook" in key.imports
    assert key.spec_env == (("A", "1"),)
    assert pool.key_for([sys.executable, "-m", "ipykernel_launcher"], None, False) != key
    assert pool.key_for(["/opt/julia", "-i", "kernel.jl"], None, False) is None
    assert pool.key_for([sys.executable, "-Xfrozen_modules=off", "-m", "ipykernel_launcher"],
                        None, True) is None
    assert spares.env_differences({"A": "1", "GPUFRAC_X": "a", "CUDA_VISIBLE_DEVICES": ""},
                                  {"A": "2", "GPUFRAC_X": "b", "CUDA_VISIBLE_DEVICES": "G"}) == ["A"]


# -- the provisioner, with real kernels and a real agent ------------------------------------------


@pytest.fixture
def served_pool(monkeypatch: pytest.MonkeyPatch) -> Iterator[SparePool]:
    """Provisioners see a server extension whose pool is this one."""
    pool = SparePool(["email.mime.text"], 2, logging.getLogger("test-spares"), start_delay=0.0,
                     ready_wait=30.0)

    async def agent_ready(kernel_id: str) -> None:
        return None

    app = types.SimpleNamespace(spares=pool, agent_ready=agent_ready, kernel_settings=None)
    monkeypatch.setattr(GpuFracProvisioner, "gpufrac_app", lambda self: app)
    yield pool


async def ask(km: AsyncKernelManager, code: str) -> str:
    client = km.client()
    client.start_channels()
    try:
        await client.wait_for_ready(timeout=60)
        out: list[str] = []
        reply = await client.execute_interactive(
            code, timeout=60, output_hook=lambda msg: out.append(msg["content"].get("text", "")))
        assert reply["content"]["status"] == "ok", reply["content"]
        return "".join(out)
    finally:
        client.stop_channels()


async def test_a_restoring_restart_adopts_the_spare_a_plain_one_does_not(
    isolated: Path, no_leases: AgentProcess, served_pool: SparePool
) -> None:
    ksm = write_kernelspec(isolated, {"gpufrac": {"request": "0.25"}})
    km = AsyncKernelManager(kernel_name="gpu-python", kernel_spec_manager=ksm)
    await km.start_kernel()
    provisioner = km.provisioner
    assert isinstance(provisioner, GpuFracProvisioner)
    try:
        connection = dict(km.get_connection_info())
        cold_pid = provisioner.pid
        key = provisioner._spare_pool()[1]  # type: ignore[index]
        spare = await ready_spare(served_pool, key)
        provisioner.gpu.request_restore({"cause": "oom_killed", "message": "test"})
        await km.restart_kernel(now=True)
        assert provisioner.pid == spare.pid != cold_pid and provisioner.pgid == spare.pid
        assert km.get_connection_info() == connection  # same ports: the page stays connected
        lease = no_leases.client().lease(provisioner.gpu.lease["id"])  # type: ignore[index]
        assert lease["pids"] == [spare.pid]
        argv, _ = process_view(spare.pid)
        assert "spare_main()" in argv[2]  # /proc shows what it was started with, not the launch
        # The environment the process has (libc's, which CUDA reads) is the launch's.
        code = ("import os, sys\nfrom jupyter_gpufrac import kernel\n"
                "print(os.getpid(), 'email.mime.text' in sys.modules, os.getenv('GPUFRAC_RESTORE'),"
                " os.environ['CUDA_VISIBLE_DEVICES'], type(get_ipython()).__name__,"
                " kernel.summary()['lease_id'], kernel.summary()['restore']['cause'])")
        # (The first cell after a restore first says what came back.)
        assert (await ask(km, code)).strip().splitlines()[-1].split() == [
            str(spare.pid), "True", "1", lease["physical_gpu"], "ZMQInteractiveShell",
            lease["id"], "oom_killed"]
        # An interrupt reaches it as any kernel's (its process group).
        client = km.client()
        client.start_channels()
        await client.wait_for_ready(timeout=60)
        msg_id = client.execute("import time; time.sleep(60)")
        await asyncio.sleep(1.0)
        await km.interrupt_kernel()
        reply = await client.get_shell_msg(timeout=30)
        assert reply["parent_header"]["msg_id"] == msg_id
        assert reply["content"]["ename"] == "KeyboardInterrupt"
        client.stop_channels()
        # The user's own restart starts a fresh interpreter.
        replacement = await ready_spare(served_pool, key)
        await km.restart_kernel(now=True)
        assert provisioner.pid not in (spare.pid, replacement.pid)
        assert served_pool.spare(key) is replacement
    finally:
        await km.shutdown_kernel(now=True)
        pids = served_pool.pids()
        await served_pool.stop()
    for pid in [*pids, spare.pid]:
        await until_gone(pid, 5)


def test_a_launch_that_comes_while_a_spare_imports_does_not_wait_for_the_rest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import builtins
    import threading

    from jupyter_gpufrac.server import spare_process

    # first_pkg's import waits at a gate the test opens: the launch comes while it runs.
    (tmp_path / "first_pkg").mkdir()
    (tmp_path / "first_pkg" / "__init__.py").write_text(
        "import builtins\nbuiltins.gpufrac_test_started.set()\n"
        "assert builtins.gpufrac_test_gate.wait(30)\n")
    for name in ("second_pkg", "third_pkg"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    # Installed, as far as the spare can tell: in a folder it counts as installed.
    monkeypatch.setattr(spare_process, "installed_roots", lambda: [str(tmp_path)])
    started, gate = threading.Event(), threading.Event()
    monkeypatch.setattr(builtins, "gpufrac_test_started", started, raising=False)
    monkeypatch.setattr(builtins, "gpufrac_test_gate", gate, raising=False)
    read_fd, write_fd = os.pipe()
    status = spare_process.Status(write_fd)
    try:
        importer = spare_process.Importer(status)
        spare_process.prepare({"imports": ["first_pkg", "second_pkg", "third_pkg"]}, importer)
        assert started.wait(30)
        # The launch: it does not wait for the import in progress, and nothing after it runs.
        summary = importer.stop()
        assert not gate.is_set() and "first_pkg" not in importer.imported  # still importing
        assert summary["left"] == ["second_pkg", "third_pkg"] and summary["imported"] == []
        gate.set()
        for thread in threading.enumerate():
            if thread.name == "gpufrac-spare-imports":
                thread.join(30)
                assert not thread.is_alive()
        assert importer.imported == ["first_pkg"]
        assert "second_pkg" not in sys.modules and "third_pkg" not in sys.modules
        status.close()
        assert os.read(read_fd, 65536) == b"", "a stopped importer says nothing more"
    finally:
        os.close(read_fd)
        for name in ("first_pkg", "second_pkg", "third_pkg"):
            sys.modules.pop(name, None)
