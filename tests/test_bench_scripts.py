"""The benchmark scripts still import what they use: they run outside pytest, so nothing else notices."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

BENCH = sorted((Path(__file__).parents[1] / "bench").glob("*.py"))


def test_there_are_benchmarks() -> None:
    assert {p.name for p in BENCH} >= {"agent_bench.py", "checkpoint_bench.py", "migration_bench.py"}


@pytest.mark.parametrize("script", BENCH, ids=lambda p: p.name)
def test_bench_script_imports(script: Path) -> None:
    spec = importlib.util.spec_from_file_location(f"bench_{script.stem}", script)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # runs imports and definitions; main() stays behind __main__
