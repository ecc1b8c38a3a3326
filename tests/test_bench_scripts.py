"""The benchmark scripts still import what they use: they run outside pytest, so nothing else notices."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest

BENCH = sorted((Path(__file__).parents[1] / "bench").glob("*.py"))


def test_there_are_benchmarks() -> None:
    assert {p.name for p in BENCH} >= {"agent_bench.py", "checkpoint_bench.py", "kishu_bench.py",
                                          "migration_bench.py", "oom_bench.py"}


@pytest.mark.parametrize("script", BENCH, ids=lambda p: p.name)
def test_bench_script_imports(script: Path) -> None:
    spec = importlib.util.spec_from_file_location(f"bench_{script.stem}", script)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # runs imports and definitions; main() stays behind __main__


# Names with a leading underscore that their library documents for public use: a forked
# child leaves with os._exit, never running its parent's exit handlers.
DOCUMENTED_UNDERSCORED = frozenset({"os._exit"})


@pytest.mark.parametrize("script", BENCH, ids=lambda p: p.name)
def test_bench_scripts_use_only_public_names_and_never_the_tests(script: Path) -> None:
    """What a benchmark measures must be what users run: public names, no test scaffolding."""
    tree = ast.parse(script.read_text())
    imported_modules = {alias.asname or alias.name for node in ast.walk(tree)
                        if isinstance(node, ast.Import) for alias in node.names}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            root = (node.module or "").split(".")[0]
            assert root not in ("tests", "support", "e2e", "conftest"), ast.unparse(node)
            assert not any(a.name.startswith("_") for a in node.names), ast.unparse(node)
        elif isinstance(node, ast.Import):
            assert all(a.name.split(".")[0] not in ("tests", "support") for a in node.names)
        elif (isinstance(node, ast.Attribute) and node.attr.startswith("_")
              and not node.attr.startswith("__") and isinstance(node.value, ast.Name)
              and node.value.id in imported_modules
              and ast.unparse(node) not in DOCUMENTED_UNDERSCORED):
            raise AssertionError(f"{script.name}:{node.lineno} uses the private {ast.unparse(node)}")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            assert node.value not in ("tests", "tests/"), f"{script.name}:{node.lineno} reaches into tests"
