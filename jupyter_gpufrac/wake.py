"""Waking a kernel's directive thread: one datagram on a socket in its checkpoint folder."""

from __future__ import annotations

import contextlib
import os
import socket
import stat
from collections.abc import Iterator

from jupyter_gpufrac import contract

# An AF_UNIX address holds 107 bytes and a NUL; a longer path is reached through its folder.
ADDRESS_MAX = 107


def wake_path(checkpoint_dir: str | os.PathLike[str]) -> str:
    """Where the kernel using ``checkpoint_dir`` listens."""
    return os.path.join(os.fspath(checkpoint_dir), contract.WAKE_SOCKET)


@contextlib.contextmanager
def unix_address(path: str) -> Iterator[str]:
    """``path`` as an AF_UNIX address: itself, or through ``/proc/self/fd`` when too long
    (pytest's and JupyterHub's folders can be)."""
    if len(os.fsencode(path)) <= ADDRESS_MAX:
        yield path
        return
    folder = os.open(os.path.dirname(path) or ".", os.O_PATH | os.O_DIRECTORY)
    try:
        yield f"/proc/self/fd/{folder}/{os.path.basename(path)}"
    finally:
        os.close(folder)


def wake(path: str) -> bool:
    """Send one wake-up; False when nobody listens there (no kernel, or one restarting)."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock, unix_address(path) as address:
            sock.setblocking(False)
            sock.sendto(b"!", address)
    except BlockingIOError:  # its queue is full: the kernel has wake-ups waiting already
        return True
    except OSError:
        return False
    return True


class WakeReceiver:
    """The kernel's end, bound at ``path`` (replacing a dead kernel's); one thread waits on it."""

    def __init__(self, path: str) -> None:
        self.path = path
        with contextlib.suppress(FileNotFoundError):
            if stat.S_ISSOCK(os.lstat(path).st_mode):
                os.unlink(path)
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            with unix_address(path) as address:
                self._sock.bind(address)
            # bind() honours the umask; nobody but the kernel's user needs to wake it (its
            # folder is 0700 as well).
            os.chmod(path, 0o600)
            self._inode = os.lstat(path).st_ino
        except OSError:
            self._sock.close()
            raise

    def wait(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds; True if woken (every queued wake-up is taken)."""
        self._sock.settimeout(timeout)
        try:
            self._sock.recv(16)
        except TimeoutError:
            return False
        except OSError:  # closed under us: the kernel is going away
            return False
        self._sock.setblocking(False)  # a timed socket would wait again on EAGAIN
        with contextlib.suppress(OSError):
            while self._sock.recv(16):
                pass
        return True

    def close(self) -> None:
        """Stop listening; the socket file goes too unless a newer kernel bound its own."""
        self._sock.close()
        with contextlib.suppress(OSError):
            if os.lstat(self.path).st_ino == self._inode:
                os.unlink(self.path)
