"""Which earlier state of a notebook a new kernel resumes, on real checkpoint folders: the
newest kernel decides, a running one is never taken, another user's notebook never matches."""

from __future__ import annotations

import errno
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from jupyter_gpufrac import contract
from jupyter_gpufrac.checkpoint_disk import write_marker
from jupyter_gpufrac.kernel import store
from jupyter_gpufrac.kernel.checkpoint import Checkpointer
from jupyter_gpufrac.notebook_record import Notebook, adopt, read_record, session_notebook, write_record
from jupyter_gpufrac.server import retention
from jupyter_gpufrac.server.events import KernelEventLog
from jupyter_gpufrac.server.notebook_states import (
    SILENT_AFTER_S,
    ServerInfo,
    latest,
    owner_problem,
    states_of,
)
from jupyter_gpufrac.server.resume import follow_rename
from jupyter_gpufrac.server.settings import KernelSettings
from jupyter_gpufrac.wake import WakeReceiver

ROOT = "/home/jovyan"
ALICE = Notebook("alice", ROOT, "work/train.ipynb")
HERE = ServerInfo.here()


@pytest.fixture
def root(tmp_path: Path) -> Path:
    path = tmp_path / "checkpoints"
    path.mkdir(mode=0o700)
    return path


def state(root: Path, name: str, notebook: Notebook | None, *, launched: float,
          values: dict[str, Any] | None = None, **record: Any) -> Path:
    """A kernel folder as a kernel and its server leave it: a real checkpoint of ``values``
    (its header naming the notebook) and the server's record."""
    folder = root / name
    checkpointer = Checkpointer(folder)
    checkpointer.take(dict(values if values is not None else {"x": 1}), execution_count=3,
                      extra={"notebook": notebook.to_json() if notebook else None})
    if notebook is not None:
        write_record(folder, {"notebook": notebook.to_json(), "kernel_id": name,
                              "launched": launched, **record})
    return folder


def stopped(when: float) -> dict[str, Any]:
    """A record's ``server`` and ``ended`` as a server that stopped at ``when`` leaves them."""
    return {"server": {**HERE.to_json(), "pid": 1, "started": 0.0},
            "ended": {"how": "server-stopped", "time": when}}


def test_the_newest_kernel_of_the_notebook_decides(root: Path) -> None:
    now = time.time()
    state(root, "k-old", ALICE, launched=now - 300, values={"a": 1}, **stopped(now - 200))
    state(root, "k-new", ALICE, launched=now - 100, values={"b": 2}, **stopped(now - 50))
    state(root, "k-other", Notebook("alice", ROOT, "other.ipynb"), launched=now)
    found = states_of(str(root), ALICE, set(), HERE)
    assert [s.folder for s in found] == ["k-new", "k-old"]
    chosen, _ = latest(found)
    assert chosen is not None and chosen.folder == "k-new" and chosen.names == ["b"]
    assert chosen.cell == 3
    # Shut down by its user: nothing resumes, not even the older state.
    write_marker(root / "k-new", now, now + 60)
    chosen, why = latest(states_of(str(root), ALICE, set(), HERE))
    assert chosen is None and "shut down by its user" in why
    # This server's own kernels are never another kernel's to take.
    assert [s.folder for s in states_of(str(root), ALICE, {"k-new"}, HERE)] == ["k-old"]


def test_an_empty_newest_state_resumes_nothing_unless_it_was_offered_an_older_one(
        root: Path) -> None:
    """A kernel its user restarted (or that ran nothing) holds nothing: the notebook starts
    fresh. A fresh kernel that was offered an older state and did not take it passes it on."""
    now = time.time()
    state(root, "k-old", ALICE, launched=now - 300, values={"a": 1}, **stopped(now - 200))
    state(root, "k-empty", ALICE, launched=now - 100, values={}, **stopped(now - 50))
    chosen, why = latest(states_of(str(root), ALICE, set(), HERE))
    assert chosen is None and "left nothing to resume" in why
    record = read_record(root / "k-empty")
    assert record is not None
    write_record(root / "k-empty", {**record, "offered": "k-old"})
    chosen, _ = latest(states_of(str(root), ALICE, set(), HERE))
    assert chosen is not None and chosen.folder == "k-old"


def test_another_users_notebook_never_matches_even_at_the_same_path(root: Path) -> None:
    now = time.time()
    state(root, "k-bob", Notebook("bob", ROOT, ALICE.path), launched=now, **stopped(now))
    assert states_of(str(root), ALICE, set(), HERE) == []
    # A state without a record is known by its header's notebook, and no better.
    state(root, "k-header", None, launched=now)
    assert states_of(str(root), ALICE, set(), HERE) == []


def test_a_kernel_that_still_runs_is_never_taken(root: Path) -> None:
    now = time.time()
    other_machine = {"node": "node-b", "host": "b", "boot": "another-boot", "pid": 1,
                     "started": 0.0}
    state(root, "k", ALICE, launched=now, server=other_machine, heartbeat=now - 5)
    chosen, why = latest(states_of(str(root), ALICE, set(), HERE))
    assert chosen is None and "its server on node-b was heard from 5 s ago" in why, why
    # Silent for long enough: its node went away.
    state(root, "k", ALICE, launched=now, server=other_machine,
          heartbeat=now - SILENT_AFTER_S - 1)
    chosen, _ = latest(states_of(str(root), ALICE, set(), HERE))
    assert chosen is not None
    # A server of this machine: asked by its pid (the test's parent process stands for one).
    parent = psutil.Process(os.getppid())
    state(root, "k", ALICE, launched=now,
          server={**HERE.to_json(), "pid": parent.pid, "started": parent.create_time()})
    chosen, why = latest(states_of(str(root), ALICE, set(), HERE))
    assert chosen is None and "still runs" in why, why
    # Its kernel listens on its wake socket: it runs, whatever its record says.
    write_record(root / "k", {"notebook": ALICE.to_json(), "launched": now, **stopped(now)})
    receiver = WakeReceiver(str(root / "k" / contract.WAKE_SOCKET))
    try:
        chosen, why = latest(states_of(str(root), ALICE, set(), HERE))
        assert chosen is None and "its kernel still runs on this machine" in why, why
    finally:
        receiver.close()


def test_a_volume_shared_by_several_users_is_refused_with_the_fix(root: Path) -> None:
    assert owner_problem(str(root), "alice") is None
    assert json.loads((root / contract.OWNER_FILE).read_text()) == {"user": "alice"}
    assert owner_problem(str(root), "alice") is None
    problem = owner_problem(str(root), "bob")
    assert problem is not None
    assert f'{root} holds the checkpoints of "alice", not yours ("bob")' in problem
    assert "a per-user volume" in problem and "c.GpuFrac.checkpoint_dir" in problem


def test_taking_over_a_folder_is_one_rename_and_refuses_what_is_not_yours_alone(
        root: Path) -> None:
    state(root, "k-old", ALICE, launched=0.0)
    fresh = root / "k-new"
    Checkpointer(fresh).take({"y": 2})
    receiver = WakeReceiver(str(fresh / contract.WAKE_SOCKET))
    try:
        adopt(root, "k-old", "k-new", (contract.WAKE_SOCKET,))
        assert not (root / "k-old").exists()
        assert Checkpointer(fresh).read_header()["names"] == ["x"]
        # The live kernel's wake socket came along: it is still reached by its name.
        assert (fresh / contract.WAKE_SOCKET).is_socket()
        assert [p.name for p in root.iterdir() if p.name.startswith(".replaced")] == []
    finally:
        receiver.close()
    os.symlink(fresh, root / "k-link")
    with pytest.raises(store.UnsafeCheckpointError):
        adopt(root, "k-link", "k-3")
    (root / "k-open").mkdir(mode=0o700)
    (root / "k-open").chmod(0o777)
    with pytest.raises(store.UnsafeCheckpointError):
        adopt(root, "k-open", "k-4")
    with pytest.raises(FileNotFoundError):
        adopt(root, "k-gone", "k-5")


def test_a_notebook_is_named_by_its_path_in_the_served_folder() -> None:
    # JupyterLab names the session by the file; other clients by the whole path.
    assert session_notebook("train.ipynb", f"{ROOT}/work", "alice", ROOT) == ALICE
    assert session_notebook(f"{ROOT}/work/train.ipynb", f"{ROOT}/work", "alice", ROOT) == ALICE
    assert session_notebook("work/train.ipynb", None, "alice", ROOT) == ALICE
    assert session_notebook("/elsewhere/x.ipynb", "/elsewhere", "alice", ROOT) is None
    assert session_notebook(None, ROOT, "alice", ROOT) is None
    assert ALICE.moved("work", "done") == Notebook("alice", ROOT, "done/train.ipynb")
    assert ALICE.moved("work/train.ipynb", "t.ipynb") == Notebook("alice", ROOT, "t.ipynb")
    assert ALICE.moved("wor", "x") is None


def test_renames_reach_the_records_of_waiting_states_of_the_user_only(root: Path) -> None:
    state(root, "k-alice", ALICE, launched=0.0)
    state(root, "k-bob", Notebook("bob", ROOT, ALICE.path), launched=0.0)
    settings = KernelSettings(socket_path="", client_name="", default_request="0.25",
                              default_limit="1", checkpoint_root=str(root),
                              events=KernelEventLog(None, logging.getLogger("t")),
                              user="alice", notebook_root=ROOT)
    assert follow_rename([], settings, "work", "archive") == 1
    assert (read_record(root / "k-alice") or {})["notebook"]["path"] == "archive/train.ipynb"
    assert (read_record(root / "k-bob") or {})["notebook"]["path"] == "work/train.ipynb"


def test_a_file_system_without_hard_links_is_said(root: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    assert retention.hard_links_refused(str(root)) is None

    def refused(*args: object, **kwargs: object) -> None:
        raise OSError(errno.EPERM, "Operation not permitted")

    # What an NFS export or a FUSE file system answers to link(2).
    monkeypatch.setattr(os, "link", refused)
    assert retention.hard_links_refused(str(root)) == "Operation not permitted"
    assert sorted(p.name for p in root.iterdir()) == []
