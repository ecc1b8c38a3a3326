"""Random generator state (Python, NumPy, torch CPU and CUDA): a continued notebook draws the same."""

from __future__ import annotations

import importlib
import random
import sys
from typing import Any

from jupyter_gpufrac.kernel import tensor_io, torch_adapter


def capture() -> dict[str, Any]:
    """Snapshot every generator that is loaded; nothing is imported for it."""
    state: dict[str, Any] = {"python": random.getstate()}
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        state["numpy"] = numpy.random.get_state()
    torch = sys.modules.get("torch")
    if torch is not None:
        generator = torch.get_rng_state()  # held: the view below reads its memory
        state["torch"] = bytes(tensor_io.host_view(generator.untyped_storage()))
        cuda = torch_adapter.cuda_rng_states()
        if cuda is not None:
            state["cuda"] = cuda
    return state


def restore(state: dict[str, Any]) -> list[str]:
    """Put the generators back; returns which ones were restored."""
    done: list[str] = []
    if "python" in state:
        random.setstate(state["python"])
        done.append("python")
    if "numpy" in state:
        # The state came from a kernel where numpy was loaded; importing it is then expected.
        numpy: Any = importlib.import_module("numpy")
        numpy.random.set_state(state["numpy"])
        done.append("numpy")
    if "torch" in state:
        import torch

        torch.set_rng_state(torch.frombuffer(bytearray(state["torch"]), dtype=torch.uint8))
        done.append("torch")
    if "cuda" in state and torch_adapter.set_cuda_rng_states(state["cuda"]):
        done.append("cuda")
    return done
