"""The notebook a kernel serves, as the server's record in its folder says (read again on a rename)."""

from __future__ import annotations

import os
from pathlib import Path

from jupyter_gpufrac.notebook_record import RECORD, Notebook, read_record


class ServedNotebook:
    """The record of one kernel folder, read again only when it changed (inode, mtime, size)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._notebook: dict[str, str] | None = None
        self._record_seen: tuple[int, int, int] | None = None

    def notebook(self) -> dict[str, str] | None:
        """The notebook (user, folder, path) the record names; the last one read when the
        record cannot be seen now."""
        try:
            st = os.stat(self.folder / RECORD, follow_symlinks=False)
        except OSError:
            return self._notebook
        seen = (st.st_ino, st.st_mtime_ns, st.st_size)
        if seen != self._record_seen:
            self._record_seen = seen
            found = Notebook.from_json((read_record(self.folder) or {}).get("notebook"))
            self._notebook = found.to_json() if found is not None else None
        return self._notebook
