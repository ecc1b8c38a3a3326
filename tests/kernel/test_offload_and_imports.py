"""Offload bookkeeping, the after-import hook, and the layer rule (no jupyter_server)."""

from __future__ import annotations

import importlib
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import torch

from jupyter_gpufrac.kernel import offload
from jupyter_gpufrac.kernel.import_hook import after_import

from .kernels import REPO


def on_cpu(tensor: Any) -> bool:
    # Without a GPU, CPU tensors stand in for "on the device" to exercise the bookkeeping.
    return bool(tensor.device.type == "cpu")


def test_offload_moves_modules_in_place_and_reload_restores_them() -> None:
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    ns: dict[str, Any] = {"model": model, "opt": opt, "t": torch.ones(4), "n": 3,
                          "_hidden": torch.ones(1)}
    moved = offload.offload(ns, host="cpu", on_gpu=on_cpu)
    assert [(r.name, r.kind) for r in moved] == [
        ("model", "module"), ("opt", "optimizer"), ("t", "tensor")]
    assert ns["model"] is model  # identity kept: the optimizer still holds its parameters
    assert moved[0].nbytes == (3 * 2 + 2) * 4
    ns["t"] = torch.zeros(1)  # rebound by the user: forgotten, not moved back
    back, left = offload.reload(ns, moved, budget=(3 * 2 + 2) * 4)
    assert [r.name for r in back] == ["model"] and [r.name for r in left] == ["opt"]
    back, left = offload.reload(ns, left, budget=None)
    assert [r.name for r in back] == ["opt"] and left == []


class StandInDevice:
    """Without a GPU, a set of CPU tensors stands in for "on the device": copies are not in it."""

    def __init__(self, *tensors: torch.Tensor) -> None:
        self.ids = {id(t) for t in tensors}

    def __call__(self, tensor: Any) -> bool:
        return id(tensor) in self.ids

    def bytes_reachable(self, ns: dict[str, Any]) -> int:
        """Bytes of device tensors the namespace still reaches: names, containers, Out."""
        seen: dict[int, int] = {}

        def visit(value: Any) -> None:
            if isinstance(value, torch.Tensor) and self(value):
                seen[id(value)] = value.numel() * value.element_size()
            elif isinstance(value, list | tuple):
                for item in value:
                    visit(item)
            elif isinstance(value, dict):
                for item in value.values():
                    visit(item)

        visit(ns)
        return sum(seen.values())


def test_offload_frees_what_output_caches_and_containers_hold() -> None:
    shown, kept, other = torch.ones(256), torch.ones(128), torch.ones(64)
    device = StandInDevice(shown, kept, other)
    ns: dict[str, Any] = {
        "kept": kept, "batch": [kept, other, 3], "named": {"w": kept}, "pair": (kept, "label"),
        "Out": {4: shown}, "_": shown, "_4": shown,
    }
    assert device.bytes_reachable(ns) == (256 + 128 + 64) * 4
    moved = offload.offload(ns, host="cpu", on_gpu=device)
    assert {r.name: r.kind for r in moved} == {
        "kept": "tensor", "batch": "container", "named": "container", "pair": "container",
        "Out": "output cache"}
    # Nothing the notebook reaches holds device memory now, and usage can fall to the request.
    assert device.bytes_reachable(ns) == 0
    # Aliases of one tensor are one tensor on the host too.
    assert ns["batch"][0] is ns["kept"] is ns["named"]["w"] is ns["pair"][0]
    assert ns["_"] is ns["_4"] is ns["Out"][4] and ns["pair"][1] == "label"
    assert next(r for r in moved if r.kind == "output cache").nbytes == 256 * 4
    back, left = offload.reload(ns, moved, budget=None)
    # Shown outputs are history and stay on the host; the user's variables come back.
    assert {r.name for r in back} == {"kept", "batch", "named", "pair"} and left == []


def test_the_after_import_callback_sees_the_finished_module_once(tmp_path: Path) -> None:
    (tmp_path / "gpufrac_probe_pkg").mkdir()
    (tmp_path / "gpufrac_probe_pkg" / "__init__.py").write_text("VALUE = 41\nVALUE += 1\n")
    seen: list[int] = []
    sys.path.insert(0, str(tmp_path))
    off = after_import("gpufrac_probe_pkg", lambda m: seen.append(m.VALUE))
    try:
        import gpufrac_probe_pkg  # type: ignore[import-not-found]

        importlib.reload(gpufrac_probe_pkg)
        assert seen == [42], "after the module body ran, and once"
        late: list[int] = []
        after_import("gpufrac_probe_pkg", lambda m: late.append(m.VALUE))
        assert late == [42], "a module imported already: at once"
    finally:
        off()
        sys.path.remove(str(tmp_path))
        sys.modules.pop("gpufrac_probe_pkg", None)


def test_failing_or_turned_off_callbacks_never_break_the_import(tmp_path: Path) -> None:
    (tmp_path / "gpufrac_probe_bad.py").write_text("X = 1\n")
    (tmp_path / "gpufrac_probe_off.py").write_text("X = 2\n")

    def boom(module: Any) -> None:
        raise RuntimeError("callback failure")

    called: list[str] = []
    sys.path.insert(0, str(tmp_path))
    after_import("gpufrac_probe_bad", boom)
    after_import("gpufrac_probe_off", lambda m: called.append(m.__name__))()
    try:
        import gpufrac_probe_bad  # type: ignore[import-not-found]
        import gpufrac_probe_off  # type: ignore[import-not-found]

        assert (gpufrac_probe_bad.X, gpufrac_probe_off.X, called) == (1, 2, [])
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("gpufrac_probe_bad", None)
        sys.modules.pop("gpufrac_probe_off", None)


def test_the_kernel_package_imports_neither_jupyter_server_nor_torch() -> None:
    code = textwrap.dedent("""
        import sys
        import jupyter_gpufrac.kernel, jupyter_gpufrac.kernel.hook, jupyter_gpufrac.kernel.magics
        bad = sorted(m for m in sys.modules
                     if m.split(".")[0] in ("jupyter_server", "torch", "tornado"))
        print(bad)
    """)
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                          text=True, timeout=60, check=True)
    assert done.stdout.strip() == "[]"
