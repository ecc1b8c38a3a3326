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
    # A view shares its base's storage; a dict holds the same list and view, not copies.
    (
        "import torch\nt = globals().get('t', torch.zeros(4))\ntv = t[1:3]\n"
        "holder = {'xs': globals().setdefault('xs', []), 'tv': tv}"
    ),
    # A closure over a cell variable, and a function that reads a global when called.
    (
        "def count_xs():\n    return len(globals().get('xs', []))\n"
        "def make_scaler(k):\n    def scale(v):\n        return k * v + count_xs()\n    return scale\n"
        "scale3 = make_scaler(3)"
    ),
    "globals().pop('alias', None)\nglobals().pop('arr', None)\nglobals().pop('tv', None)",
]

# What a cut-off cell does before it blocks: a half-done change that must not survive.
CUT_OFF = "xs = globals().setdefault('xs', [])\nxs.append('partial')\nimport time\ntime.sleep(600)"
CUT_OFF_DONE = "xs = globals().setdefault('xs', [])\nxs.append('partial')"
# A cell that a move catches running but that ends well within the grace period (1 s).
FINISHES = "import time\ntime.sleep(0.2)\nxs = globals().setdefault('xs', [])\nxs.append('finished')"

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
    def tensor(v):
        data = v.detach().cpu().contiguous()
        try:
            raw = data.numpy().tobytes()
        except (TypeError, RuntimeError):
            raw = repr(data.tolist()).encode()
        grad = None if v.grad is None else tensor(v.grad)
        # Small ones also in full, so that a failure shows what differs.
        shown = repr(data.tolist()) + " " if data.numel() <= 8 else ""
        return "tensor %s %s grad=%s inference=%s %s gradval=%s" % (
            v.dtype, tuple(v.shape), v.requires_grad, v.is_inference(),
            shown + h(raw), grad)
    def called(v, depth=0):
        try:
            r = v(2)
        except Exception as err:
            return "raises %s" % type(err).__name__
        if callable(r) and depth < 2:
            return "callable->" + called(r, depth + 1)
        return repr(r)
    out = {}
    ns = globals()
    for name in sorted(ns):
        if name.startswith("_") or name in ("In", "Out", "get_ipython", "exit", "quit", "open"):
            continue
        v = ns[name]
        if isinstance(v, types.ModuleType):
            out[name] = "module " + v.__name__
        elif torch is not None and isinstance(v, torch.Tensor):
            out[name] = tensor(v)
        elif torch is not None and isinstance(v, torch.nn.Module):
            out[name] = "module-state training=%s %r" % (
                v.training, [(k, tensor(p)) for k, p in v.named_parameters()]
                + [(k, tensor(b)) for k, b in v.named_buffers()])
        elif torch is not None and isinstance(v, torch.optim.Optimizer):
            groups = [{k: g[k] for k in sorted(g) if k != "params"} for g in v.param_groups]
            state = [(k, {s: (tensor(t) if isinstance(t, torch.Tensor) else t)
                          for s, t in sorted(st.items())})
                     for k, st in enumerate(v.state.values())]
            out[name] = "optimizer %s %s" % (h(repr(groups).encode()), h(repr(state).encode()))
        elif np is not None and isinstance(v, np.ndarray):
            out[name] = "ndarray %s %s %s" % (v.dtype, v.shape, h(v.tobytes()))
        elif np is not None and isinstance(v, np.random.Generator):
            out[name] = "generator " + h(repr(v.bit_generator.state).encode())
        elif isinstance(v, type):
            out[name] = "class %s %r" % (v.__name__, sorted(k for k in vars(v) if not k.startswith("__")))
        elif callable(v):
            out[name] = "callable " + called(v)
        elif hasattr(v, "__dict__"):
            out[name] = "%s %r" % (type(v).__name__, sorted(vars(v).items()))
        elif isinstance(v, dict):
            out[name] = "dict %r" % sorted((k, tensor(x) if torch is not None and isinstance(x, torch.Tensor)
                                            else repr(x)) for k, x in v.items())
        else:
            out[name] = repr(v)
    ids = {}
    def same(label, a, b):
        if a in ns and b in ns:
            ids[label] = ns[a] is ns[b]
    same("xs is same_xs", "xs", "same_xs")
    same("t is alias", "t", "alias")
    if "model" in ns and "opt" in ns:
        ids["opt has model's params"] = [p is q for p, q in zip(
            ns["opt"].param_groups[0]["params"], ns["model"].parameters())]
        ids["opt state keyed by model's params"] = [p in ns["opt"].state for p in ns["model"].parameters()]
    if "acc" in ns and "Acc" in ns:
        ids["acc is an Acc"] = isinstance(ns["acc"], ns["Acc"])
        ids["Acc().add(1)"] = ns["Acc"]().add(1)
    if "t" in ns and "tv" in ns:
        ids["tv views t"] = (ns["tv"].untyped_storage().data_ptr()
                             == ns["t"].untyped_storage().data_ptr())
    if "holder" in ns:
        ids["holder's xs is xs"] = ns["holder"]["xs"] is ns.get("xs")
        ids["holder's tv is tv"] = ns["holder"]["tv"] is ns.get("tv")
        if "t" in ns:
            ids["holder's tv views t"] = (ns["holder"]["tv"].untyped_storage().data_ptr()
                                          == ns["t"].untyped_storage().data_ptr())
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
