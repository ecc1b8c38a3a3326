"""The checkpoint sweep on real folders: what expires, what stays, and links never followed."""

from __future__ import annotations

import grp
import logging
import os
import shutil
import socket
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from unix_users import ATTACKER, VICTIM, User, as_user, user

from jupyter_gpufrac import contract
from jupyter_gpufrac.checkpoint_disk import SHUTDOWN_MARKER, measure, read_marker, write_marker
from jupyter_gpufrac.kernel import store
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


def make_root(path: Path) -> Path:
    """A checkpoint root as the server makes it: 0700, marked as this project's."""
    os.close(store.open_root(path))
    return path


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return make_root(tmp_path / "checkpoints")


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


def test_a_root_under_a_linked_folder_is_swept_and_a_linked_root_never(tmp_path: Path) -> None:
    # A home or data folder on another disk reached through a link above the root is the
    # user's; the root itself is opened without following a link (someone may have put it).
    real = tmp_path / "real"
    kernel_folder(make_root(real / "checkpoints"), "k", age=2 * DAY)
    kernel_folder(real / "checkpoints", "running", age=2 * DAY)
    write_marker(real / "checkpoints" / "k", time.time() - DAY, time.time() - DAY)
    (tmp_path / "data").symlink_to(real, target_is_directory=True)
    (tmp_path / "linked").symlink_to(real / "checkpoints", target_is_directory=True)
    assert sweep(str(tmp_path / "linked"), 0, set(), 0, LOG) == []
    assert (real / "checkpoints" / "k").exists()
    via_parent = str(tmp_path / "data" / "checkpoints")
    assert measure(Path(via_parent)).of("k") is not None
    assert [r.name for r in sweep(via_parent, 0, {"running"}, 0, LOG)] == ["k"]
    assert not (real / "checkpoints" / "k").exists() and (real / "checkpoints" / "running").exists()


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


# -- a hostile neighbour: what another user puts in the root's place is never swept -------

PROJECT = "gpufrac-project"


@pytest.fixture
def neighbours(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, User, User]]:
    """A folder every user may enter, the victim, and the attacker; both in one project group."""
    victim, attacker = user(VICTIM, PROJECT), user(ATTACKER, PROJECT)
    base = Path(tempfile.mkdtemp(prefix="gpufrac-sweep-"))
    base.chmod(0o755)
    yield base, victim, attacker
    shutil.rmtree(base, ignore_errors=True)


def owned(path: Path, who: User, mode: int, group: int | None = None) -> Path:
    path.mkdir()
    os.chown(path, who.uid, who.gid if group is None else group)
    path.chmod(mode)
    return path


def swept_as(who: User, root: Path) -> dict[str, Any]:
    """``sweep`` of ``root`` run by ``who`` (keep 0, no grace): what it removed and logged."""
    def run() -> dict[str, Any]:
        logger = logging.getLogger(f"sweep-{who.name}")
        lines: list[str] = []
        handler = logging.Handler()
        handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
        logger.addHandler(handler)
        removed = sweep(str(root), 0, set(), 0, logger)
        return {"removed": [r.name for r in removed], "log": lines}
    answer = as_user(who, run)
    assert "ok" in answer, answer
    return dict(answer["ok"])


@pytest.mark.parametrize("attack", ["link-in-project-folder", "link-after-tmp-cleaner",
                                    "own-folder-swapped-in", "group-writable-root"])
def test_a_root_another_user_replaced_or_could_write_is_never_swept(
        neighbours: tuple[Path, User, User], attack: str) -> None:
    """Finding 1: the attacker puts a link to the victim's home, or another of the victim's
    folders, where the victim's checkpoint folder was; the victim's sweep removes nothing."""
    base, victim, attacker = neighbours
    project = grp.getgrnam(PROJECT).gr_gid
    shared = owned(base / ("tmp" if attack == "link-after-tmp-cleaner" else "project"),
                   victim if attack == "group-writable-root" else attacker,
                   0o1777 if attack == "link-after-tmp-cleaner" else 0o2775, project)
    # The victim's own folders: a thesis in the home, an experiment (with a folder named
    # blobs, as a kernel's has) in a data folder of the project's.
    home = owned(base / "home", victim, 0o700)
    thesis = owned(home / "thesis", victim, 0o700)
    (thesis / "chapter1.tex").write_text("two years of work")
    data = owned(shared / "victims-data", victim, 0o700)
    experiment = owned(data / "experiment", victim, 0o700)
    owned(experiment / "blobs", victim, 0o700)
    root = shared / "alice-checkpoints"
    made = as_user(victim, lambda: os.close(store.open_root(root)))
    assert "ok" in made, made
    kept = owned(root / "k-kept", victim, 0o700)
    owned(kept / "blobs", victim, 0o700)
    for path in (thesis / "chapter1.tex", thesis, experiment / "blobs", experiment, kept / "blobs",
                 kept):
        os.utime(path, (time.time() - 3 * DAY,) * 2)
    if attack == "link-after-tmp-cleaner":
        shutil.rmtree(root)  # removed by a tmp cleaner
    if attack == "group-writable-root":
        # As a kernel made it again with the umask's modes (finding 7): any project member
        # may now put anything in it.
        root.chmod(0o2770)

    def plant() -> None:
        if attack in ("link-in-project-folder", "own-folder-swapped-in"):
            os.rename(root, shared / "moved-away")
        if attack == "own-folder-swapped-in":
            os.rename(data, root)  # the victim's own folder, renamed within the project's
        elif attack != "group-writable-root":
            os.symlink(home, root)

    planted = as_user(attacker, plant)
    assert "ok" in planted, planted
    if attack == "own-folder-swapped-in":
        experiment = root / "experiment"

    swept = swept_as(victim, root)
    assert swept["removed"] == [], swept
    assert (thesis / "chapter1.tex").read_text() == "two years of work"
    assert (experiment / "blobs").is_dir()
    assert any(f"{root} was not swept" in line for line in swept["log"]), swept
    if attack == "group-writable-root":
        assert kept.exists()
