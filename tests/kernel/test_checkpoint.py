"""Checkpoint and restore of namespaces: shared references, cell code, unpicklables, increments."""

from __future__ import annotations

import json
import random
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import torch

from jupyter_gpufrac.kernel import store
from jupyter_gpufrac.kernel.checkpoint import Checkpointer

from .kernels import REPO


def cell_ns(source: str) -> dict[str, Any]:
    """A namespace whose definitions live in ``__main__``, as a notebook cell's do."""
    ns: dict[str, Any] = {"__name__": "__main__"}
    exec(compile(source, "<cell>", "exec"), ns)
    return ns


MODEL_CELL = """
import torch
torch.manual_seed(0)
class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 4)
    def forward(self, x):
        return self.fc(x) * scale
scale = 2.0
model = Net()
opt = torch.optim.Adam(model.parameters(), lr=0.1)
loss = model(torch.ones(3, 8)).sum()
loss.backward()
opt.step()
data = [1, 2, 3]
alias = data
square = lambda v: v * v
def uses_scale():
    return scale
"""


def test_model_and_optimizer_keep_sharing_parameters(ckdir: Path) -> None:
    ns = cell_ns(MODEL_CELL)
    Checkpointer(ckdir).take(ns)
    fresh: dict[str, Any] = {"__name__": "__main__"}
    result = Checkpointer(ckdir).load(fresh)
    assert {"model", "opt", "data", "alias", "square", "Net"} <= set(result.restored)
    model, opt = fresh["model"], fresh["opt"]
    params = list(model.parameters())
    assert all(a is b for a, b in zip(opt.param_groups[0]["params"], params, strict=True))
    assert fresh["data"] is fresh["alias"]
    assert torch.equal(model.fc.weight, ns["model"].fc.weight)
    # Adam state came back and still drives the restored parameters.
    original_first = next(iter(ns["model"].parameters()))
    assert opt.state[params[0]]["step"] == ns["opt"].state[original_first]["step"]
    before = model.fc.weight.detach().clone()
    model(torch.ones(2, 8)).sum().backward()
    opt.step()
    assert not torch.equal(before, model.fc.weight)


def test_cell_functions_see_the_live_namespace(ckdir: Path) -> None:
    ns = cell_ns(MODEL_CELL)
    Checkpointer(ckdir).take(ns)
    fresh: dict[str, Any] = {"__name__": "__main__"}
    Checkpointer(ckdir).load(fresh)
    assert fresh["square"](7) == 49
    assert fresh["uses_scale"]() == 2.0
    fresh["scale"] = 5.0  # rebinding a global after restore is seen by cell functions
    assert fresh["uses_scale"]() == 5.0


def test_main_classes_and_lambdas_restore_in_another_process(ckdir: Path) -> None:
    extra = """
import dataclasses, enum
@dataclasses.dataclass
class Config:
    lr: float = 0.1
class Color(enum.Enum):
    RED = 1
config = Config(lr=0.5)
color = Color.RED
out = model(torch.ones(1, 8)).tolist()
"""
    ns = cell_ns(MODEL_CELL + extra)
    Checkpointer(ckdir).take(ns)
    script = f"""
import json, torch
from jupyter_gpufrac.kernel.checkpoint import Checkpointer
ns = {{"__name__": "__main__"}}
Checkpointer({str(ckdir)!r}).load(ns)
net = ns["model"]
print(json.dumps({{
    "cls": type(net).__name__, "isinstance": isinstance(net, ns["Net"]),
    "out": net(torch.ones(1, 8)).tolist(), "square": ns["square"](3),
    "config": repr(ns["config"]), "color": ns["color"] is ns["Color"].RED,
}}))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          cwd=REPO, timeout=60, check=True)
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["cls"] == "Net" and got["isinstance"] and got["square"] == 9
    assert got["out"] == ns["out"]
    assert got["config"] == "Config(lr=0.5)" and got["color"]


def test_unpicklable_variables_are_listed_by_name_not_fatal(ckdir: Path) -> None:
    ns = cell_ns("import threading\nkeep = {'a': 1}\ngen = (i for i in range(3))\n")
    ns["lock"] = threading.Lock()
    ns["sock"] = socket.socket()
    try:
        result = Checkpointer(ckdir).take(ns)
    finally:
        ns["sock"].close()
    assert set(result.lost) == {"gen", "lock", "sock"}
    assert "generator" in result.lost["gen"]
    fresh: dict[str, Any] = {}
    loaded = Checkpointer(ckdir).load(fresh)
    assert fresh["keep"] == {"a": 1} and fresh["threading"] is threading
    assert set(loaded.lost) == {"gen", "lock", "sock"}


def test_one_bad_variable_inside_a_shared_structure(ckdir: Path) -> None:
    ns = cell_ns("shared = [1, 2]\nholder = {'s': shared}\n")
    ns["bad"] = [shared_lock := threading.Lock()]
    result = Checkpointer(ckdir).take(ns)
    assert list(result.lost) == ["bad"] and shared_lock.acquire(blocking=False)
    fresh: dict[str, Any] = {}
    Checkpointer(ckdir).load(fresh)
    assert fresh["holder"]["s"] is fresh["shared"]


def test_ipython_names_are_skipped_and_modules_reimported(ckdir: Path) -> None:
    ns = cell_ns("import json as js\nvalue = 3\n")
    ns.update({"In": ["", "x"], "Out": {}, "_": 1, "_i1": "x", "_3": 4, "exit": object(),
               "get_ipython": lambda: None})
    result = Checkpointer(ckdir).take(ns, hidden={"exit": ns["exit"]})
    assert result.names == ["value"]
    assert result.modules == {"js": "json"}


def test_second_checkpoint_without_changes_writes_no_tensor_bytes(ckdir: Path) -> None:
    ns = cell_ns("import torch\na = torch.randn(1000)\nb = torch.randn(50, 50)\nv = a[10:20]\n")
    ck = Checkpointer(ckdir)
    first = ck.take(ns)
    assert first.bytes_written == 4000 + 10000 and first.blobs_written == 2
    second = ck.take(ns)
    assert second.bytes_written == 0 and second.blobs_written == 0
    ns["v"].mul_(2)  # a view's in-place change is a change of its base's storage
    third = ck.take(ns)
    assert third.bytes_written == 4000 and third.blobs_written == 1
    ns["b"] = torch.zeros(3)  # a new object under an old name is written
    fourth = ck.take(ns)
    assert fourth.bytes_written == 12
    ck.wait_for_cleanup()
    blobs = {p.name for p in (ckdir / store.BLOB_DIR).iterdir()}
    header = ck.read_header()
    assert header is not None
    assert blobs == set(header["blobs"])  # replaced blobs were collected
    fresh: dict[str, Any] = {}
    Checkpointer(ckdir).load(fresh)
    assert torch.equal(fresh["a"], ns["a"]) and torch.equal(fresh["v"], ns["v"])
    assert fresh["v"].untyped_storage().data_ptr() == fresh["a"].untyped_storage().data_ptr()


def test_full_checkpoint_rewrites_and_restored_tensors_are_not_rewritten(ckdir: Path) -> None:
    ns = cell_ns("import torch\na = torch.randn(256)\n")
    Checkpointer(ckdir).take(ns)
    restored: dict[str, Any] = {}
    ck = Checkpointer(ckdir)
    ck.load(restored)
    assert ck.take(restored).bytes_written == 0  # restored tensors map to their blobs
    assert ck.take(restored, full=True).bytes_written == 1024


def test_random_generators_continue(ckdir: Path) -> None:
    random.seed(1)
    torch.manual_seed(1)
    Checkpointer(ckdir).take({})
    expected = (random.random(), torch.rand(3).tolist())
    random.seed(99)
    torch.manual_seed(99)
    loaded = Checkpointer(ckdir).load({})
    assert {"python", "torch"} <= set(loaded.rng)
    assert (random.random(), torch.rand(3).tolist()) == expected


def test_parameters_and_dtypes_round_trip(ckdir: Path) -> None:
    ns = {
        "p": torch.nn.Parameter(torch.randn(4, 4)),
        "ints": torch.arange(10, dtype=torch.int64)[::2],
        "half": torch.randn(5).half(),
        "boolean": torch.tensor([True, False]),
        "transposed": torch.randn(3, 5).t(),
        "grad": torch.ones(2, requires_grad=True),
        "empty": torch.empty(0),
    }
    Checkpointer(ckdir).take(ns)
    fresh: dict[str, Any] = {}
    Checkpointer(ckdir).load(fresh)
    assert isinstance(fresh["p"], torch.nn.Parameter) and fresh["p"].requires_grad
    for name, tensor in ns.items():
        assert fresh[name].dtype == tensor.dtype, name
        assert fresh[name].stride() == tensor.stride(), name
        assert torch.equal(fresh[name].detach(), tensor.detach()), name
    assert fresh["grad"].requires_grad


def test_gpu_tensors_land_on_the_cpu_without_cuda(ckdir: Path) -> None:
    # What a checkpoint taken on a GPU kernel records for a CUDA tensor, read by a CPU kernel.
    import io
    import pickle
    from concurrent.futures import ThreadPoolExecutor

    from jupyter_gpufrac.kernel import pickling, tensor_io
    from jupyter_gpufrac.kernel.stream import Streamer
    from jupyter_gpufrac.kernel.unpickler import NamespaceUnpickler

    store.ensure_private_dir(ckdir)
    source = torch.arange(6, dtype=torch.float32)
    blob, nbytes, _path = tensor_io.write_storage(ckdir, source.untyped_storage())

    class CudaTensor:
        def __reduce__(self) -> tuple[Any, ...]:
            return (pickling._tensor_ref, (blob, nbytes, "cuda", 2, (2, 2), (2, 1), "float32",
                                           False, False, None, False))

    named_twice = pickle.dumps([CudaTensor()] * 2)
    with store.CheckpointDir.open(ckdir) as folder, ThreadPoolExecutor(2) as pool:
        streamer = Streamer(folder, pool)

        def fetch(blob: str, nbytes: int, target: str) -> Any:
            return streamer.take(streamer.submit(blob, nbytes, target))

        unpickler = NamespaceUnpickler(io.BytesIO(named_twice), {}, "cpu", fetch)
        tensor, again = unpickler.load()
    assert tensor.device.type == "cpu" and tensor.tolist() == [[2.0, 3.0], [4.0, 5.0]]
    assert unpickler.moved_to_cpu_bytes == 24
    assert again is tensor  # one tensor, however often it is named


def tensor_blobs(ckdir: Path) -> list[Path]:
    """Blobs holding tensor storages, named by a uuid (content-addressed packs of pickles and
    buffers are named g-<hash>.bin and r-<hash>.bin, zg-/zr- when compressed)."""
    return [p for p in (ckdir / store.BLOB_DIR).iterdir() if "-" not in p.name]


def test_tensors_only_reachable_from_a_bad_variable_are_not_kept(ckdir: Path) -> None:
    ns: dict[str, Any] = {"good": torch.ones(4), "bad": [torch.zeros(8), threading.Lock()]}
    ck = Checkpointer(ckdir)
    result = ck.take(ns)
    assert list(result.lost) == ["bad"] and result.tensors_bytes == 16
    ck.wait_for_cleanup()
    assert len(tensor_blobs(ckdir)) == 1


# A fresh kernel restoring what a GPU kernel saved. torch is imported only by the restore; once
# it is, torch reports one CUDA device, and a storage made there is recorded and made on the
# host (this torch has no CUDA). What is checked is where our restore makes the tensors.
RESTORE_ON_CUDA = """
import builtins, json, sys
from jupyter_gpufrac.kernel.checkpoint import Checkpointer
assert "torch" not in sys.modules, "the restore must start without torch"
targets = []
real_import = builtins.__import__

def give_torch_a_gpu(torch):
    torch.cuda.is_available = lambda: True
    torch.cuda.current_device = lambda: 0
    torch.cuda.device_count = lambda: 1
    empty = torch.empty
    def empty_on(*args, device=None, **kwargs):
        if str(device).startswith("cuda"):
            targets.append(str(device))
            device = "cpu"
        return empty(*args, device=device, **kwargs)
    torch.empty = empty_on

def watching_import(name, *args, **kwargs):
    fresh = "torch" not in sys.modules
    module = real_import(name, *args, **kwargs)
    if fresh and "torch" in sys.modules and sys.argv[2] == "cuda":
        give_torch_a_gpu(sys.modules["torch"])
    return module

builtins.__import__ = watching_import
ns = {}
result = Checkpointer(sys.argv[1]).load(ns)
print(json.dumps({"targets": targets, "moved_to_cpu": result.moved_to_cpu_bytes,
                  "restored": result.restored, "values": ns["w"].tolist()}))
"""


def gpu_checkpoint(ckdir: Path, monkeypatch: Any) -> None:
    """Write the checkpoint a CUDA kernel would: its tensors recorded as on ``cuda``."""
    from jupyter_gpufrac.kernel import blobs

    real = blobs.BlobWriter.record_for

    def on_cuda(self: Any, tensor: Any) -> tuple[str, int, str]:
        blob, nbytes, _device = real(self, tensor)
        return blob, nbytes, "cuda"

    monkeypatch.setattr(blobs.BlobWriter, "record_for", on_cuda)
    Checkpointer(ckdir).take({"w": torch.arange(6.0).reshape(2, 3)})


def restore_in_fresh_process(ckdir: Path, torch_sees: str) -> dict[str, Any]:
    done = subprocess.run([sys.executable, "-c", RESTORE_ON_CUDA, str(ckdir), torch_sees],
                          capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode == 0, done.stderr
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def test_a_fresh_kernel_restores_gpu_tensors_onto_its_cuda_device(
    ckdir: Path, monkeypatch: Any
) -> None:
    gpu_checkpoint(ckdir, monkeypatch)
    seen = restore_in_fresh_process(ckdir, "cuda")
    # The device is asked after torch is loaded, so it is the GPU, not the host.
    assert seen["targets"] == ["cuda:0"]
    assert seen["moved_to_cpu"] == 0
    assert seen["restored"] == ["w"] and seen["values"] == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]


def test_a_fresh_kernel_without_cuda_keeps_gpu_tensors_on_the_host_and_says_so(
    ckdir: Path, monkeypatch: Any
) -> None:
    gpu_checkpoint(ckdir, monkeypatch)
    seen = restore_in_fresh_process(ckdir, "cpu")
    assert seen["targets"] == [] and seen["moved_to_cpu"] == 24
    assert seen["values"] == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]


# A checkpoint whose compressed blob (written in a syncing thread) cannot be written: run in a
# process of its own, whose file size limit makes the write fail as a full disk would.
FAILED_WRITE = """
import resource, signal, sys, numpy
from jupyter_gpufrac.kernel.checkpoint import Checkpointer, CheckpointError
ck = Checkpointer(sys.argv[1])
ns = {"__name__": "__main__", "small": [1, 2, 3]}
ck.take(ns)
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
ns["ids"] = numpy.arange(4_000_000)  # 32 MB that zlib shrinks, but not below 1 MiB
soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, hard))
try:
    ck.take(ns)
    print("taken")
except CheckpointError as exc:
    print("refused:", exc)
resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
back = {}
Checkpointer(sys.argv[1]).load(back)
print(sorted(k for k in back if not k.startswith("__")))
print(ck.take(ns).names)
"""


def test_a_compressed_blob_that_cannot_be_written_fails_the_checkpoint_not_the_last(
        tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-c", FAILED_WRITE, str(tmp_path / "ck")], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    refused, restored, again = done.stdout.splitlines()
    assert refused.startswith("refused: writing the checkpoint") and "File too large" in refused
    assert restored == "['small']"  # the last good checkpoint, whole
    assert again == "['ids', 'small']"  # and the next one, with room again, has everything
