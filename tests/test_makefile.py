"""The Makefile's entry points on a fresh machine: only `make test` needs npm (the hub's proxy)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
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


def _ruff() -> str:
    ruff = Path(sys.executable).parent / "ruff"
    return str(ruff) if ruff.exists() else shutil.which("ruff") or "ruff"


@pytest.mark.skipif(shutil.which("make") is None or shutil.which("git") is None,
                    reason="make and git are needed")
def test_notebooks_made_in_the_lab_stay_out_of_git_and_the_lint(tmp_path: Path) -> None:
    """`make lab` serves a folder of its own: a notebook saved there (File → New → Notebook
    makes Untitled.ipynb) is neither in `git status` nor checked by `ruff check .`, so
    `make test` stays green after "Try it"."""
    plan = planned("lab", tmp_path / "fresh-venv")
    served = re.search(r"--ServerApp\.root_dir=(\S+)", plan)
    assert served, plan
    folder = REPO / served.group(1)
    assert folder.resolve() != REPO and REPO in folder.resolve().parents, folder
    # Its terminals find the venv's gpufrac-agent, as the README's commands are written.
    assert re.search(r'PATH="[^"]*fresh-venv/bin:\$PATH"', plan), plan
    made = not folder.exists()
    folder.mkdir(exist_ok=True)
    untitled = folder / f"Untitled-{os.getpid()}.ipynb"
    # What a first cell typed in a new notebook often is: unused imports, two statements.
    untitled.write_text(json.dumps({
        "cells": [{"cell_type": "code", "execution_count": None, "id": "a", "metadata": {},
                   "outputs": [], "source": "import os, sys\nx=1;y = 2\n"}],
        "metadata": {}, "nbformat": 4, "nbformat_minor": 5}))
    try:
        ignored = subprocess.run(["git", "status", "--porcelain", "--", str(untitled)], cwd=REPO,
                                 capture_output=True, text=True, timeout=60, check=True)
        assert ignored.stdout == "", ignored.stdout
        # The file alone fails the lint; in the Lab's folder the project's settings skip it.
        alone = subprocess.run([_ruff(), "check", "--isolated", str(untitled)], cwd=REPO,
                               capture_output=True, text=True, timeout=60, check=False)
        assert alone.returncode == 1, alone.stdout
        lint = subprocess.run([_ruff(), "check", "--force-exclude", str(untitled)], cwd=REPO,
                              capture_output=True, text=True, timeout=60, check=False)
        assert lint.returncode == 0, lint.stdout
    finally:
        untitled.unlink()
        if made:
            folder.rmdir()
