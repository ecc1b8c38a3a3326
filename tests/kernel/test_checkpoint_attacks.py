"""Another Unix user attacks a checkpoint: swapped directories, linked or replaced files."""

from __future__ import annotations

import ctypes
import os
import pickle
import select
import shutil
import stat
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from unix_users import ATTACKER, VICTIM, User, as_user, collect, spawn, user

from jupyter_gpufrac.kernel import store
from jupyter_gpufrac.kernel.checkpoint import Checkpointer, CheckpointError

VALUES = {"x": 41, "word": "mine", "t": [0.0, 1.0, 2.0, 3.0]}  # "t" is saved as a tensor
RACE_SECONDS = 3.0
_AT_FDCWD = -100
_RENAME_EXCHANGE = 2
_libc = ctypes.CDLL(None, use_errno=True)


class Evil:
    """What the attacker plants: unpickling it runs the attacker's code as the victim."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (exec, (f"open({str(self.marker)!r}, 'a').write('ran\\n')",))


@dataclass
class Arena:
    """A world-readable scratch folder; ``marker`` appears only if the attacker's pickle ran."""

    root: Path
    marker: Path
    victim: User
    attacker: User

    def folder(self, name: str, owner: User, mode: int) -> Path:
        path = self.root / name
        path.mkdir(mode=mode)
        os.chown(path, owner.uid, owner.gid)
        os.chmod(path, mode)
        return path

    def evil_bytes(self) -> bytes:
        return pickle.dumps(Evil(self.marker))


@pytest.fixture
def arena() -> Iterator[Arena]:
    victim, attacker = user(VICTIM), user(ATTACKER)
    # Not under pytest's tmp_path: that is root's alone, and the two users must reach this.
    root = Path(tempfile.mkdtemp(prefix="gpufrac-attack-", dir="/tmp"))
    try:
        # The children are forked, and once another user they may not read the interpreter's
        # library folder: what a checkpoint and a restore import lazily is imported now.
        victim_takes(root / "warm-up")
        Checkpointer(root / "warm-up").load({})
        os.chmod(root, 0o755)
        marks = root / "marks"
        marks.mkdir()
        os.chmod(marks, 0o777)
        yield Arena(root, marks / "attacker-code-ran", victim, attacker)
    finally:
        shutil.rmtree(root)


def run_as(who: User, fn: Callable[[], Any]) -> Any:
    """What ``fn`` returned as ``who``; anything else fails the test with the child's answer."""
    return ok(as_user(who, fn))


def ok(answer: dict[str, Any]) -> Any:
    assert "ok" in answer, answer
    return answer["ok"]


def victim_takes(ckdir: Path) -> list[str]:
    """The victim's checkpoint of :data:`VALUES`: two plain values and a tensor."""
    return Checkpointer(ckdir).take({**VALUES, "t": torch.tensor(VALUES["t"])}).names


def load_outcome(ckdir: Path) -> str:
    """"ok" when the victim's own values came back, else why the load refused or went wrong."""
    ns: dict[str, Any] = {}
    try:
        Checkpointer(ckdir).load(ns)
    except CheckpointError as exc:
        return str(exc)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    got = {k: v.tolist() if isinstance(v, torch.Tensor) else v for k, v in ns.items()}
    return "ok" if {k: got.get(k) for k in VALUES} == VALUES else f"wrong values {got!r}"[:300]


def exchange(a: Path, b: Path) -> None:
    """Swap two names atomically (renameat2 RENAME_EXCHANGE): each always names something."""
    if _libc.renameat2(_AT_FDCWD, bytes(a), _AT_FDCWD, bytes(b), _RENAME_EXCHANGE) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), str(a))


def swap_until_stopped(ckdir: Path, decoy: Path, stop: int) -> int:
    """The attacker: swap the victim's directory and the decoy until ``stop`` is readable."""
    swaps = 0
    deadline = time.monotonic() + 60  # never outlive a test that died
    while time.monotonic() < deadline:
        for _ in range(64):
            exchange(ckdir, decoy)
            swaps += 1
        if select.select([stop], [], [], 0)[0]:
            break
    if swaps % 2:
        exchange(ckdir, decoy)
    return swaps


@pytest.mark.parametrize("decoy_kind", ["directory", "symlink"])
def test_swapping_the_directory_during_loads_never_runs_the_attackers_pickle(
    arena: Arena, decoy_kind: str
) -> None:
    # The victim keeps checkpoints in a folder the attacker may write to (it owns it): the
    # attacker cannot touch the files, but can rename the checkpoint directory itself.
    shared = arena.folder("shared", arena.attacker, 0o777)
    ckdir = shared / "ck"
    # Written where the victim's kernel writes (a root of its own: a kernel writes into no
    # other), then moved where the attacker can rename it.
    written = arena.folder("victims", arena.victim, 0o700) / "ck"
    run_as(arena.victim, lambda: victim_takes(written))
    written.rename(ckdir)
    # A mirror of the victim's directory, the attacker's own, whose every blob runs its code.
    # Blob names are hashes of pickles an attacker can compute for guessable values; the test
    # copies them rather than guessing.
    evil = arena.folder("evil", arena.attacker, 0o755)
    shutil.copy(ckdir / store.STATE_FILE, evil / store.STATE_FILE)
    (evil / store.BLOB_DIR).mkdir()
    for blob in (ckdir / store.BLOB_DIR).iterdir():
        (evil / store.BLOB_DIR / blob.name).write_bytes(arena.evil_bytes())
    for path in [evil, *evil.rglob("*")]:
        os.chown(path, arena.attacker.uid, arena.attacker.gid)
        os.chmod(path, 0o755 if path.is_dir() else 0o644)
    decoy = shared / "decoy"
    if decoy_kind == "symlink":
        decoy.symlink_to(evil)
        os.lchown(decoy, arena.attacker.uid, arena.attacker.gid)
    else:
        evil.rename(decoy)
    try:
        exchange(ckdir, decoy)
        exchange(ckdir, decoy)
    except OSError as exc:
        pytest.skip(f"no atomic rename exchange here: {exc}")

    stop_read, stop_write = os.pipe()

    def attack() -> int:
        os.close(stop_write)  # else the attacker would hold its own stop signal open
        return swap_until_stopped(ckdir, decoy, stop_read)

    def victim_loads() -> dict[str, int]:
        outcomes: dict[str, int] = {}
        end = time.monotonic() + RACE_SECONDS
        while time.monotonic() < end:
            outcome = load_outcome(ckdir)
            key = "ok" if outcome == "ok" else (
                "refused" if outcome.startswith("refusing checkpoint") else outcome)
            outcomes[key] = outcomes.get(key, 0) + 1
        return outcomes

    attacker = spawn(arena.attacker, attack)
    os.close(stop_read)
    try:
        outcomes = run_as(arena.victim, victim_loads)
    finally:
        os.close(stop_write)
        swaps = ok(collect(*attacker))
    # The code that checked paths with lstat and then opened them by path failed 6 runs of 6
    # (both decoys, 2 cores): the attacker's pickle ran some 400 to 1,800 times in 3 seconds.
    assert not arena.marker.exists(), f"the attacker's pickle ran: {outcomes}"
    assert set(outcomes) <= {"ok", "refused"}, outcomes
    assert outcomes.get("ok") and outcomes.get("refused"), (outcomes, swaps)


def attackers_copy(source: Path, evil_file: Path, mode: int) -> Path:
    """``source`` copied beside ``evil_file``, owned like it (by the attacker)."""
    copy = evil_file.with_suffix(".gfc")
    shutil.copy(source, copy)
    owner = evil_file.stat()
    os.chown(copy, owner.st_uid, owner.st_gid)
    os.chmod(copy, mode)
    return copy


def tamper_blob_symlink(ckdir: Path, evil_file: Path) -> None:
    blob = next((ckdir / store.BLOB_DIR).glob("g-*.bin"))
    blob.unlink()
    blob.symlink_to(evil_file)


def tamper_blob_hard_link(ckdir: Path, evil_file: Path) -> None:
    for blob in (ckdir / store.BLOB_DIR).glob("g-*.bin"):
        blob.unlink()
        os.link(evil_file, blob)


def tamper_tensor_blob_hard_link(ckdir: Path, evil_file: Path) -> None:
    (blob,) = [b for b in (ckdir / store.BLOB_DIR).glob("*.bin") if not b.name.startswith("g-")]
    blob.unlink()
    os.link(evil_file, blob)


def tamper_state_replaced(ckdir: Path, evil_file: Path) -> None:
    # Unreadable to the victim: refused all the same, not an error of another kind.
    copy = attackers_copy(ckdir / store.STATE_FILE, evil_file, 0o600)
    os.replace(copy, ckdir / store.STATE_FILE)


def tamper_state_symlink(ckdir: Path, evil_file: Path) -> None:
    copy = attackers_copy(ckdir / store.STATE_FILE, evil_file, 0o644)
    (ckdir / store.STATE_FILE).unlink()
    (ckdir / store.STATE_FILE).symlink_to(copy)


def tamper_state_fifo(ckdir: Path, evil_file: Path) -> None:
    state = ckdir / store.STATE_FILE
    state.unlink()
    os.mkfifo(state, 0o600)  # the victim's own: opening it to read would wait for a writer
    owner = ckdir.stat()
    os.chown(state, owner.st_uid, owner.st_gid)


@pytest.mark.parametrize(("tamper", "refusal"), [
    pytest.param(tamper_blob_symlink, "symbolic link", id="blob-symlink"),
    pytest.param(tamper_blob_hard_link, "belongs to uid {attacker}", id="blob-hard-link"),
    pytest.param(tamper_tensor_blob_hard_link, "belongs to uid {attacker}",
                 id="tensor-blob-hard-link"),
    pytest.param(tamper_state_replaced, "belongs to uid {attacker}", id="state-replaced"),
    pytest.param(tamper_state_symlink, "symbolic link", id="state-symlink"),
    pytest.param(tamper_state_fifo, "not a regular file", id="state-fifo"),
])
def test_planted_files_are_refused_before_a_byte_is_read(
    arena: Arena, tamper: Callable[[Path, Path], None], refusal: str
) -> None:
    ckdir = arena.folder("victim", arena.victim, 0o700) / "ck"
    run_as(arena.victim, lambda: victim_takes(ckdir))
    attackers = arena.folder("attackers", arena.attacker, 0o755)
    evil_file = attackers / "evil.bin"
    evil_file.write_bytes(arena.evil_bytes())
    os.chown(evil_file, arena.attacker.uid, arena.attacker.gid)
    os.chmod(evil_file, 0o644)
    tamper(ckdir, evil_file)

    def victim_reads() -> dict[str, Any]:
        return {"load": load_outcome(ckdir), "header": Checkpointer(ckdir).read_header()}

    seen = run_as(arena.victim, victim_reads)
    assert not arena.marker.exists()
    assert seen["load"].startswith("refusing checkpoint"), seen
    assert refusal.format(attacker=arena.attacker.uid) in seen["load"]
    # The header is shown without unpickling, yet it too comes only from the victim's own file.
    state_tampered = tamper.__name__.startswith("tamper_state")
    assert (seen["header"] is None) == state_tampered, seen["header"]



@pytest.mark.parametrize("left", ["deleted", "link-planted"])
def test_a_root_deleted_under_a_running_kernel_is_made_again_the_users_alone(
        arena: Arena, left: str) -> None:
    """Finding 7: the victim's checkpoint root, in a project folder the attacker's group may
    write (setgid, as such folders are), is deleted under a running kernel whose umask is
    002. Its next checkpoint makes the root again 0700 and marked (never drwxrwsr-x, open to
    the group); a link planted in its place is refused, nothing written through it."""
    project = arena.folder("project", arena.attacker, 0o2777)
    root = project / "victims-checkpoints"
    kernel_dir = root / "k1"
    run_as(arena.victim, lambda: victim_takes(kernel_dir))
    shutil.rmtree(root)
    elsewhere = arena.folder("attackers", arena.attacker, 0o777)
    if left == "link-planted":
        os.symlink(elsewhere, root)
        os.lchown(root, arena.attacker.uid, arena.attacker.gid)

    def next_cell() -> str:
        os.umask(0o002)
        try:
            victim_takes(kernel_dir)
        except CheckpointError as exc:
            return str(exc)
        return "written"

    said = run_as(arena.victim, next_cell)
    if left == "deleted":
        assert said == "written"
        st = os.lstat(root)
        assert (st.st_uid, oct(stat.S_IMODE(st.st_mode))) == (arena.victim.uid, "0o700")
        assert oct(stat.S_IMODE(os.lstat(kernel_dir).st_mode)) == "0o700"
        assert run_as(arena.victim, lambda: _marked(root))  # the retention sweep may clean it
        assert run_as(arena.victim, lambda: load_outcome(kernel_dir)) == "ok"
    else:
        assert "symbolic link" in said, said
        assert os.listdir(elsewhere) == []


def _marked(root: Path) -> bool:
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        return store.root_marked(fd)
    finally:
        os.close(fd)
