"""The frontend's pure rules pass their own tests under Node, and no two of its modules import each other."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

LABEXT = Path(__file__).resolve().parent.parent / "labextension"


def test_widget_rules() -> None:
    npm = shutil.which("npm")
    if npm is None or not (LABEXT / "node_modules" / "typescript").is_dir():
        if os.environ.get("CI"):
            pytest.fail("npm and labextension/node_modules are needed: the install builds them")
        pytest.skip("run `cd labextension && npm install` first")
    done = subprocess.run([npm, "test"], cwd=LABEXT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "# fail 0" in done.stdout


# `import … from './x'`, `export … from './x'` and `import './x'`: the module's own imports.
_TS_IMPORT = re.compile(r"""\b(?:from|import)\s*['"](\.{1,2}/[^'"]+)['"]""")


def _imports(source: Path) -> set[Path]:
    found: set[Path] = set()
    for target in _TS_IMPORT.findall(source.read_text()):
        module = (source.parent / target).resolve()
        found.add(module if module.suffix == ".ts" else module.parent / f"{module.name}.ts")
    return found


def test_no_two_modules_import_each_other() -> None:
    """A cycle, direct or through others, makes the load order decide what is still undefined."""
    src = LABEXT / "src"
    graph = {path.resolve(): _imports(path) for path in src.rglob("*.ts")}
    cycles: list[list[Path]] = []
    done: set[Path] = set()

    def visit(module: Path, trail: list[Path]) -> None:
        if module in trail:
            cycles.append([*trail[trail.index(module):], module])
            return
        if module in done or module not in graph:
            return
        for target in sorted(graph[module]):
            visit(target, [*trail, module])
        done.add(module)

    for module in sorted(graph):
        visit(module, [])
    assert not cycles, "\n".join(
        " -> ".join(str(m.relative_to(src)) for m in cycle) for cycle in cycles)
