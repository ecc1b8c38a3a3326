"""The checkpoint sweep on real folders: what expires, what stays, and links never followed."""

from __future__ import annotations

import logging
import os
import socket
import time
from pathlib import Path

import pytest

from jupyter_gpufrac import contract
from jupyter_gpufrac.checkpoint_disk import SHUTDOWN_MARKER, measure, read_marker, write_marker
from jupyter_gpufrac.server.retention import mark_shut_down, sweep
from jupyter_gpufrac.wake import WakeReceiver

LOG = logging.getLogger("test-retention")
DAY = 86400.0


def kernel_folder(root: Path, name: str, nbytes: int = 65536, age: float = 0.0) -> Path:
    """A checkpoint folder as a kernel leaves it, its writes ``age`` seconds old."""
    folder = root / name
    (folder / "blobs").mkdir(parents=True, mode=0o700)
    folder.chmod(0o700)
    (folder / "blobs" / "a.bin").write_bytes(os.urandom(nbytes))
    (folder / "checkpoint.gfc").write_bytes(b"state")
    if age:
        backdate(folder, age)
    return folder


def backdate(folder: Path, age: float) -> None:
    when = time.time() - age
    for path in [*folder.rglob("*"), folder]:
        if not path.is_symlink():
            os.utime(path, (when, when))


@pytest.fixture
def root(tmp_path: Path) -> Path:
    path = tmp_path / "checkpoints"
    path.mkdir(mode=0o700)
    return path


def test_a_shut_down_kernel_is_kept_for_the_keep_time_then_removed(
        root: Path, caplog: pytest.LogCaptureFixture) -> None:
    folder = kernel_folder(root, "k-shut", nbytes=1 << 20)
    now = time.time()
    mark_shut_down(str(root), "k-shut", 3600, LOG, now=now)
    marker = read_marker(folder)
    assert marker is not None and marker.time == now and marker.keep_until == now + 3600
    assert oct((folder / SHUTDOWN_MARKER).stat().st_mode & 0o777) == "0o600"

    assert sweep(str(root), 3600, set(), 7200, LOG, now=now + 3599) == []
    assert folder.exists()
    with caplog.at_level(logging.INFO, "test-retention"):
        [removed] = sweep(str(root), 3600, set(), 7200, LOG, now=now + 3601)
    assert removed.name == "k-shut" and removed.freed >= 1 << 20
    assert not folder.exists() and root.exists()
    assert "removed the checkpoint of kernel k-shut" in caplog.text and "freeing 1." in caplog.text


def test_a_kernel_never_launched_gets_no_marker(root: Path) -> None:
    mark_shut_down(str(root), "never", 60, LOG)
    assert not (root / "never").exists()


def test_unmarked_folders_go_only_when_unwritten_for_the_keep_time_and_the_orphan_grace(
        root: Path) -> None:
    fresh = kernel_folder(root, "fresh")
    recent = kernel_folder(root, "recent", age=3 * 3600)  # past keep 0 and 1 h, not 4 h grace
    old = kernel_folder(root, "old", age=2 * DAY)
    removed = sweep(str(root), 0, set(), 4 * 3600, LOG)
    assert [r.name for r in removed] == ["old"]
    assert fresh.exists() and recent.exists() and not old.exists()
    assert [r.name for r in sweep(str(root), DAY, set(), 3600, LOG)] == []
    assert [r.name for r in sweep(str(root), 3600, set(), 3600, LOG)] == ["recent"]


def test_running_kernels_and_listening_ones_stay_and_are_marked_in_use(root: Path) -> None:
    ours = kernel_folder(root, "ours", age=2 * DAY)
    mark_shut_down(str(root), "ours", 0, LOG, now=time.time() - DAY)
    other = kernel_folder(root, "other-servers", age=2 * DAY)
    receiver = WakeReceiver(str(other / contract.WAKE_SOCKET))  # a kernel of another server
    try:
        backdate(other, 2 * DAY)
        assert sweep(str(root), 0, {"ours"}, 0, LOG) == []
        assert ours.exists() and other.exists()
        assert time.time() - ours.stat().st_mtime < 60  # touched: in use by this server
    finally:
        receiver.close()
    # A socket file nobody listens on (the kernel died) protects nothing.
    (other / contract.WAKE_SOCKET).unlink(missing_ok=True)
    cwd = os.getcwd()
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as dead:
        os.chdir(other)  # a short address: pytest's folders can be long
        try:
            dead.bind(contract.WAKE_SOCKET)
        finally:
            os.chdir(cwd)
    backdate(other, 2 * DAY)
    assert [r.name for r in sweep(str(root), 0, {"ours"}, 0, LOG)] == ["other-servers"]


def test_links_are_never_followed(root: Path, tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    (outside / "deep").mkdir(parents=True)
    (outside / "precious").write_bytes(b"keep me")
    (outside / "deep" / "precious").write_bytes(b"keep me too")
    old = time.time() - 3 * DAY
    for path in (outside / "precious", outside / "deep" / "precious", outside / "deep", outside):
        os.utime(path, (old, old))
    # In the root: a link to a folder that would look expired.
    (root / "planted").symlink_to(outside, target_is_directory=True)
    # Inside a folder that goes: links to a file and to a folder outside.
    folder = kernel_folder(root, "k-links", age=2 * DAY)
    (folder / "blobs" / "x.bin").symlink_to(outside / "precious")
    (folder / "dir-link").symlink_to(outside / "deep", target_is_directory=True)
    mark_shut_down(str(root), "k-links", 0, LOG, now=time.time() - DAY)
    # A marker that is a link to a marker elsewhere does not count.
    fake = kernel_folder(root, "k-fake-marker")
    (outside / "marker.json").write_text('{"time": 0, "keep_until": 0}')
    (fake / SHUTDOWN_MARKER).symlink_to(outside / "marker.json")
    assert read_marker(fake) is None

    removed = sweep(str(root), 0, set(), DAY, LOG)
    assert [r.name for r in removed] == ["k-links"]
    assert not folder.exists() and fake.exists()
    assert (root / "planted").is_symlink()
    assert (outside / "precious").read_bytes() == b"keep me"
    assert (outside / "deep" / "precious").read_bytes() == b"keep me too"
    assert (outside / "marker.json").exists()


def test_a_root_configured_through_a_link_is_swept_where_it_leads(tmp_path: Path) -> None:
    # The root is the configured path (a data folder on /scratch, say): only what is inside
    # it is never followed.
    real = tmp_path / "real"
    kernel_folder(real, "k", age=2 * DAY)
    kernel_folder(real, "running", age=2 * DAY)
    write_marker(real / "k", time.time() - DAY, time.time() - DAY)
    (tmp_path / "linked").symlink_to(real, target_is_directory=True)
    assert measure(tmp_path / "linked").of("k") is not None
    assert [r.name for r in sweep(str(tmp_path / "linked"), 0, {"running"}, 0, LOG)] == ["k"]
    assert not (real / "k").exists() and (real / "running").exists()


def test_measure_counts_blocks_by_folder_and_what_is_kept(root: Path) -> None:
    kernel_folder(root, "a", nbytes=1 << 20)
    kernel_folder(root, "b", nbytes=2 << 20)
    (root / "last-request-x.json").write_text("{}")  # not a kernel's
    now = time.time()
    write_marker(root / "b", now, now + 3600)
    usage = measure(root)
    assert [f.name for f in usage.folders] == ["a", "b"]
    a, b = usage.of("a"), usage.of("b")
    assert a is not None and b is not None
    assert 1 << 20 <= a.bytes < (1 << 20) + 65536 and 2 << 20 <= b.bytes < (2 << 20) + 65536
    assert usage.total == a.bytes + b.bytes
    model = usage.model("a", now)
    assert model == {"kernel_bytes": a.bytes, "all_bytes": usage.total, "folders": 2,
                     "kept_after_shutdown": 1, "kept_until": now + 3600, "complete": True}
    assert measure(root / "absent").folders == []
