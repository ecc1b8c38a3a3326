"""Who calls the agent: a Unix socket's peer (SO_PEERCRED), or the holder of the TCP token."""

from __future__ import annotations

import errno
import hmac
import socket
import struct

TOKEN_REQUIRED = "a token is required over TCP: send 'Authorization: token <token>'"


def token_matches(token: str | None, authorization: str) -> bool:
    """Whether an ``Authorization`` header carries the TCP token (in constant time)."""
    # Bytes: compare_digest refuses str with characters outside ASCII.
    return bool(token) and hmac.compare_digest(authorization.encode("utf-8", "replace"),
                                               f"token {token}".encode())


_UCRED = struct.Struct("3i")  # pid, uid, gid
SO_PEERGROUPS = getattr(socket, "SO_PEERGROUPS", 59)  # Linux 4.13; Python does not name it
_MAX_GROUPS = 65536


def peer_credentials(sock: socket.socket) -> tuple[int, int, int, frozenset[int]]:
    """(pid, uid, gid, supplementary gids) of the peer of a Unix socket, as they were when
    it connected: the kernel records them then, so nothing a pid later becomes can change them."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    pid, uid, gid = _UCRED.unpack(raw)
    size = 64 * 4
    while True:
        try:
            raw = sock.getsockopt(socket.SOL_SOCKET, SO_PEERGROUPS, size)
            break
        except OSError as exc:
            if exc.errno != errno.ERANGE or size >= _MAX_GROUPS * 4:
                raise
            size *= 4
    groups = frozenset(struct.unpack(f"{len(raw) // 4}I", raw[: len(raw) // 4 * 4]))
    return pid, uid, gid, groups | {gid}

