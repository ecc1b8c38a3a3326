"""Real notebooks written by others survive a move and an OOM kill in the middle.

Each notebook (tests/e2e/notebooks, see its README for sources and licence) is replayed
cell by cell in a kernel with a GPU lease and in an undisturbed reference kernel, from the
same seeds. Halfway through the first part the subject is moved to the other GPU; halfway
through the rest it holds memory above its request and the agent's reclaim kills it. Every
cell's outputs must be the same in both, before and after.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness.jupyter import Reply

from .test_sequences import Node, Sequence, disturbable_node

pytestmark = pytest.mark.e2e

NOTEBOOKS = Path(__file__).parent / "notebooks"
# What is not the notebook's state: shell commands, timings, the wall clock, downloads, and
# packages this test environment does not have (the cells that need them fail alike in both).
SKIP = re.compile(r"^\s*[!%]|datetime\.datetime\.now|requests\.get|nvidia-smi", re.M)
SETUP = (
    "import matplotlib\nmatplotlib.use('Agg')\n"
    "import random, numpy, torch\nrandom.seed(0)\nnumpy.random.seed(0)\ntorch.manual_seed(0)"
)
# Per-process details: memory addresses, and the file each kernel names its cells by.
PER_PROCESS = re.compile(r"0x[0-9a-f]{6,}|/tmp/ipykernel_\d+/\d+\.py")


def code_cells(path: Path) -> list[str]:
    cells = json.loads(path.read_text())["cells"]
    sources = ["".join(c["source"]) for c in cells if c["cell_type"] == "code"]
    return [s for s in sources if s.strip() and not SKIP.search(s)]


def observed(reply: Reply) -> tuple[str, ...]:
    """What a reader sees of a cell, without our own restore messages and memory addresses."""
    stdout = "\n".join(line for line in reply.stdout.splitlines()
                       if not line.startswith("gpufrac: "))
    return tuple(PER_PROCESS.sub("…", part)
                 for part in (reply.status, stdout, *reply.results, reply.error))


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    # The restart path, the one that must bring state back from disk (frozen, the process
    # keeps it: tests/e2e/test_sequences.py runs both).
    with disturbable_node(tmp_path_factory.mktemp("notebooks"), freezing=False) as found:
        yield found


@pytest.mark.parametrize("name", sorted(p.name for p in NOTEBOOKS.glob("*.ipynb")))
def test_notebook_survives_a_move_and_an_oom_kill(
    node: Node, name: str
) -> None:
    cells = code_cells(NOTEBOOKS / name)
    seq = Sequence(node, random.Random(0))
    move_at, kill_at = len(cells) // 3, 2 * len(cells) // 3
    compared = errors = 0
    passed = False
    try:
        seq.both(SETUP)
        for number, source in enumerate(cells):
            if number == move_at:
                seq.do_idle_move()
            if number == kill_at:
                seq.do_oom_kill()
            mine = observed(seq.subject.run(source, timeout=300))
            theirs = observed(seq.reference.run(source, timeout=300))
            assert mine == theirs, (
                f"{name}, cell {number} of {len(cells)}:\n{source}\n"
                f"--- after a move/kill ---\n{mine}\n--- undisturbed ---\n{theirs}")
            compared += 1
            errors += theirs[0] != "ok"
        assert seq.restores == 2
        print(f"{name}: {compared} cells compared ({errors} fail alike in both), "
              f"{seq.restores} restores")
        passed = True
    finally:
        seq.close(check=passed)
