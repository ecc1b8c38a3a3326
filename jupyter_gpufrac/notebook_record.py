"""Whose notebook a kernel's checkpoint folder holds, where it ran and how it ended: its record."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import stat
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from jupyter_gpufrac import contract
from jupyter_gpufrac.checkpoint_disk import remove_tree
from jupyter_gpufrac.kernel import store

RECORD = contract.NOTEBOOK_RECORD
# Longest user name, folder or path a record may hold (longer ones are not a record of ours).
MAX_TEXT = 4096


@dataclass(frozen=True)
class Notebook:
    """A notebook as every server of its user names it: the user, the folder the server
    serves (its ``root_dir``) and the notebook's path in it (``/``-separated, as the
    contents API says it)."""

    user: str
    root: str
    path: str

    def to_json(self) -> dict[str, str]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: object) -> Notebook | None:
        """The notebook a record names, or None when it names none properly."""
        if not isinstance(data, dict):
            return None
        user, root, path = (data.get(key) for key in ("user", "root", "path"))
        if not (isinstance(user, str) and isinstance(root, str) and isinstance(path, str)):
            return None
        if not user or not path or max(len(user), len(root), len(path)) > MAX_TEXT:
            return None
        return cls(user, root, path)

    def moved(self, source: str, target: str) -> Notebook | None:
        """This notebook after ``source`` (the notebook or a folder above it) was renamed to
        ``target``; None when the rename does not touch it."""
        source, target = source.strip("/"), target.strip("/")
        if not source:
            return None
        if self.path == source:
            return replace(self, path=target)
        if self.path.startswith(source + "/"):
            return replace(self, path=target + self.path[len(source):])
        return None


def session_notebook(session_name: str | None, cwd: str | None, user: str,
                     root: str) -> Notebook | None:
    """The notebook of a kernel jupyter_server started for a session: the file named by the
    ``JPY_SESSION_NAME`` it gives the kernel, in the kernel's folder ``cwd`` (the notebook's);
    None for a kernel of no session, or outside the folder the server serves."""
    if not session_name or not session_name.strip():
        return None
    path = session_name.strip()
    if cwd and os.path.isabs(cwd):
        # jupyter_server joins the notebook's folder with the session's name, which clients
        # set to the file's name (JupyterLab) or to its whole path (others).
        path = os.path.join(cwd, os.path.basename(path))
    if root and os.path.isabs(path):
        relative = os.path.relpath(os.path.normpath(path), os.path.normpath(root))
        if relative == os.curdir or relative.startswith(os.pardir):
            return None  # not in the folder the server serves: no path other servers know
        path = relative.replace(os.sep, "/")
    path = path.strip("/")
    if not path or len(path) > MAX_TEXT or len(user) > MAX_TEXT:
        return None
    return Notebook(user, root, path)


def read_record(folder: Path) -> dict[str, Any] | None:
    """The record in a kernel's checkpoint folder; None when there is none, or it is unreadable,
    not the user's alone (checked as a checkpoint is) or not a record."""
    try:
        data = json.loads(store.read_file(Path(folder), RECORD, blobs=False))
    except (OSError, ValueError, store.UnsafeCheckpointError):
        return None
    if not isinstance(data, dict) or Notebook.from_json(data.get("notebook")) is None:
        return None
    return data


def write_record(folder: Path, record: dict[str, Any], *, durable: bool = False) -> None:
    """Replace the record of a kernel's checkpoint folder, atomically, never through a link
    (raises OSError or UnsafeCheckpointError)."""
    store.write_file(Path(folder), RECORD, json.dumps(record).encode(), durable=durable,
                     blobs=False)


def adopt(root: Path, source: str, target: str, carry: Sequence[str] = ()) -> None:
    """Make kernel folder ``source`` of checkpoint root ``root`` the folder named ``target``: one
    rename (atomic on every file system, NFS too), whatever ``target`` held removed, except
    the names in ``carry`` (a live kernel's wake socket), which move into the adopted folder.

    Both are checked folders of the user's, reached through the root's descriptor, links never
    followed. Raises OSError (``source`` gone: another server took it first) or
    UnsafeCheckpointError.
    """
    root_fd = store.open_private_dir(Path(root))
    try:
        _own_folder(root_fd, source, Path(root))
        aside = None
        if _exists(root_fd, target):
            _own_folder(root_fd, target, Path(root))
            for name in carry:
                with contextlib.suppress(FileNotFoundError):
                    os.rename(f"{target}/{name}", f"{source}/{name}", src_dir_fd=root_fd,
                              dst_dir_fd=root_fd)
            aside = f".replaced-{target}-{secrets.token_hex(4)}"
            os.rename(target, aside, src_dir_fd=root_fd, dst_dir_fd=root_fd)
        os.rename(source, target, src_dir_fd=root_fd, dst_dir_fd=root_fd)
        if aside is not None:
            with contextlib.suppress(OSError):  # left over: the retention sweep removes it
                remove_tree(root_fd, aside)
    finally:
        os.close(root_fd)


def _exists(dir_fd: int, name: str) -> bool:
    try:
        os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return True


def _own_folder(dir_fd: int, name: str, root: Path) -> None:
    """Refuse ``name`` unless it is a folder of the user's that nobody else can write."""
    if "/" in name or name in ("", ".", ".."):
        raise store.UnsafeCheckpointError(f"refusing checkpoint folder name {name!r}")
    st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    if (not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid()
            or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)):
        raise store.UnsafeCheckpointError(
            f"refusing checkpoint folder {root / name}: not a folder of yours alone")
