"""Objects that imported modules hold come back as those modules' objects, not as copies
(issue 27, item 5): ``from scipy.stats import norm`` restores as ``scipy.stats.norm``, whose
random draws the global seed still reaches."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from jupyter_gpufrac.kernel.checkpoint import Checkpointer

from .kernels import REPO

SAVE = """
import json, sys
from jupyter_gpufrac.kernel.checkpoint import Checkpointer
ns = {"__name__": "__main__"}
exec(compile(sys.argv[2], "<cell>", "exec"), ns)
result = Checkpointer(sys.argv[1]).take(ns)
print(json.dumps({"lost": result.lost}))
"""

# Restores into a fresh namespace, then runs the probe cell, which leaves its findings in
# ``report``.
RESTORE = """
import json, sys
from jupyter_gpufrac.kernel.checkpoint import Checkpointer
ns = {"__name__": "__main__"}
result = Checkpointer(sys.argv[1]).load(ns)
exec(compile(sys.argv[2], "<probe>", "exec"), ns)
print(json.dumps({"restored": result.restored, "lost": result.lost, "report": ns["report"]}))
"""


def in_process(script: str, ckdir: Path, cell: str, path: Path | None = None) -> dict[str, Any]:
    """Run ``script`` in a new interpreter (as a kernel restarted after a kill would be)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [*([str(path)] if path else []), str(REPO), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-c", script, str(ckdir), cell], capture_output=True,
                          text=True, cwd=REPO, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def cell_ns(source: str) -> dict[str, Any]:
    ns: dict[str, Any] = {"__name__": "__main__"}
    exec(compile(source, "<cell>", "exec"), ns)
    return ns


def test_norm_restores_as_scipy_stats_norm_and_the_seed_reaches_it(ckdir: Path) -> None:
    saved = in_process(SAVE, ckdir, "from scipy.stats import norm\nimport numpy as np\n")
    assert saved["lost"] == {}
    got = in_process(RESTORE, ckdir, """
import scipy.stats
np.random.seed(0)
report = {"same": norm is scipy.stats.norm, "draws": [round(float(v), 2) for v in norm.rvs(size=3)]}
""")
    assert "norm" in got["restored"] and got["lost"] == {}
    assert got["report"] == {"same": True, "draws": [1.76, 0.40, 0.98]}


def test_module_singletons_keep_identity_at_the_top_and_nested(ckdir: Path) -> None:
    cell = """
import logging, os, sys
from scipy.stats import norm
root = logging.root
out = sys.stdout
env = os.environ
path = sys.path          # a plain list a module holds
also = {"path": path}    # shares it
holder = {"n": norm}     # a dict holding norm
class Keeper:            # a class of the notebook, pickled by value ...
    pass
keeper = Keeper()
keeper.log = logging.root  # ... whose attribute points at a module's object
"""
    assert in_process(SAVE, ckdir, cell)["lost"] == {}
    got = in_process(RESTORE, ckdir, """
import logging, os, sys, scipy.stats
report = {
    "root": root is logging.root, "out": out is sys.stdout, "env": env is os.environ,
    "path": path is sys.path, "also": also["path"] is sys.path,
    "holder": holder["n"] is scipy.stats.norm,
    "keeper": type(keeper) is Keeper and keeper.log is logging.root,
}
""")
    assert got["lost"] == {}
    assert got["report"] == dict.fromkeys(
        ["root", "out", "env", "path", "also", "holder", "keeper"], True)


def test_nothing_changed_stays_nothing_changed_after_draws(ckdir: Path) -> None:
    """``norm`` is fingerprinted by its name: a draw from NumPy's global generator (its state,
    which a copy of ``norm`` would carry) is no change of the notebook's variables."""
    import numpy as np

    ns = cell_ns("from scipy.stats import norm\nimport logging\nroot = logging.root\n"
                 "box = {'n': norm}\n")
    checkpointer = Checkpointer(ckdir)
    checkpointer.take(ns)
    np.random.rand(3)
    again = checkpointer.take(ns)
    assert again.groups_written == 0 and again.bytes_written == 0


MODULE = """
class Thing:
    def __init__(self, v):
        self.v = v
THING = Thing(1)
LATER = Thing(10)
"""


def test_a_name_rebound_in_its_module(tmp_path: Path, ckdir: Path) -> None:
    """The reference is to the name: at the restore, the object the module then holds under it
    comes back, if it is of the same class; of another class, the variable is reported lost,
    saying why. An object the module no longer holds at the
    checkpoint (rebound before it) is kept by value, as is an object of the notebook's own
    class that a module was given."""
    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / "gpufrac_modobj.py").write_text(MODULE)
    saved = in_process(SAVE, ckdir, """
import gpufrac_modobj
thing = gpufrac_modobj.THING
box = {"t": thing}
old = gpufrac_modobj.LATER
gpufrac_modobj.LATER = gpufrac_modobj.Thing(11)   # rebound before the checkpoint
class Mine:
    pass
gpufrac_modobj.GIVEN = Mine()
mine = gpufrac_modobj.GIVEN
""", lib)
    assert saved["lost"] == {}
    probe = """
import gpufrac_modobj
report = {"v": thing.v, "same": thing is gpufrac_modobj.THING and box["t"] is thing,
          "old": old.v, "old_copy": old is not gpufrac_modobj.LATER,
          "mine": type(mine) is Mine}
"""
    # Rebound in the module's source: the name's new object, of the same class, comes back.
    (lib / "gpufrac_modobj.py").write_text(MODULE.replace("Thing(1)", "Thing(2)"))
    got = in_process(RESTORE, ckdir, probe, lib)
    assert got["lost"] == {}
    assert got["report"] == {"v": 2, "same": True, "old": 10, "old_copy": True, "mine": True}

    # Of another class now: lost, and why.
    (lib / "gpufrac_modobj.py").write_text(MODULE.replace("THING = Thing(1)", "THING = [1]"))
    got = in_process(RESTORE, ckdir, "report = None", lib)
    assert set(got["lost"]) == {"thing", "box"}
    assert "gpufrac_modobj.THING is now a builtins.list" in got["lost"]["thing"]
    assert "old" in got["restored"] and "mine" in got["restored"]


def test_a_module_that_fails_to_import_at_the_restore(tmp_path: Path, ckdir: Path) -> None:
    """The variable is reported lost, saying which module did not import and why; the others
    come back."""
    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / "gpufrac_modobj.py").write_text(MODULE)
    saved = in_process(SAVE, ckdir, "from gpufrac_modobj import THING\nkept = [1, 2]\n", lib)
    assert saved["lost"] == {}
    (lib / "gpufrac_modobj.py").write_text("raise ImportError('gone for good')\n")
    got = in_process(RESTORE, ckdir, "report = kept", lib)
    assert set(got["lost"]) == {"THING"} and got["report"] == [1, 2]
    assert "gpufrac_modobj.THING: import gpufrac_modobj failed: ImportError: gone for good" in (
        got["lost"]["THING"])
