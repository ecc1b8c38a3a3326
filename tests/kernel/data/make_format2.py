"""Writes tests/kernel/data/format2/ with the checkpoint code of commit FORMAT2_COMMIT (format 2).

Run from the repository root: python tests/kernel/data/make_format2.py
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

FORMAT2_COMMIT = "1263b51f38663acd04cc87c9e9f75ce50df58cde"  # the last commit writing format 2
HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]

# Run by the old code in a process of its own; what a notebook holds, as cells would define it.
WRITER = r'''
import json, random, sys
import numpy, torch
import jupyter_gpufrac
from jupyter_gpufrac.kernel import pickling
from jupyter_gpufrac.kernel.checkpoint import FORMAT, Checkpointer

assert jupyter_gpufrac.__file__.startswith(sys.argv[2]), jupyter_gpufrac.__file__
assert FORMAT == 2, FORMAT
CELL = """
import random
import numpy, torch
torch.manual_seed(0)
class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 3)
    def forward(self, x):
        return self.fc(x) * scale
scale = 2.0
model = Net()
opt = torch.optim.Adam(model.parameters(), lr=0.1)
model(torch.ones(2, 4)).sum().backward()
opt.step()
weights = torch.arange(12, dtype=torch.float32).reshape(3, 4)
row = weights[1]
leaf = torch.ones(3, requires_grad=True)
(leaf * 2).sum().backward()
with torch.inference_mode():
    frozen = torch.full((2,), 7.0)
on_gpu = torch.arange(6, dtype=torch.float64).reshape(2, 3)
storage = torch.arange(4, dtype=torch.int32).untyped_storage()
table = numpy.arange(40_000, dtype=numpy.int64).reshape(200, 200)
small = numpy.linspace(0.0, 1.0, 5)
items = [1, 2, [3]]
alias = items
config = {"lr": 0.1, "name": "run"}
square = lambda v: v * v
def uses_scale():
    return scale
random.seed(5)
numpy.random.seed(5)
"""
ns = {"__name__": "__main__"}
exec(compile(CELL, "<cell>", "exec"), ns)
# A CUDA kernel's checkpoint records its tensors' device as cuda: this one's is.
gpu_storage = ns["on_gpu"].untyped_storage().data_ptr()
record_for = pickling.BlobWriter.record_for

def on_cuda(self, tensor):
    blob, nbytes, device = record_for(self, tensor)
    if tensor.untyped_storage().data_ptr() != gpu_storage:
        return blob, nbytes, device
    self.reached[blob] = (nbytes, "cuda")  # what the group's header lists as GPU memory
    return blob, nbytes, "cuda"

pickling.BlobWriter.record_for = on_cuda
Checkpointer(sys.argv[1]).take(ns, execution_count=7)
expected = {
    "model_output": ns["model"](torch.ones(1, 4)).tolist(),
    "exp_avg": ns["opt"].state[ns["model"].fc.weight]["exp_avg"].tolist(),
    # What the notebook would have drawn next: a restore must continue with the same numbers.
    "random": random.random(), "numpy": float(numpy.random.rand()), "torch": float(torch.rand(1)),
}
print(json.dumps(expected))
'''


def main() -> None:
    out = HERE / "format2"
    with tempfile.TemporaryDirectory() as tmp:
        old = Path(tmp) / "old"
        old.mkdir()
        archive = subprocess.run(["git", "archive", FORMAT2_COMMIT, "jupyter_gpufrac"], cwd=REPO,
                                 check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(old)], input=archive, check=True)
        ckdir = Path(tmp) / "checkpoint"
        done = subprocess.run([sys.executable, "-c", WRITER, str(ckdir), str(old)], check=True,
                              capture_output=True, text=True, cwd=tmp,
                              env={**os.environ, "PYTHONPATH": str(old)})
        shutil.rmtree(out, ignore_errors=True)
        shutil.copytree(ckdir, out / "checkpoint")
        (out / "expected.json").write_text(done.stdout.strip().splitlines()[-1] + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
