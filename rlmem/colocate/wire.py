"""How processes on one GPU talk: framed, versioned messages with file descriptors over a Unix socket in a
private directory, every peer checked by the kernel's credentials.

A message is one ``SOCK_SEQPACKET`` record: a JSON object carrying the protocol version ``v`` (a peer of
another version is an error naming both, never a misread), and up to :data:`MAX_FDS` descriptors passed
with ``SCM_RIGHTS`` (``socket.send_fds``; ``pidfd_getfd`` is blocked by common container profiles). Every
receive waits at most its ``timeout``. The listening socket lives in a directory only its user can enter
(mode 0700); a socket file left by a crashed run is detected (nothing answers it) and replaced, and nothing
else at that path is ever deleted. ``SO_PEERCRED`` gives each peer's pid and uid: a peer of another user is
refused with an error naming it.
"""

from __future__ import annotations

import json
import os
import socket
import stat
import struct
from pathlib import Path
from typing import Any

__all__ = [
    "MAX_FDS",
    "MAX_MESSAGE",
    "VERSION",
    "PeerRefusedError",
    "WireError",
    "check_peer",
    "connect",
    "listen",
    "peer_credentials",
    "private_dir",
    "recv",
    "send",
]

VERSION = 1
MAX_MESSAGE = 1 << 20
MAX_FDS = 256


class WireError(RuntimeError):
    """A message that is not one of this protocol's (another version, not JSON, cut short)."""


class PeerRefusedError(PermissionError):
    """A peer that may not talk to this process (another user)."""


def send(sock: socket.socket, msg: dict[str, Any], fds: list[int] | tuple[int, ...] = ()) -> None:
    """Send ``msg`` (a JSON-able dict) and ``fds`` as one message.

    Raises:
        ValueError: ``msg`` is not a dict, is over :data:`MAX_MESSAGE` bytes, or there are over
            :data:`MAX_FDS` descriptors.
    """
    if not isinstance(msg, dict):
        raise ValueError(f"msg must be a dict, got {type(msg).__name__}")
    data = json.dumps({**msg, "v": VERSION}).encode()
    if len(data) > MAX_MESSAGE or len(fds) > MAX_FDS:
        raise ValueError(
            f"message of {len(data)} bytes and {len(fds)} descriptors; at most {MAX_MESSAGE} and {MAX_FDS}"
        )
    socket.send_fds(sock, [data], list(fds))


def recv(sock: socket.socket, *, timeout: float | None) -> tuple[dict[str, Any], list[int]]:
    """The next message and the descriptors that came with it (the caller closes them).

    Raises:
        TimeoutError: nothing came within ``timeout`` seconds.
        ConnectionError: the peer closed the connection (it exited, or was killed).
        WireError: a message of another version or not of this protocol; its descriptors are closed.
    """
    sock.settimeout(timeout)
    data, fds, flags, _ = socket.recv_fds(sock, MAX_MESSAGE + 1, MAX_FDS)
    if not data and not fds:
        raise ConnectionError("the peer closed the connection")
    try:
        if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC) or len(data) > MAX_MESSAGE:
            raise WireError("a message over the protocol's limits was cut short")
        try:
            msg = json.loads(data)
        except ValueError as e:
            raise WireError(f"not a message of rlmem's protocol: {data[:60]!r}") from e
        if not isinstance(msg, dict) or msg.get("v") != VERSION:
            got = msg.get("v") if isinstance(msg, dict) else None
            raise WireError(f"the peer speaks protocol version {got!r}; this rlmem speaks {VERSION}")
    except WireError:
        for fd in fds:
            os.close(fd)
        raise
    del msg["v"]
    return msg, fds


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end, as the kernel recorded them at connect."""
    fmt = "3i"
    return struct.unpack(fmt, sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize(fmt)))


def check_peer(sock: socket.socket, uid: int | None = None) -> tuple[int, int]:
    """(pid, uid) of the peer, if it runs as ``uid`` (default: this process's user).

    Raises:
        PeerRefusedError: naming the peer's pid and uid.
    """
    want = os.getuid() if uid is None else uid
    pid, got, _ = peer_credentials(sock)
    if got != want:
        raise PeerRefusedError(
            f"refused a peer of another user: pid {pid}, uid {got} (this one runs as {want})"
        )
    return pid, got


def private_dir(path: str | os.PathLike[str]) -> Path:
    """``path`` as a directory only this user can enter: made with mode 0700, or checked to be such.

    Raises:
        ValueError: it exists and is not a directory, belongs to another user, or others may enter it.
    """
    p = Path(path)
    p.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = p.lstat()
    if not stat.S_ISDIR(st.st_mode):
        raise ValueError(f"{str(p)!r} is not a directory")
    if st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise ValueError(
            f"{str(p)!r} must belong to uid {os.getuid()} with mode 0700 (it is uid {st.st_uid}, mode "
            f"{stat.S_IMODE(st.st_mode):o}): another user could reach the socket in it"
        )
    return p


def listen(path: str | os.PathLike[str], backlog: int = 16) -> socket.socket:
    """A listening socket at ``path`` (in a :func:`private_dir`). A socket file nothing answers (a crashed
    run's) is replaced.

    Raises:
        RuntimeError: a process is listening there already.
        ValueError: something other than a socket is at ``path`` (it is left as it is), or the directory is
            not private.
    """
    p = Path(path)
    private_dir(p.parent)
    if p.exists() or p.is_symlink():
        if not stat.S_ISSOCK(p.lstat().st_mode):
            raise ValueError(
                f"{str(p)!r} exists and is not a socket: it is left as it is; choose another path"
            )
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            probe.connect(str(p))
        except (ConnectionRefusedError, FileNotFoundError):
            p.unlink(missing_ok=True)  # stale: its listener is gone
        else:
            raise RuntimeError(f"a process is listening at {str(p)!r} already")
        finally:
            probe.close()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        sock.bind(str(p))
        os.chmod(p, 0o600)
        sock.listen(backlog)
    except BaseException:
        sock.close()
        raise
    return sock


def connect(path: str | os.PathLike[str], *, timeout: float) -> socket.socket:
    """A connection to the listener at ``path``.

    Raises:
        ConnectionError: nothing listens there (or it does not answer within ``timeout``).
    """
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.settimeout(timeout)
    try:
        sock.connect(str(path))
    except (OSError, TimeoutError) as e:
        sock.close()
        raise ConnectionError(f"no rlmem process listens at {str(path)!r}: {e}") from e
    return sock
