"""The command line: the README's demo, `run`'s status, signals and clean-up, options, config files."""

from __future__ import annotations

import dataclasses
import json
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from harness.agent import AgentProcess, wait_for
from node_agent import cli
from node_agent.client import AgentClient, AgentUnavailable, default_socket_path
from node_agent.service import AgentConfig


def test_demo_places_spreads_compacts_and_freezes() -> None:
    out = subprocess.run([sys.executable, "-m", "node_agent", "demo"], capture_output=True,
                         text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "simulated node: 2 GPU(s)" in text
    assert "migrate GPU 1 -> GPU 0" in text
    assert text.count("job: ran on GPU-") == 2
    assert 'waiting for 1 notebook to make room: notebook "notebook-b"' in out.stderr
    assert text.count("frozen because job") == 2
    assert text.count("the same process)") == 2


def _run(agent: AgentProcess, *cmd: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "node_agent", "--socket", agent.socket, "run",
                             "--gpus", "1", "--", *cmd], stderr=subprocess.PIPE, text=True)


def test_run_exits_with_the_command_status_and_releases(
    start_agent: Callable[..., AgentProcess]
) -> None:
    agent = start_agent()
    job = _run(agent, "sh", "-c", "exit 3")
    assert job.wait(timeout=30) == 3
    assert agent.client().leases() == []
    job = _run(agent, "no-such-command-here")
    assert job.wait(timeout=30) == 1
    assert job.stderr is not None and "cannot run 'no-such-command-here'" in job.stderr.read()
    assert agent.client().leases() == []


def test_run_forwards_signals(start_agent: Callable[..., AgentProcess], tmp_path: Path) -> None:
    agent = start_agent()
    marker, up = tmp_path / "got-term", tmp_path / "up"
    job = _run(agent, sys.executable, "-c",
               "import pathlib, signal, sys, time\n"
               f"signal.signal(signal.SIGTERM, lambda *a: (pathlib.Path({str(marker)!r}).touch(),"
               " sys.exit(7)))\n"
               f"pathlib.Path({str(up)!r}).touch()\n"
               "time.sleep(60)\n")
    c = agent.client()
    wait_for(up.exists, what="the command started")
    assert any(len(x["pids"]) == 2 for x in c.leases()), "run and its command are registered"
    job.send_signal(signal.SIGTERM)
    assert job.wait(timeout=30) == 7
    assert marker.exists(), "the command received the signal"
    assert c.leases() == []


def test_run_refuses_bad_arguments(start_agent: Callable[..., AgentProcess]) -> None:
    agent = start_agent()
    out = subprocess.run([sys.executable, "-m", "node_agent", "--socket", agent.socket, "run",
                          "--request", "lots", "--", "true"], capture_output=True, text=True,
                         timeout=30, check=False)
    assert out.returncode == 2 and "--request: expected a share of one GPU" in out.stderr
    out = subprocess.run([sys.executable, "-m", "node_agent", "--socket", agent.socket, "run"],
                         capture_output=True, text=True, timeout=30, check=False)
    assert out.returncode == 2 and "give the command after --" in out.stderr
    out = subprocess.run([sys.executable, "-m", "node_agent", "--socket", agent.socket + ".no",
                          "status"], capture_output=True, text=True, timeout=30, check=False)
    assert out.returncode == 1 and "no gpufrac agent answers" in out.stderr


def test_status_names_leases_and_users_and_says_states_in_the_glossarys_words(
    start_agent: Callable[..., AgentProcess]
) -> None:
    """Notebooks by name, jobs by command, users by login name; ids only in --json."""
    agent = start_agent()
    c = agent.client()
    notebook = c.create_lease(client="t", request="0.25", limit="1", name="work/train.ipynb")
    job = c.create_lease(client="t", kind="job", request="1", name="python train.py")

    def status(*extra: str) -> str:
        out = subprocess.run([sys.executable, "-m", "node_agent", "--socket", agent.socket,
                              "status", *extra], capture_output=True, text=True, timeout=30,
                             check=True)
        return out.stdout

    table = status()
    me = pwd.getpwuid(os.getuid()).pw_name
    rows = {line.split("  ")[0]: line for line in table.splitlines()}
    assert "notebook train.ipynb" in rows and "job python train.py" in rows, table
    assert all(f" {me} " in rows[name] for name in ("notebook train.ipynb", "job python train.py"))
    assert " guaranteed " in rows["notebook train.ipynb"], table
    assert "active" not in table and "OWNER" not in table
    assert notebook["id"] not in table and job["id"] not in table
    assert {x["id"] for x in json.loads(status("--json"))["leases"]} == {notebook["id"], job["id"]}


def test_hints_to_start_an_agent_give_the_exact_command(tmp_path: Path) -> None:
    sock, state = str(tmp_path / "a b.sock"), str(tmp_path / "state")
    out = subprocess.run([sys.executable, "-m", "node_agent", "--socket", sock, "--state-dir",
                          state, "status"], capture_output=True, text=True, timeout=30,
                         check=False)
    assert out.returncode == 1
    assert f"start one with `gpufrac-agent serve --socket '{sock}' --state-dir {state}`" in (
        out.stderr)
    # Without a state directory, the hint names none rather than guess.
    try:
        AgentClient(sock).node()
    except AgentUnavailable as exc:
        assert exc.path == sock and exc.state_dir is None
        assert f"`gpufrac-agent serve --socket '{sock}'`" in str(exc)
    else:
        raise AssertionError("nothing listens there")
    with pytest.raises(AgentUnavailable, match=f"--state-dir {state}`"):
        AgentClient(sock, state_dir=state).leases()


# --- the command line as a traitlets Application: options, config files, errors -------------
@pytest.fixture
def no_config(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """No config file but the test's own: the node's and the user's folders are empty."""
    monkeypatch.setattr(cli.command, "SYSTEM_CONFIG_DIR", str(tmp_path / "etc"))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv("GPUFRAC_AGENT_SOCKET", raising=False)
    return tmp_path


@pytest.mark.parametrize("where", ["before", "after"])
def test_socket_and_state_dir_go_before_or_after_the_subcommand(
    where: str, no_config: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    sock, state = str(no_config / "none.sock"), str(no_config / "state")
    options = ["--socket", sock, f"--state-dir={state}"]
    argv = [*options, "status"] if where == "before" else ["status", *options]
    assert cli.main(argv) == 1
    err = capsys.readouterr().err
    assert f"start one with `gpufrac-agent serve --socket {sock} --state-dir {state}`" in err
    # Which socket it was, and why that one (issue #13).
    assert f"gpufrac-agent status: used the socket {sock} (given with --socket)" in err
    assert cli.main(["release", "l-0123456789ab", "--socket", sock]) == 1
    assert f"gpufrac-agent release: used the socket {sock} (given with --socket)" in (
        capsys.readouterr().err)


def test_an_unreachable_default_socket_says_how_to_name_another(
    no_config: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(no_config))
    assert cli.main(["status"]) == 1
    err = capsys.readouterr().err
    assert f"used the socket {no_config}/gpufrac/agent.sock (this user's default; --socket" in err
    monkeypatch.setenv("GPUFRAC_AGENT_SOCKET", str(no_config / "env.sock"))
    assert cli.main(["status"]) == 1
    assert f"{no_config}/env.sock (from $GPUFRAC_AGENT_SOCKET)" in capsys.readouterr().err


@pytest.mark.parametrize(("argv", "said"), [
    (["serve", "--poll-interval", "abc"],
     "--poll-interval: expected a finite number from 0.01 to 3600, got 'abc'"),
    # Finding 9: NaN passes traitlets' bounds, and an infinity an open one.
    (["serve", "--poll-interval", "nan"],
     "--poll-interval: expected a finite number from 0.01 to 3600, got nan"),
    (["serve", "--freeze-budget-share", "nan"],
     "--freeze-budget-share: expected a finite number from 0 to 1, got nan"),
    (["serve", "--headroom", "nan"], "--headroom: expected a finite number from 0 to 1, got nan"),
    (["serve", "--reclaim-grace", "inf"],
     "--reclaim-grace: expected a finite number of at least 0, got inf"),
    (["serve", "--max-leases-per-user=0"], "--max-leases-per-user: expected a whole number of at least 1"),
    (["serve", "--headroom", "2"], "--headroom: expected a finite number from 0 to 1, got 2.0"),
    (["serve", "--log-level", "loud"], "--log-level: expected debug, info, warning or error, got 'loud'"),
    (["serve", "--max-workloads-per-gpu", "two"], "--max-workloads-per-gpu: expected a whole number"),
    (["serve", "--context-size", "0.5"],
     "--context-size: expected a memory size such as 500Mi, 20GiB, 2500M or bytes, got '0.5'"),
    (["serve", "--tcp", "localhost"], "--tcp: expected HOST:PORT"),
    (["serve", "--bogus", "1"], "unrecognized option --bogus"),
    (["run", "--gpus", "0", "--", "true"], "--gpus: expected a whole number of at least 1, got 0"),
    (["run", "--timeout", "soon", "--", "true"],
     "--timeout: expected a finite number of at least 0, got 'soon'"),
    (["status", "extra"], "gpufrac-agent status: unexpected argument 'extra'"),
    (["release"], "gpufrac-agent release: expected one lease id"),
    ([], "gpufrac-agent: give a subcommand: one of serve, status, run, release, demo"),
    (["lease"], "gpufrac-agent: no subcommand 'lease'"),
])
def test_bad_values_name_the_option_and_what_it_takes(
    argv: list[str], said: str, no_config: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(argv) == 2
    assert said in capsys.readouterr().err


def test_serve_settings_are_the_agent_config_and_documented() -> None:
    traits = cli.ServeApp.class_traits(config=True)
    defaults = AgentConfig()
    for field in dataclasses.fields(AgentConfig):
        assert traits[field.name].default_value == getattr(defaults, field.name), field.name
    assert cli.ServeApp().agent_config() == defaults
    for command in (cli.GpuFracAgent, *cli.COMMANDS):
        for name, trait in command.class_own_traits(config=True).items():
            assert trait.help, f"{command.__name__}.{name} has no help"


def test_help_and_help_all(no_config: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in ("serve", "status", "run", "release", "demo"))
    assert "/etc/gpufrac/gpufrac_agent_config.py" in out and "--socket" in out
    assert cli.main(["--help-all"]) == 0
    out = capsys.readouterr().out
    for command in cli.COMMANDS:
        for name in command.class_own_traits(config=True):
            assert f"--{command.__name__}.{name}" in out
    for argv in (["serve", "--help"], ["help", "serve"]):
        assert cli.main(argv) == 0
        out = capsys.readouterr().out
        assert "--poll-interval" in out and "--no-node-scheduler" in out
        assert f"Default: {AgentConfig().reclaim_grace}" in out
    assert cli.main(["run", "--help"]) == 0
    assert "-- CMD [ARGS...]" in capsys.readouterr().out


def test_config_files_in_order_under_the_command_line(
    no_config: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (no_config / "etc").mkdir()
    (no_config / "xdg" / "gpufrac").mkdir(parents=True)
    (no_config / "etc" / "gpufrac_agent_config.py").write_text(
        f"c.GpuFracAgent.socket = {str(no_config / 'node.sock')!r}\n"
        f"c.GpuFracAgent.state_dir = {str(no_config / 'state')!r}\n"
        "c.ServeApp.poll_interval = 0.5\nc.ServeApp.reclaim_grace = 5\n")
    (no_config / "xdg" / "gpufrac" / "gpufrac_agent_config.json").write_text(
        json.dumps({"StatusApp": {"socket": str(no_config / "user.sock")},
                    "ServeApp": {"reclaim_grace": 7}}))
    mine = no_config / "mine.py"
    mine.write_text("c.ServeApp.headroom = 0.2\nc.ServeApp.reclaim_grace = 9\n")

    assert cli.main(["status"]) == 1
    err = capsys.readouterr().err
    user_file = no_config / "xdg" / "gpufrac" / "gpufrac_agent_config.json"
    assert f"used the socket {no_config}/user.sock (from " in err and str(user_file) in err
    assert f"--state-dir {no_config}/state`" in err, "the node's file sets what the user's does not"

    app = cli.GpuFracAgentApp()
    app.initialize(["--config", str(mine), "serve", "--headroom", "0.3"])
    config = app.subapp.agent_config()
    assert (config.poll_interval, config.reclaim_grace, config.headroom) == (0.5, 9, 0.3)
    assert app.subapp.socket == str(no_config / "node.sock")

    mine.write_text("c.ServeApp.poll_interval = 'often'\n")
    assert cli.main(["serve", "--config", str(mine)]) == 2
    assert (f"{mine}: c.ServeApp.poll_interval: expected a finite number from 0.01 to 3600, got 'often'"
            in capsys.readouterr().err)
    mine.write_text("c.ServeApp.poll_interval =\n")
    assert cli.main(["serve", "--config", str(mine)]) == 2
    assert f"cannot read the config file {mine}: SyntaxError" in capsys.readouterr().err
    assert cli.main(["status", "--config", str(no_config / "missing.py")]) == 2
    assert "--config: expected an existing .py or .json file" in capsys.readouterr().err


def test_an_option_given_twice_keeps_its_last_value(no_config: Path) -> None:
    # As with argparse: scripts append to a command line rather than edit it.
    app = cli.GpuFracAgentApp()
    app.initialize(["serve", "--orphan-grace", "600", "--simulate", "1x1GiB", "--orphan-grace=0.2"])
    assert app.subapp.agent_config().orphan_grace == 0.2


def test_a_config_file_others_can_write_is_refused(
    no_config: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A config file is Python the agent runs, as root on a real node.
    folder = no_config / "xdg" / "gpufrac"
    folder.mkdir(parents=True)
    planted = folder / "gpufrac_agent_config.py"
    planted.write_text("c.ServeApp.admin_group = 'everyone'\n")
    planted.chmod(0o666)
    assert cli.main(["serve", "--simulate", "1x1GiB"]) == 2
    assert f"refusing the config file {planted}: {planted} is writable by group or others" in (
        capsys.readouterr().err)
    planted.chmod(0o644)
    folder.chmod(0o777)
    assert cli.main(["status"]) == 2
    assert f"{folder} is writable by group or others (mode 0777)" in capsys.readouterr().err


def test_install_service_writes_a_unit_that_runs_this_agent_as_the_system_agent(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["install-service", "--unit-dir", str(tmp_path), "--admin-group", "root"]) == 0
    unit = (tmp_path / "gpufrac-agent.service").read_text()
    [exec_start] = [line for line in unit.splitlines() if line.startswith("ExecStart=")]
    assert exec_start.split("=", 1)[1].split() == [
        sys.executable, "-m", "node_agent", "serve", "--socket", "/run/gpufrac/agent.sock",
        "--state-dir", "/var/lib/gpufrac", "--admin-group", "root"]
    assert "RuntimeDirectory=gpufrac" in unit and "StateDirectoryMode=0700" in unit
    assert "systemctl daemon-reload && systemctl enable --now gpufrac-agent" in capsys.readouterr().out
    # The command it names parses: the service would start, not fail on its options.
    args = exec_start.split("=", 1)[1].split()[3:]
    assert cli.main([*args, "--help"]) == 0
    verify = shutil.which("systemd-analyze")
    if verify is not None:  # present on a systemd host: it checks the unit as systemd reads it
        done = subprocess.run([verify, "verify", str(tmp_path / "gpufrac-agent.service")],
                              capture_output=True, text=True, timeout=60, check=False)
        problems = [line for line in done.stderr.splitlines()
                    if "gpufrac-agent.service" in line and "nvidia-persistenced" not in line]
        assert problems == [], done.stderr
    assert cli.main(["install-service", "--unit-dir", str(tmp_path), "--admin-group", "nope-x"]) == 2
    assert "--admin-group: no group 'nope-x'" in capsys.readouterr().err


def test_an_agent_started_to_exit_with_its_parent_stops_when_the_parent_is_killed(
    tmp_path: Path,
) -> None:
    """A Jupyter server's embedded agent: the server killed (or stopped mid-start) takes it."""
    socket_path = tmp_path / "agent.sock"
    parent = subprocess.Popen(
        [sys.executable, "-c",
         "import subprocess, sys, time\n"
         f"child = subprocess.Popen([sys.executable, '-m', 'node_agent', 'serve', '--simulate',"
         f" '1x1GiB', '--socket', {str(socket_path)!r}, '--state-dir', {str(tmp_path / 's')!r},"
         " '--exit-with-parent'], start_new_session=True)\n"
         "print(child.pid, flush=True)\ntime.sleep(600)\n"],
        stdout=subprocess.PIPE, text=True)
    assert parent.stdout is not None
    child = int(parent.stdout.readline())
    wait_for(lambda: AgentClient(str(socket_path)).ping(), 30, "the agent to answer")
    parent.kill()
    parent.wait()
    wait_for(lambda: not Path(f"/proc/{child}").exists() or
             Path(f"/proc/{child}/stat").read_text().split()[2] == "Z", 15, "the agent to stop")


def test_the_system_agents_socket_is_the_default_only_where_root_made_its_folder(
    no_system_agent: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The rule of the README's "The agent's socket", step 2, against a socket of the test's
    own (the machine's real one, if any, is never asked: tests/conftest.py)."""
    if os.getuid() != 0:
        pytest.skip("needs root to own the system socket's folder")
    monkeypatch.delenv("GPUFRAC_AGENT_SOCKET", raising=False)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    personal = str(tmp_path / "gpufrac" / "agent.sock")
    assert default_socket_path() == personal  # nothing there yet
    folder = Path(no_system_agent).parent
    folder.mkdir(parents=True, exist_ok=True)
    listener = socket.socket(socket.AF_UNIX)
    try:
        listener.bind(no_system_agent)
        assert default_socket_path() == no_system_agent
        os.chown(folder, 65534, 65534)  # another user's folder is nobody's default
        assert default_socket_path() == personal
    finally:
        listener.close()
        os.chown(folder, 0, 0)
        os.unlink(no_system_agent)
