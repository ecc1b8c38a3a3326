"""The wake socket: what the server sends and a kernel's directive thread waits on."""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path

from jupyter_gpufrac.wake import WakeReceiver, wake, wake_path


def test_a_new_kernel_takes_the_wake_socket_over(tmp_path: Path) -> None:
    path = wake_path(tmp_path)
    old = WakeReceiver(path)
    assert stat.S_IMODE(os.lstat(path).st_mode) == 0o600  # whatever the umask
    new = WakeReceiver(path)  # the restarted kernel: the old one's file is replaced
    assert wake(path) and new.wait(5)
    assert not old.wait(0.05)
    old.close()  # late: it must not remove the new kernel's socket
    assert wake(path) and new.wait(5)
    new.close()
    assert not wake(path)


def test_many_wake_ups_wake_once_and_a_wait_without_one_times_out(tmp_path: Path) -> None:
    receiver = WakeReceiver(wake_path(tmp_path))
    try:
        assert all(wake(receiver.path) for _ in range(50))
        assert receiver.wait(5)
        started = time.monotonic()
        assert not receiver.wait(0.2), "queued wake-ups were not all taken at once"
        assert time.monotonic() - started >= 0.15
    finally:
        receiver.close()


def test_nobody_listening_is_not_an_error(tmp_path: Path) -> None:
    assert not wake(wake_path(tmp_path))  # no socket
    assert not wake(wake_path(tmp_path / "missing"))  # no folder
    (tmp_path / "wake.sock").write_text("not a socket")
    assert not wake(wake_path(tmp_path))
