"""The widget's pure rules (labextension/src/view.ts) pass their own tests under Node."""

from __future__ import annotations

import os
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
