"""Which names of the notebook namespace are user state worth checkpointing (pure)."""

from __future__ import annotations

import functools
import re
import types
from collections.abc import Mapping
from dataclasses import dataclass, field

# IPython's bookkeeping: history (In/Out/_i7/_7), the display hook's _ __ ___, and helpers.
_IPYTHON_NAMES = frozenset(
    {
        "In", "Out", "_", "__", "___", "_i", "_ii", "_iii", "_ih", "_oh", "_dh", "_sh",
        "get_ipython", "exit", "quit", "_exit_code",
        "__builtins__", "__builtin__", "__name__", "__doc__", "__package__", "__loader__",
        "__spec__", "__file__", "__cached__", "__annotations__",
    }
)
_HISTORY = re.compile(r"^_(i|ii|iii|i\d+|\d+)$")


@functools.lru_cache(maxsize=4096)  # asked for every name at every checkpoint
def is_ipython_name(name: str) -> bool:
    """True for names IPython or the interpreter own (``__warningregistry__``), not the user."""
    dunder = len(name) > 4 and name.startswith("__") and name.endswith("__")
    return dunder or name in _IPYTHON_NAMES or bool(_HISTORY.match(name))


@dataclass
class Selection:
    """The split of a namespace: values to pickle, modules to re-import, names skipped."""

    values: dict[str, object] = field(default_factory=dict)
    modules: dict[str, str] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)


def select(ns: Mapping[str, object], hidden: Mapping[str, object] | None = None) -> Selection:
    """Pick the user's variables; modules are kept by name because re-importing beats pickling.

    ``hidden`` is IPython's ``user_ns_hidden``: what was there before the first cell; a name the
    user has since bound to another object is theirs (the rule IPython's ``%who`` uses).
    """
    hidden = hidden or {}
    missing = object()
    out = Selection()
    for name, value in ns.items():
        if not isinstance(name, str) or is_ipython_name(name):
            continue
        if hidden.get(name, missing) is value:
            continue
        if isinstance(value, types.ModuleType):
            module_name = getattr(value, "__name__", None)
            if isinstance(module_name, str) and module_name != "__main__":
                out.modules[name] = module_name
            else:
                out.skipped.append(name)
            continue
        out.values[name] = value
    return out

