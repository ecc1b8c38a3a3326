"""On a real GPU: the cap, the context, UUIDs, NVML's view of a kernel, restores onto CUDA.

``pytest -m gpu`` runs these where CUDA is; elsewhere they skip (``make test`` runs them too).
Each check runs in a fresh process: a cap or a CUDA context must not leak into pytest's own.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from harness.agent import AgentProcess, nvml_works, wait_for

pytestmark = pytest.mark.gpu

MiB, GiB = 2**20, 2**30


def _cuda_devices() -> int:
    probe = "import torch\nprint(torch.cuda.device_count() if torch.cuda.is_available() else 0)"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          timeout=120)
    return int(done.stdout.strip() or 0) if done.returncode == 0 else 0


DEVICES = _cuda_devices()
if not DEVICES:
    pytest.skip("no CUDA device here", allow_module_level=True)


def _python(code: str, **env: str) -> dict[str, object]:
    """Run ``code`` in a fresh interpreter; it prints one JSON line, returned."""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, env={**os.environ, **env})
    assert done.returncode == 0, done.stderr[-3000:]
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def _uuids() -> list[str]:
    code = ("import json, torch\nprint(json.dumps({'uuids': ['GPU-' + str(torch.cuda."
            "get_device_properties(i).uuid) for i in range(torch.cuda.device_count())]}))")
    return [str(u) for u in _python(code)["uuids"]]  # type: ignore[union-attr]


def test_uuid_visibility_selects_the_leased_gpu() -> None:
    last = _uuids()[-1]
    seen = _python("import json, torch\nprint(json.dumps({'count': torch.cuda.device_count(), "
                   "'uuid': 'GPU-' + str(torch.cuda.get_device_properties(0).uuid)}))",
                   CUDA_VISIBLE_DEVICES=last)
    assert seen == {"count": 1, "uuid": last}


def test_the_cap_stops_an_allocation_above_the_limit_and_says_whose_it_is() -> None:
    code = f"""
import json, torch
from jupyter_gpufrac.kernel import messages, torch_adapter
total = torch_adapter.device_total()
torch_adapter.set_memory_cap({GiB}, total)
ok = torch.empty({GiB // 2}, dtype=torch.uint8, device="cuda")
try:
    torch.empty({2 * GiB}, dtype=torch.uint8, device="cuda")
    result = "allocated"
except torch.OutOfMemoryError as err:
    result = messages.oom_cause(wanted=messages.oom_wanted(err),
                                reserved=torch_adapter.reserved_bytes(), cap={GiB},
                                gpu_free=torch_adapter.free_bytes())
print(json.dumps({{"result": result}}))
"""
    assert str(_python(code)["result"]).startswith("This kernel reached its own cap")


def test_a_cuda_context_is_what_the_simulation_assumes_it_is(tmp_path: Path) -> None:
    """NVML's figure for a process minus its allocator's reserve: the context, measured."""
    code = """
import json, os, time, torch, pynvml
torch.empty(1, device="cuda")
torch.cuda.synchronize()
pynvml.nvmlInit()
uuid = "GPU-" + str(torch.cuda.get_device_properties(0).uuid)
handle = pynvml.nvmlDeviceGetHandleByUUID(uuid)
used = next(p.usedGpuMemory for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
            if p.pid == os.getpid())
print(json.dumps({"context": used - torch.cuda.memory_reserved()}))
"""
    context = int(_python(code)["context"])  # type: ignore[arg-type]
    print(f"measured CUDA context: {context / MiB:.0f} MiB (the agent's estimate: 500 MiB)")
    assert 64 * MiB < context < 2 * GiB


def test_a_checkpoint_restores_onto_the_gpu(tmp_path: Path) -> None:
    target = _uuids()[-1]
    save = f"""
import json, torch
from jupyter_gpufrac.kernel.checkpoint import Checkpointer
ns = {{"w": torch.arange(1000.0, device="cuda"), "cpu": torch.ones(3)}}
Checkpointer({str(tmp_path)!r}).take(ns)
print(json.dumps({{"ok": True}}))
"""
    load = f"""
import json, torch
from jupyter_gpufrac.kernel.checkpoint import Checkpointer
ns = {{}}
Checkpointer({str(tmp_path)!r}).load(ns)
print(json.dumps({{"w": str(ns["w"].device), "cpu": str(ns["cpu"].device),
                  "sum": float(ns["w"].sum())}}))
"""
    _python(save, CUDA_VISIBLE_DEVICES=_uuids()[0])
    # On another GPU where there is one: a move; else the same GPU in a new process.
    assert _python(load, CUDA_VISIBLE_DEVICES=target) == {
        "w": "cuda:0", "cpu": "cpu", "sum": float(sum(range(1000)))}


def test_a_restore_streams_every_tensor_onto_the_gpu_bit_for_bit_with_its_sharing(
    tmp_path: Path,
) -> None:
    """Through the ring of pinned buffers (chunks smaller than the tensors), onto the device,
    never first in pageable host memory; views, aliases and storages shared across variables
    as they were (issue 35)."""
    save = f"""
import json, torch
from jupyter_gpufrac.kernel.checkpoint import Checkpointer
g = torch.Generator(device="cuda").manual_seed(3)
base = torch.randint(0, 256, (64 * 2**20 + 12,), dtype=torch.uint8, device="cuda",
                     generator=g).view(torch.float32)  # NaN payloads, -0.0, denormals
model = torch.nn.Linear(256, 128).cuda()
ns = {{"base": base, "view": base[100:5000].view(70, 70), "alias": base,
       "strided": [base[::7]], "model": model, "half": torch.randn(999, device="cuda").half(),
       "host": torch.arange(10.0)}}
Checkpointer({str(tmp_path)!r}).take(ns)
torch.save({{k: ns[k] for k in ("base", "half")}}, {str(tmp_path / "expected.pt")!r})
print(json.dumps({{"ok": True}}))
"""
    load = f"""
import json, torch
from jupyter_gpufrac.kernel import stream
from jupyter_gpufrac.kernel.checkpoint import Checkpointer
stream.CHUNK = 4 * 2**20
stream._ring = stream.Ring(count=3, chunk=4 * 2**20)
made_on_host = []
empty = torch.empty
def watching(*args, device=None, **kwargs):
    if device in (None, "cpu") and args and isinstance(args[0], int) and args[0] >= 2**20:
        made_on_host.append(args[0])
    return empty(*args, device=device, **kwargs)
torch.empty = watching
ns = {{}}
result = Checkpointer({str(tmp_path)!r}).load(ns)
torch.empty = empty
expected = torch.load({str(tmp_path / "expected.pt")!r})
same = lambda a, b: bool(torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)))
base = ns["base"]
print(json.dumps({{
    "lost": result.lost, "pinned": stream._ring.pinned,
    "devices": sorted({{str(ns[k].device) for k in ("base", "view", "half")}}),
    "bits": same(base, expected["base"]) and same(ns["half"], expected["half"]),
    "view": ns["view"].untyped_storage().data_ptr() == base.untyped_storage().data_ptr()
            and same(ns["view"], base[100:5000].view(70, 70)),
    "strided": ns["strided"][0].untyped_storage().data_ptr() == base.untyped_storage().data_ptr(),
    "alias": ns["alias"] is base, "host": str(ns["host"].device),
    "model": str(next(ns["model"].parameters()).device),
    "made_on_host": made_on_host}}))
"""
    _python(save, CUDA_VISIBLE_DEVICES=_uuids()[0])
    seen = _python(load, CUDA_VISIBLE_DEVICES=_uuids()[-1])
    assert seen["lost"] == {} and seen["pinned"] is True
    assert seen["devices"] == ["cuda:0"] and seen["model"] == "cuda:0" and seen["host"] == "cpu"
    assert seen["bits"] and seen["view"] and seen["strided"] and seen["alias"]
    assert seen["made_on_host"] == [], "a GPU tensor was first made in host memory"


def test_a_cells_gpu_tensors_are_held_then_copied_into_warm_staging_on_their_stream(
    tmp_path: Path,
) -> None:
    """The snapshot after a cell holds (first) or copies into warm pinned staging on the stream
    (later); either way the next in-place change never reaches the checkpoint (issue 35)."""
    code = f"""
import json, torch
from jupyter_gpufrac.kernel import stream
from jupyter_gpufrac.kernel.checkpoint import Checkpointer
t = torch.zeros(256 * 2**20, device="cuda")  # 1 GiB
ns = {{"t": t}}
ck = Checkpointer({str(tmp_path)!r})
held = []
for cell in range(1, 4):
    t.add_(1)
    job = ck.begin(ns, execution_count=cell)
    held.append([s.on_device for s in job.staged.values() if s.nbytes == 2**30])
    if cell > 1:
        t.add_(100)  # the next cell, at once: queued after the copy on the stream
    job.wait(120)
    ck.writer.flush()
    if cell > 1:
        t.sub_(100)
loaded = {{}}
Checkpointer({str(tmp_path)!r}).load(loaded)
print(json.dumps({{"held": held, "value": float(loaded["t"][0]), "pinned": stream.PINNED.kept}}))
"""
    seen = _python(code, CUDA_VISIBLE_DEVICES=_uuids()[0])
    assert seen["held"][0] == [True], "no warm buffer yet: held, not pinned in the cell"
    assert seen["held"][1] == [False] and seen["held"][2] == [False], "then warm staging"
    assert seen["value"] == 3.0  # the snapshot's, never the change queued after it
    assert seen["pinned"] >= 2**30


@pytest.mark.skipif(not nvml_works(), reason="NVML does not initialise")
def test_the_agent_measures_a_kernel_through_nvml(tmp_path: Path) -> None:
    with AgentProcess(tmp_path / "agent", None, ["--poll-interval", "0.2"]) as agent:
        c = agent.client()
        lease = c.create_lease(client="gpu-test", request="2Gi", limit="4Gi")
        holder = subprocess.Popen(
            [sys.executable, "-c", "import sys, torch\nx = torch.empty(2**30, dtype=torch.uint8, "
             "device='cuda')\nprint('ready', flush=True)\nsys.stdin.read()"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            env={**os.environ, "CUDA_VISIBLE_DEVICES": lease["physical_gpu"]})
        try:
            assert holder.stdout is not None and holder.stdout.readline().strip() == "ready"
            c.register_pid(lease["id"], holder.pid)
            wait_for(lambda: c.lease(lease["id"])["usage"] > GiB, 30, "NVML to see the kernel")
            gpu = next(g for g in c.node()["gpus"] if g["uuid"] == lease["physical_gpu"])
            assert [s["lease"] for s in gpu["shares"]] == [lease["id"]]
        finally:
            holder.kill()
            holder.wait()


def test_offload_frees_the_gpu_memory_a_notebook_holds_everywhere() -> None:
    """Tensors bound to names, kept in containers and in the output cache all leave the GPU:
    what the allocator holds falls back to (almost) nothing, and comes back on reload."""
    code = f"""
import gc, json, torch
from jupyter_gpufrac.kernel import offload
big = torch.empty({512 * MiB}, dtype=torch.uint8, device="cuda")
ns = {{"big": big, "pair": [big, torch.ones(3, device="cuda")],
      "Out": {{3: big}}, "_": big, "_3": big, "model": torch.nn.Linear(1024, 1024).cuda()}}
del big
before = torch.cuda.memory_allocated()
moved = offload.offload(ns)
gc.collect()
torch.cuda.empty_cache()
after = torch.cuda.memory_allocated()
back, left = offload.reload(ns, moved, None)
print(json.dumps({{"before": before, "after": after, "same": ns["pair"][0] is ns["big"],
                  "back": sorted(r.name for r in back), "left": len(left),
                  "device": str(ns["big"].device)}}))
"""
    seen = _python(code)
    assert int(seen["before"]) > 512 * MiB > 64 * MiB > int(seen["after"])  # type: ignore[arg-type]
    assert seen["same"] is True and seen["left"] == 0 and seen["device"] == "cuda:0"


def test_a_parked_process_gets_the_gpu_it_is_given_and_its_tensors_back() -> None:
    """A parked kernel starts with no GPU visible and CUDA untouched; pointing CUDA at a GPU
    before it initialises, in the same process, must reach that GPU and nothing else."""
    target = _uuids()[-1]
    code = f"""
import json, torch
from jupyter_gpufrac.kernel import offload, torch_adapter
torch_adapter.hold_cuda()
ns = {{"w": torch.arange(1000.0), "model": torch.nn.Linear(4, 2)}}  # restored to host memory
records = [offload.Offloaded("w", "tensor", "cuda:0", 4000, id(ns["w"])),
           offload.Offloaded("model", "module", "cuda:0", 40, id(ns["model"]))]
held = torch_adapter.cuda_available() or torch.cuda.is_initialized()
attached = torch_adapter.attach_cuda({target!r})
back, left = offload.reload(ns, records, None)
print(json.dumps({{"held": held, "attached": attached, "w": str(ns["w"].device),
                  "model": str(next(ns["model"].parameters()).device), "left": len(left),
                  "count": torch.cuda.device_count(),
                  "uuid": "GPU-" + str(torch.cuda.get_device_properties(0).uuid)}}))
"""
    seen = _python(code, CUDA_VISIBLE_DEVICES="", PYTORCH_NVML_BASED_CUDA_CHECK="1")
    assert seen == {"held": False, "attached": True, "w": "cuda:0", "model": "cuda:0",
                    "left": 0, "count": 1, "uuid": target}


@pytest.mark.skipif(not nvml_works(), reason="NVML does not initialise")
def test_a_notebook_reopened_on_another_server_resumes_its_cuda_tensors_and_generator(
        tmp_path: Path) -> None:
    """A server stopped with a grace, another one (its own folder, the same checkpoints) opening
    the notebook: the CUDA tensors back on the GPU and torch's CUDA generator drawing on exactly
    as it would have."""
    import signal

    from harness.jupyter import start_server, stop_server

    notebooks = tmp_path / "notebooks"
    notebooks.mkdir()
    config = (f"c.GpuFrac.checkpoint_dir = {str(tmp_path / 'checkpoints')!r}\n"
              "c.GpuFrac.spare_kernels = False\n")
    with AgentProcess(tmp_path / "agent", None) as agent:
        first = start_server(tmp_path / "first", agent.socket, config, root=notebooks)
        try:
            nb = first.open_notebook("cuda.ipynb")
            nb.ok("import torch\ntorch.cuda.manual_seed(5)\nw = torch.rand(1000, device='cuda')")
            expected = nb.ok(
                "saved = torch.cuda.get_rng_state()\nprint('NEXT', torch.rand(3, device='cuda')"
                ".tolist())\ntorch.cuda.set_rng_state(saved)\ndel saved").split("NEXT", 1)[1]
            nb.close()
            first.process.send_signal(signal.SIGTERM)
            first.process.wait(60)
        finally:
            stop_server(first)
        second = start_server(tmp_path / "second", agent.socket, config, root=notebooks)
        try:
            again = second.open_notebook("cuda.ipynb")
            output = again.ok("print('DEVICE', w.device, float(w.sum()) > 0)\n"
                              "print('NEXT', torch.rand(3, device='cuda').tolist())")
            assert "This notebook was resumed" in output, output
            assert "DEVICE cuda:0 True" in output, output
            assert output.split("NEXT", 1)[1].strip() == expected.strip(), output
        finally:
            stop_server(second)
