"""The Makefile's entry points on a fresh machine: only `make test` needs npm (the hub's proxy)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def planned(target: str, venv: Path) -> str:
    """What ``make target`` would run with no virtualenv yet (dry run, nothing executed)."""
    done = subprocess.run(["make", "-n", target, f"VENV={venv}"], cwd=REPO, capture_output=True,
                          text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_lab_and_demo_need_no_npm_and_test_gets_the_hubs_proxy(tmp_path: Path) -> None:
    venv = tmp_path / "fresh-venv"
    for target in ("lab", "demo"):
        plan = planned(target, venv)
        assert "pip install --quiet torch==2.13.0" in plan, plan  # it does build the venv
        assert not re.search(r"^\s*npm\b", plan, re.MULTILINE), plan
    test = planned("test", venv)
    assert re.search(r"^\s*npm install\b.*configurable-http-proxy", test, re.MULTILINE), test
