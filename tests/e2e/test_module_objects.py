"""A module's object survives a kill as that module's object (issue 27, item 5): after
``from scipy.stats import norm`` and a SIGKILL, the restored kernel's ``norm`` is
``scipy.stats.norm`` and draws what an undisturbed kernel draws from the same seed."""

from __future__ import annotations

import os
import random
import signal
import time
from pathlib import Path

import pytest

from .test_sequences import Sequence, disturbable_node

pytestmark = pytest.mark.e2e

PROBE = """
import scipy.stats
np.random.seed(0)
print(norm.rvs(size=3).round(2).tolist(), norm is scipy.stats.norm)
"""


def test_norm_after_a_sigkill_draws_what_the_reference_draws(tmp_path: Path) -> None:
    with disturbable_node(tmp_path, freezing=False) as node:
        seq = Sequence(node, random.Random(0))
        try:
            seq.both("from scipy.stats import norm\nimport numpy as np")
            # Explicitly, so the kill cannot come before the import's checkpoint is written.
            seq.subject.ok("%gpu checkpoint")
            pid = int(seq.subject.ok("import os\nprint(os.getpid())").split()[-1])
            since = time.time()
            os.kill(pid, signal.SIGKILL)
            event = seq.wait_restored("a SIGKILL of the kernel", since, "restored")
            assert event["ok"] is True, event
            assert "norm" in event["restored"], event
            mine = seq.subject.ok(PROBE).strip().splitlines()[-1]
            theirs = seq.reference.ok(PROBE).strip().splitlines()[-1]
            assert mine == theirs == "[1.76, 0.4, 0.98] True", (mine, theirs)
        finally:
            seq.close(check=False)
