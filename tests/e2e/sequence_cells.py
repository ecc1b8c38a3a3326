"""The cells a randomized sequence runs, and the fingerprint that compares two kernels' state."""

from __future__ import annotations

# Each mutation is self-contained (it works in a fresh kernel too, after a restart) and uses
# every kind of state a notebook has: random draws, in-place tensors, aliases, a model with
# its optimizer, cell classes and functions, NumPy generators, inference tensors.
MUTATIONS = [
    "import random\nxs = globals().setdefault('xs', [])\nxs.append(random.random())\nsame_xs = xs",
    "import torch\nt = globals().get('t', torch.zeros(4))\nt.add_(torch.rand(4))\nalias = t",
    (
        "import torch\n"
        "if 'model' not in globals():\n"
        "    model = torch.nn.Linear(4, 2)\n"
        "    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)\n"
        "opt.zero_grad()\n"
        "model(torch.randn(3, 4)).pow(2).sum().backward()\n"
        "opt.step()"
    ),
    (
        "class Acc:\n"
        "    def __init__(self):\n"
        "        self.items = []\n"
        "    def add(self, v):\n"
        "        self.items.append(v)\n"
        "        return len(self.items)\n"
        "acc = globals().get('acc') or Acc()\n"
        "acc.add(len(globals().get('xs', [])))\n"
        "triple = lambda v: 3 * v"
    ),
    (
        "import numpy as np\n"
        "gen = globals().setdefault('gen', np.random.default_rng(7))\n"
        "arr = gen.random(3) + np.random.rand(3)"
    ),
    "import torch\nwith torch.inference_mode():\n    inf = torch.ones(3) * len(globals().get('xs', []))",
    "globals().pop('alias', None)\nglobals().pop('arr', None)",
]

# What a cut-off cell does before it blocks: a half-done change that must not survive.
CUT_OFF = "xs = globals().setdefault('xs', [])\nxs.append('partial')\nimport time\ntime.sleep(600)"
CUT_OFF_DONE = "xs = globals().setdefault('xs', [])\nxs.append('partial')"

# Memory above the request, for a reclaim. The simulated node counts what a process holds
# above its size when the agent (re)adopted it: enough to burst even right after an agent
# restart, when the kernel's earlier imports no longer count.
BURST = "import torch\nbig = torch.ones(900 * 2**20 // 4)"
UNBURST = "globals().pop('big', None)\nimport gc\ngc.collect()"

# Prints one line: a canonical description of the user's state. It consumes no random draws
# (generator states are hashed) and leaves no names behind.
FINGERPRINT = r'''
def _fp():
    import hashlib, json, random, sys, types
    def h(b):
        return hashlib.sha256(b).hexdigest()[:16]
    torch = sys.modules.get("torch")
    np = sys.modules.get("numpy")
    out = {}
    ns = globals()
    for name in sorted(ns):
        if name.startswith("_") or name in ("In", "Out", "get_ipython", "exit", "quit", "open"):
            continue
        v = ns[name]
        if isinstance(v, types.ModuleType):
            out[name] = "module " + v.__name__
        elif torch is not None and isinstance(v, torch.Tensor):
            out[name] = "tensor %s %s %s" % (v.dtype, tuple(v.shape), h(repr(v.tolist()).encode()))
        elif torch is not None and isinstance(v, torch.nn.Module):
            out[name] = "module-state " + h(repr({k: t.tolist() for k, t in v.state_dict().items()}).encode())
        elif torch is not None and isinstance(v, torch.optim.Optimizer):
            state = [(k, {s: (t.tolist() if hasattr(t, "tolist") else t) for s, t in st.items()})
                     for k, st in enumerate(v.state.values())]
            out[name] = "optimizer " + h(repr(state).encode())
        elif np is not None and isinstance(v, np.ndarray):
            out[name] = "ndarray " + h(v.tobytes())
        elif np is not None and isinstance(v, np.random.Generator):
            out[name] = "generator " + h(repr(v.bit_generator.state).encode())
        elif isinstance(v, type):
            out[name] = "class " + v.__name__
        elif callable(v):
            out[name] = "callable %r" % (v(2),)
        elif hasattr(v, "__dict__"):
            out[name] = "%s %r" % (type(v).__name__, sorted(vars(v).items()))
        else:
            out[name] = repr(v)
    ids = {}
    if "xs" in ns and "same_xs" in ns:
        ids["xs is same_xs"] = ns["xs"] is ns["same_xs"]
    if "t" in ns and "alias" in ns:
        ids["t is alias"] = ns["t"] is ns["alias"]
    if "model" in ns and "opt" in ns:
        ids["opt has model's params"] = ns["opt"].param_groups[0]["params"][0] is ns["model"].weight
    if "acc" in ns and "Acc" in ns:
        ids["acc is an Acc"] = isinstance(ns["acc"], ns["Acc"])
    out["~ids"] = ids
    rng = {"python": h(repr(random.getstate()).encode())}
    if np is not None:
        rng["numpy"] = h(repr(np.random.get_state()[1].tolist()).encode())
    if torch is not None:
        rng["torch"] = h(bytes(torch.get_rng_state().tolist()))
    out["~rng"] = rng
    print("FINGERPRINT " + json.dumps(out, sort_keys=True))
_fp()
del _fp
'''


def fingerprint(output: str) -> str:
    """The FINGERPRINT line of a cell's output (a restore message may come before it)."""
    return next(line for line in output.splitlines() if line.startswith("FINGERPRINT "))
