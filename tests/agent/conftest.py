"""Fixtures that run a real agent process on a temporary Unix socket, and the stand-in libcuda."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from harness.agent import ROOT, AgentProcess, ChildProcess

from .fake_cuda import VARIANTS, FakeCuda, Target, build

if TYPE_CHECKING:
    from harness.kubelet import FakeKubelet
    from node_agent.client import AgentClient

ALLOCATE = (
    "import sys\n"
    "print('ready', flush=True)\n"
    "blocks = []\n"
    "for line in sys.stdin:\n"
    "    if int(line) == 0:\n"
    "        blocks.clear()\n"
    "        print('held', flush=True)\n"
    "        continue\n"
    "    blocks.append(bytearray(int(line) * 2**20))\n"
    "    blocks[-1][::4096] = b'x' * len(blocks[-1][::4096])\n"
    "    print('held', flush=True)\n"
)


@pytest.fixture
def shared_tmp() -> Iterator[Path]:
    """A temporary directory other uids may enter (pytest's own are 0700)."""
    path = Path(tempfile.mkdtemp(prefix="gpufrac-test-"))
    path.chmod(0o755)
    yield path
    subprocess.run(["rm", "-rf", str(path)], check=False)


@pytest.fixture
def start_agent(shared_tmp: Path) -> Iterator[Callable[..., AgentProcess]]:
    started: list[AgentProcess] = []

    def start(*args: str, spec: str = "2x1GiB", env: dict[str, str] | None = None
              ) -> AgentProcess:
        root = shared_tmp / f"agent{len(started)}"
        root.mkdir()
        root.chmod(0o755)
        agent = AgentProcess(root, spec, ["--poll-interval", "0.05", *args], env=env)
        started.append(agent.start())
        return agent

    yield start
    for agent in started:
        agent.stop()


class Holder(ChildProcess):
    """A real process that holds as much memory as a test tells it to."""

    def __init__(self, env: dict[str, str] | None = None) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", ALLOCATE], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            text=True, env={**os.environ, **(env or {})},
        )
        assert self.proc.stdout is not None
        assert self.proc.stdout.readline().strip() == "ready"

    @property
    def pid(self) -> int:
        return self.proc.pid

    def hold(self, mib: int) -> None:
        """Hold ``mib`` more MiB; 0 lets go of everything held."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(f"{mib}\n")
        self.proc.stdin.flush()
        assert self.proc.stdout.readline().strip() == "held"


@pytest.fixture
def holders() -> Iterator[Callable[..., Holder]]:
    made: list[Holder] = []

    def make(**env: str) -> Holder:
        made.append(Holder(env))
        return made[-1]

    yield make
    for h in made:
        h.stop()


def notebook_holding(agent: AgentProcess, holders: Callable[..., Holder], request: str,
                     limit: str, mib: int) -> tuple[dict[str, Any], Holder]:
    """A notebook lease whose registered process holds ``mib`` MiB on its GPU."""
    c = agent.client()
    lease = c.create_lease(client="jupyter", request=request, limit=limit)
    h = holders(CUDA_VISIBLE_DEVICES=lease["physical_gpu"])
    lease = c.register_pid(lease["id"], h.pid)
    h.hold(mib)
    return lease, h


def until_stopped(c: AgentClient, cursor: int, *, client: str | None = None,
                  lease: str | None = None, timeout: float = 20) -> list[dict[str, Any]]:
    """The directives after ``cursor`` up to a stop. A shrink or a move comes a grace before its
    stop, but where the test's own steps take longer than the grace (a loaded machine), one read
    has both."""
    found: list[dict[str, Any]] = []
    deadline = time.monotonic() + timeout
    while not any(d["kind"] == "killed" for d in found):
        left = deadline - time.monotonic()
        assert left > 0, f"no stop after {[d['kind'] for d in found]}"
        more, cursor = c.directives(client=client, lease=lease, after=cursor, timeout=left)
        found += more
    return found


def run_job(agent: AgentProcess, out: Path) -> subprocess.Popen[str]:
    """`gpufrac-agent run --gpus 1` of a script that writes where it ran into ``out``."""
    script = f"import os, pathlib; pathlib.Path({str(out)!r}).write_text(os.environ['CUDA_VISIBLE_DEVICES'])"
    return subprocess.Popen(
        [sys.executable, "-m", "node_agent", "--socket", agent.socket, "run", "--gpus", "1", "--",
         sys.executable, "-c", script],
        stderr=subprocess.PIPE, text=True,
    )


@pytest.fixture
def kubelet(shared_tmp: Path) -> Iterator[FakeKubelet]:
    from harness.kubelet import FakeKubelet  # grpc, for these tests only

    with FakeKubelet(shared_tmp / "kubelet.sock") as served:
        yield served


@pytest.fixture
def k8s_agent(start_agent: Callable[..., AgentProcess], kubelet: FakeKubelet) -> AgentProcess:
    return start_agent("--kubelet-socket", kubelet.socket_path, "--kubelet-interval", "0.05",
                       spec="4x4GiB")


def pods_leases(agent: AgentProcess) -> dict[str, dict[str, Any]]:
    return {lease["name"]: lease for lease in agent.client().leases()
            if lease["planned_by"] == "kubelet"}


# --- the stand-in libcuda (fake_cuda/) ----------------------------------------------------

OLD = "GPU-5ca1ab1e-0000-4000-8000-000000000000"
SAME = "GPU-5ca1ab1e-0000-4000-8000-000000000002"
GPU = 2**30
CONTEXT = 16 * 2**20

# Drives one DriverFreezer in a fresh process (libcuda found through LD_LIBRARY_PATH, as on a
# node): argv[1] is a JSON list of [operation, arguments...], argv[2] the library if not the
# default. Prints one {"ok": value} or {"error": message, "kind": kind} per operation.
DRIVE = """
import json, sys, threading, time
from node_agent.devices import DriverFreezer
from node_agent.devices.base import FreezeError
freezer = DriverFreezer(*sys.argv[2:])

def checkpoint_all(pids):
    errors = []
    def one(pid):
        try:
            freezer.lock(pid, timeout=5)
            freezer.checkpoint(pid)
        except FreezeError as exc:
            errors.append(str(exc))
    threads = [threading.Thread(target=one, args=(pid,)) for pid in pids]
    started = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {"seconds": time.monotonic() - started, "errors": errors}

out = []
for op, *args in json.loads(sys.argv[1]):
    try:
        if op == "unavailable":
            value = freezer.unavailable()
        elif op == "can_remap":
            value = freezer.can_remap()
        elif op == "lock":
            value = freezer.lock(args[0], timeout=args[1])
        elif op == "checkpoint_all":
            value = checkpoint_all(*args)
        else:
            value = getattr(freezer, op)(*args)
        out.append({"ok": value})
    except FreezeError as exc:
        out.append({"error": str(exc), "kind": exc.kind})
print(json.dumps(out))
"""

Drive = Callable[..., list[dict[str, Any]]]


@pytest.fixture(scope="session")
def libraries(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One fake libcuda.so.1 per driver generation."""
    root = tmp_path_factory.mktemp("libcuda")
    return {variant: build(variant, root / variant) for variant in VARIANTS}


@pytest.fixture
def fake(tmp_path: Path) -> FakeCuda:
    return FakeCuda(tmp_path / "cuda")


@pytest.fixture
def drive(fake: FakeCuda, libraries: dict[str, Path], tmp_path: Path) -> Drive:
    """Runs the operations through ``variant``'s library; ``library`` overrides the name."""

    def run(variant: str, *ops: list[Any], library: str | None = None,
            timeout: float = 60) -> list[dict[str, Any]]:
        argv = [sys.executable, "-c", DRIVE, json.dumps(ops), *([library] if library else [])]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                              env={**os.environ, **fake.env(libraries[variant])})
        assert done.returncode == 0, done.stderr
        results: list[dict[str, Any]] = json.loads(done.stdout)
        return results

    return run


@pytest.fixture
def started(fake: FakeCuda, libraries: dict[str, Path]) -> Iterator[Callable[..., Target]]:
    """Starts small CUDA programs on the stand-in (a node of two 1 GiB GPUs: OLD and SAME)."""
    fake.gpus([(OLD, GPU, CONTEXT), (SAME, GPU, CONTEXT)])
    made: list[Target] = []

    def start(gpu: str = OLD, *, mib: int = 8, cuda: bool = True) -> Target:
        made.append(Target({**fake.env(libraries["r580"]), "CUDA_VISIBLE_DEVICES": gpu},
                           cuda=cuda))
        if cuda and mib:
            made[-1].hold(mib)
        return made[-1]

    yield start
    for t in made:
        t.stop()


@pytest.fixture
def target(started: Callable[..., Target]) -> int:
    """A CUDA process holding 8 MiB on GPU OLD."""
    return started().pid


