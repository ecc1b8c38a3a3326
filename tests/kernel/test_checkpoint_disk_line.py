"""``%gpu`` says what the user's checkpoints take on disk (a real kernel)."""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

from jupyter_gpufrac.checkpoint_disk import Folder, Marker, Usage, write_marker
from jupyter_gpufrac.kernel.magics import disk_text

from .kernels import running_kernel

MIB = 1 << 20


def folder_with(root: Path, name: str, nbytes: int) -> Path:
    folder = root / name
    (folder / "blobs").mkdir(parents=True, mode=0o700)
    folder.chmod(0o700)
    (folder / "blobs" / "a.bin").write_bytes(os.urandom(nbytes))
    return folder


UNITS = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}


def sizes(line: str) -> tuple[float, float]:
    """(this kernel's, all kernels') MiB in a ``%gpu`` line."""
    found = re.search(r"checkpoints on disk: ([\d.]+) (\w+) for this kernel, ([\d.]+) (\w+) for "
                      r"all your kernels here", line)
    assert found, line
    return (float(found.group(1)) * UNITS[found.group(2)] / MIB,
            float(found.group(3)) * UNITS[found.group(4)] / MIB)


def test_gpu_shows_the_checkpoints_on_disk(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    root.mkdir(mode=0o700)
    shut = folder_with(root, "shut-down", 3 * MIB)
    now = time.time()
    write_marker(shut, now, now + 3600)
    folder_with(root, "orphan", 2 * MIB)
    (root / "planted").symlink_to("/usr", target_is_directory=True)  # never walked into
    mine = root / "this-kernel"
    with running_kernel({"GPUFRAC_CHECKPOINT_DIR": str(mine), "GPUFRAC_KERNEL_ID": "this-kernel"}
                        ) as k:
        assert k.run("import numpy as np; big = np.random.default_rng(0).random(2**19)").status == "ok"
        out = k.run("%gpu checkpoint")
        assert out.status == "ok", out.text
        status = k.run("%gpu")
    assert status.status == "ok", status.text
    [line] = [x for x in status.stdout.splitlines() if "checkpoints on disk" in x]
    this, everything = sizes(line)
    assert 4.0 <= this < 5.0, line  # the 4 MiB array and the state file
    assert 9.0 <= everything < 10.5, line  # and the 3 MiB and 2 MiB folders, not /usr
    until = time.strftime("%Y-%m-%d %H:%M", time.localtime(now + 3600))
    assert line.endswith(f"(1 kept from shut-down kernels until {until})"), line


def test_the_line_without_kept_folders_and_when_it_cannot_measure() -> None:
    usage = Usage([Folder("k", 2 * MIB, 0.0, None),
                   Folder("gone", MIB, 0.0, Marker(0.0, 10.0))], complete=False)
    assert disk_text(usage, "k", 100.0) == (
        "  checkpoints on disk: at least 2.0 MiB for this kernel, at least 3.0 MiB for all your "
        "kernels here")
    assert disk_text(Usage(), "k", 0.0).startswith("  checkpoints on disk: 0 B for this kernel")
