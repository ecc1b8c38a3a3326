"""A real ``jupyter server`` as a child process, and a notebook's websocket connection to a kernel."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import websocket

from harness.agent import free_port, rest_call, wait_for

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Server:
    url: str
    token: str
    root: Path
    log: Path
    process: subprocess.Popen[bytes] = field(repr=False)

    def api(self, path: str, method: str = "GET", body: object = None) -> tuple[int, Any]:
        return rest_call(f"{self.url}{path}", self.token, method, body)

    def get(self, path: str) -> Any:
        status, body = self.api(path)
        assert status == 200, (path, status, body)
        return body

    def open_notebook(self, path: str, kernel: str = "python3") -> Notebook:
        """What JupyterLab does for an opened notebook: a session, then the kernel's websocket."""
        status, session = self.api(
            "/api/sessions", "POST",
            {"path": path, "type": "notebook", "name": path, "kernel": {"name": kernel}},
        )
        assert status == 201, (status, session)
        return Notebook(self, session["kernel"]["id"])

    def kernel_status(self, kernel_id: str) -> dict[str, Any]:
        return dict(self.get(f"/api/gpufrac/kernels/{kernel_id}"))

    def events(self, kernel_id: str) -> list[str]:
        return [event["event"] for event in self.kernel_status(kernel_id)["events"]]

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")


def start_server(
    tmp: Path,
    agent_socket: str,
    config: str = "",
    kernelspecs: dict[str, dict[str, Any]] | None = None,
    deadline_s: float = 60,
    env: Mapping[str, str] | None = None,
    root: Path | None = None,
) -> Server:
    """``python -m jupyter_server`` with its own HOME and Jupyter dirs, the extension enabled.

    ``kernelspecs`` maps names to kernelspec metadata for extra ipykernel kernelspecs; ``env``
    is added to the server's environment (a pod's, say); ``root``: the notebook folder it
    serves (another server's too: one volume on two nodes), else one of its own.
    """
    dirs = {name: tmp / name for name in ("home", "config", "data", "runtime", "root")}
    if root is not None:
        dirs["root"] = root
    for path in dirs.values():
        path.mkdir(parents=True, exist_ok=True)
    for name, metadata in (kernelspecs or {}).items():
        spec_dir = dirs["data"] / "kernels" / name
        spec_dir.mkdir(parents=True)
        (spec_dir / "kernel.json").write_text(json.dumps({
            "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
            "display_name": name, "language": "python", "metadata": metadata,
        }))
    (dirs["config"] / "jupyter_server_config.py").write_text(
        # Only what the tests need: other installed extensions add seconds to each start.
        "c.ServerApp.jpserver_extensions = {'jupyter_gpufrac': True, 'jupyterlab': False,"
        " 'jupyter_lsp': False, 'jupyter_server_terminals': False, 'notebook_shim': False}\n"
        'c.KernelProvisionerFactory.default_provisioner_name = "gpufrac-provisioner"\n'
        + config
    )
    token, port = uuid.uuid4().hex, free_port()
    added = dict(env or {})
    env = {
        **os.environ,
        "HOME": str(dirs["home"]),
        "JUPYTER_CONFIG_DIR": str(dirs["config"]),
        "JUPYTER_DATA_DIR": str(dirs["data"]),
        "JUPYTER_RUNTIME_DIR": str(dirs["runtime"]),
        "GPUFRAC_AGENT_SOCKET": agent_socket,
        "PYTHONPATH": str(ROOT),
    }
    env.pop("JUPYTER_PATH", None)
    env.pop("RUNAI_GPU_MEMORY_LIMIT", None)
    env.update(added)
    log = tmp / "server.log"
    with open(log, "wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "jupyter_server", "--no-browser", "--allow-root",
             f"--port={port}", "--port-retries=0", f"--IdentityProvider.token={token}",
             f"--ServerApp.root_dir={dirs['root']}"],
            env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        )
    server = Server(f"http://127.0.0.1:{port}", token, dirs["root"], log, process)

    def ready() -> bool:
        if process.poll() is not None:
            raise AssertionError(f"jupyter server exited: {server.log_text()[-3000:]}")
        try:
            return server.api("/api/status")[0] == 200
        except OSError:
            return False

    try:
        wait_for(ready, deadline_s, "the jupyter server to answer", interval=0.2)
    except BaseException:
        stop_server(server)
        raise
    return server


def kill_tree(process: subprocess.Popen[bytes] | int) -> None:
    """SIGKILL a process and everything it started, all at once, as a node that goes away does
    (its kernels, its spare kernels, its embedded agent)."""
    pid = process if isinstance(process, int) else process.pid
    try:
        root = psutil.Process(pid)
        tree = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for found in tree:
        with contextlib.suppress(psutil.NoSuchProcess):
            found.kill()
    psutil.wait_procs(tree, timeout=10)
    if not isinstance(process, int):
        process.wait()


def stop_server(server: Server) -> None:
    if server.process.poll() is None:
        server.process.send_signal(signal.SIGTERM)
        try:
            server.process.wait(30)
        except subprocess.TimeoutExpired:
            server.process.kill()
            server.process.wait()


@contextlib.contextmanager
def running_server(
    tmp: Path, agent_socket: str, config: str = "", kernelspecs: dict[str, dict[str, Any]] | None = None,
    env: Mapping[str, str] | None = None, root: Path | None = None,
) -> Iterator[Server]:
    server = start_server(tmp, agent_socket, config, kernelspecs, env=env, root=root)
    try:
        yield server
    finally:
        stop_server(server)


# Colours in a traceback's lines (ESC [ … m).
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


@dataclass
class Reply:
    status: str
    stdout: str
    error: str
    # text/plain of execute_result and display_data, in order
    results: list[str] = field(default_factory=list)
    # The cell's number as the notebook shows it ([n]), from the execute_reply.
    execution_count: int | None = None
    # The error output's lines as the notebook shows them, top first, colours left out.
    traceback: list[str] = field(default_factory=list)


class Notebook:
    """A kernel connection as an open notebook page holds it: one websocket, kept throughout."""

    def __init__(self, server: Server, kernel_id: str) -> None:
        self.server = server
        self.kernel_id = kernel_id
        self.session = uuid.uuid4().hex
        self.ws = self._connect()
        # Messages of a cell read ahead by :meth:`printed`, by its message id.
        self._kept: dict[str, list[dict[str, Any]]] = {}

    def _connect(self) -> websocket.WebSocket:
        url = self.server.url.replace("http://", "ws://")
        return websocket.create_connection(
            f"{url}/api/kernels/{self.kernel_id}/channels?session_id={self.session}",
            header=[f"Authorization: token {self.server.token}"], timeout=60,
        )

    def _catch_up(self) -> None:
        """Read what has arrived, keeping each cell's messages; after a ``restarting`` status
        (jupyter_client's restarter restarted the kernel) connect anew, as JupyterLab does:
        the server then makes sure the new kernel's IOPub reaches this page before it answers,
        where the old connection may miss a cell's first messages (or all of them)."""
        restarted = False
        while True:
            self.ws.settimeout(0.01)
            try:
                opcode, data = self.ws.recv_data(control_frame=True)
            except websocket.WebSocketTimeoutException:
                break
            if opcode != websocket.ABNF.OPCODE_TEXT:
                continue
            msg: dict[str, Any] = json.loads(data)
            if msg.get("msg_type") == "status" and \
                    msg.get("content", {}).get("execution_state") == "restarting":
                restarted = True
            parent = msg.get("parent_header", {}).get("msg_id")
            if parent:
                self._kept.setdefault(parent, []).append(msg)
        if restarted:
            self.ws.close()
            self.ws = self._connect()

    def send(self, code: str) -> str:
        """Send a cell without waiting for it; returns its message id."""
        self._catch_up()
        msg_id = uuid.uuid4().hex
        self.ws.send(json.dumps({
            "header": {"msg_id": msg_id, "msg_type": "execute_request", "session": self.session,
                       "username": "test", "version": "5.3", "date": ""},
            "parent_header": {}, "metadata": {}, "channel": "shell", "buffers": [],
            "content": {"code": code, "silent": False, "store_history": True,
                        "user_expressions": {}, "allow_stdin": False, "stop_on_error": True},
        }))
        return msg_id

    def _next(self, msg_id: str, deadline: float) -> dict[str, Any] | None:
        """The cell's next message (kept ones first); None once ``deadline`` has passed."""
        if self._kept.get(msg_id):
            return self._kept[msg_id].pop(0)
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            self.ws.settimeout(remaining)
            # Control frames come back too: a server's pings would otherwise restart the
            # socket's timeout inside recv() and hold it past the deadline.
            try:
                opcode, data = self.ws.recv_data(control_frame=True)
            except websocket.WebSocketTimeoutException:
                return None
            if opcode != websocket.ABNF.OPCODE_TEXT:
                continue
            msg: dict[str, Any] = json.loads(data)
            if msg.get("parent_header", {}).get("msg_id") == msg_id:
                return msg

    def printed(self, msg_id: str, text: str, timeout: float = 60) -> str:
        """Wait until a running cell has printed ``text`` (on stdout); returns what it printed.
        The messages read are kept for :meth:`wait`."""
        deadline = time.monotonic() + timeout
        read: list[dict[str, Any]] = []
        stdout = ""
        try:
            while text not in stdout:
                msg = self._next(msg_id, deadline)
                if msg is None:
                    raise AssertionError(f"cell {msg_id} did not print {text!r} in {timeout:g} s;"
                                         f" it printed {stdout!r}")
                read.append(msg)
                if msg["msg_type"] == "stream" and msg["content"]["name"] == "stdout":
                    stdout += msg["content"]["text"]
        finally:
            self._kept[msg_id] = read + self._kept.get(msg_id, [])
        return stdout

    def wait(self, msg_id: str, timeout: float = 120) -> Reply:
        """Collect a cell's output until its reply and the kernel's return to idle."""
        deadline = time.monotonic() + timeout
        stdout, error, status, idle = [], "", "", False
        count: int | None = None
        traceback: list[str] = []
        results: list[str] = []
        seen: list[str] = []  # what came for this cell, named when it never finishes
        while not (status and idle):
            msg = self._next(msg_id, deadline)
            if msg is None:
                raise AssertionError(f"cell {msg_id} did not finish in {timeout:g} s; "
                                     f"messages seen: {seen}; out: {stdout}")
            kind, content = msg["msg_type"], msg["content"]
            seen.append(f"{msg.get('channel')}:{kind}")
            if kind == "stream" and content["name"] == "stdout":
                stdout.append(content["text"])
            elif kind == "stream":
                error += content["text"]  # IPython prints UsageError on stderr
            elif kind in ("execute_result", "display_data"):
                results.append(str(content.get("data", {}).get("text/plain", "")))
            elif kind == "error":
                error = f"{content['ename']}: {content['evalue']}"
                traceback = [_ANSI.sub("", line) for line in content.get("traceback", [])]
            elif kind == "execute_reply":
                status = content["status"]
                count = content.get("execution_count")
                if status == "error" and not error:
                    error = f"{content.get('ename')}: {content.get('evalue')}"
            elif kind == "status" and content["execution_state"] == "idle":
                idle = True
        self._kept.pop(msg_id, None)
        return Reply(status, "".join(stdout), error, results, count, traceback)

    def run(self, code: str, timeout: float = 120) -> Reply:
        return self.wait(self.send(code), timeout)

    def ok(self, code: str, timeout: float = 120) -> str:
        """Run a cell that must succeed; returns what it printed."""
        reply = self.run(code, timeout)
        assert reply.status == "ok", f"{code!r} failed: {reply.error}\n{reply.stdout}"
        return reply.stdout

    def close(self) -> None:
        self.ws.close()
