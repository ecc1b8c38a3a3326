"""The packages a kernel imported, named in its checkpoint so a spare kernel can import them first."""

from __future__ import annotations

import sys
from collections.abc import Mapping
from types import ModuleType

# At most this many names are kept (a header is rewritten at every change; a kernel that
# imported more is still restored, the rest imported by the restore or the notebook).
MAX_IMPORTS = 200

_last: tuple[int, list[str]] = (-1, [])


def imports_now() -> list[str]:
    """:func:`top_level_imports` of this process, looked for again only once ``sys.modules``
    grew or shrank (asked at every checkpoint: a walk of thousands of modules costs 0.3 ms)."""
    global _last
    count = len(sys.modules)
    if _last[0] != count:
        _last = (count, top_level_imports())
    return list(_last[1])


def top_level_imports(modules: Mapping[str, ModuleType | None] | None = None) -> list[str]:
    """Top-level packages imported in this process, oldest first: not the standard library,
    not private ones, not ``__main__`` nor modules made at run time (no spec, or built in).
    Only names are recorded; whoever imports them again decides which may be (see
    :func:`jupyter_gpufrac.server.spares.importable`)."""
    found: list[str] = []
    stdlib = sys.stdlib_module_names
    for name, module in list((sys.modules if modules is None else modules).items()):
        if "." in name or name.startswith("_") or name in stdlib or module is None:
            continue
        spec = getattr(module, "__spec__", None)
        if spec is None or spec.origin in ("built-in", "frozen"):
            continue
        found.append(name)
        if len(found) >= MAX_IMPORTS:
            break
    return found
