"""The wire between processes on one GPU: framed, versioned messages with descriptors, bounded waits, the
peer's credentials, a private directory, stale sockets replaced and nothing else deleted."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap

import pytest

from rlmem.colocate import wire


def _pair() -> tuple[socket.socket, socket.socket]:
    return socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)


def test_a_message_carries_its_descriptors():
    a, b = _pair()
    fd = os.memfd_create("payload")
    os.write(fd, b"shared bytes")
    wire.send(a, {"op": "hello", "n": 3}, [fd])
    os.close(fd)
    msg, fds = wire.recv(b, timeout=10)
    assert msg == {"op": "hello", "n": 3} and len(fds) == 1
    assert os.pread(fds[0], 12, 0) == b"shared bytes"
    os.close(fds[0])
    a.close()
    with pytest.raises(ConnectionError, match="closed the connection"):
        wire.recv(b, timeout=10)


def test_other_versions_and_bad_messages_are_errors_not_misreads():
    a, b = _pair()
    fd = os.memfd_create("x")
    socket.send_fds(a, [json.dumps({"v": 999, "op": "hello"}).encode()], [fd])
    with pytest.raises(wire.WireError, match="speaks protocol version 999; this rlmem speaks 1"):
        wire.recv(b, timeout=10)
    a.send(b"not json")
    with pytest.raises(wire.WireError, match="not a message of rlmem's protocol"):
        wire.recv(b, timeout=10)
    with pytest.raises(ValueError, match="at most"):
        wire.send(a, {"blob": "x" * (wire.MAX_MESSAGE + 1)})
    with pytest.raises(ValueError, match="msg must be a dict"):
        wire.send(a, ["op"])  # type: ignore[arg-type]
    with pytest.raises(TimeoutError):
        wire.recv(b, timeout=0.2)  # every wait is bounded
    os.close(fd)


def test_the_peer_is_known_by_its_credentials():
    a, _ = _pair()
    assert wire.peer_credentials(a)[:2] == (os.getpid(), os.getuid())
    assert wire.check_peer(a) == (os.getpid(), os.getuid())
    # Another user's peer, simulated (a test cannot become another user): its uid is not this one's.
    with pytest.raises(wire.PeerRefusedError, match=rf"pid {os.getpid()}, uid {os.getuid()}"):
        wire.check_peer(a, uid=os.getuid() + 1)


def test_the_directory_is_private_and_nothing_but_a_stale_socket_is_replaced(tmp_path):
    d = wire.private_dir(tmp_path / "run")
    assert (d.stat().st_mode & 0o777) == 0o700
    open_dir = tmp_path / "open"
    open_dir.mkdir(mode=0o755)
    os.chmod(open_dir, 0o755)
    with pytest.raises(ValueError, match="mode 0700"):
        wire.private_dir(open_dir)

    path = d / "broker.sock"
    crashed = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    crashed.bind(str(path))  # a run that died without removing its socket
    crashed.close()
    live = wire.listen(path)  # the stale file is replaced
    assert (path.stat().st_mode & 0o777) == 0o600
    with pytest.raises(RuntimeError, match=r"listening at .* already"):
        wire.listen(path)
    other = d / "notes.txt"
    other.write_text("keep me")
    with pytest.raises(ValueError, match="is not a socket: it is left as it is"):
        wire.listen(other)
    assert other.read_text() == "keep me"
    live.close()
    with pytest.raises(ConnectionError, match="no rlmem process listens"):
        wire.connect(d / "nobody.sock", timeout=5)


def test_two_processes_meet_at_the_socket(tmp_path):
    path = wire.private_dir(tmp_path / "run") / "broker.sock"
    server = wire.listen(path)
    server.settimeout(60)
    child = textwrap.dedent(
        f"""
        import os
        from rlmem.colocate import wire
        sock = wire.connect({str(path)!r}, timeout=30)
        fd = os.memfd_create("from-child")
        os.write(fd, b"child")
        wire.send(sock, {{"op": "hello", "role": "rollout"}}, [fd])
        msg, _ = wire.recv(sock, timeout=30)
        assert msg == {{"op": "welcome"}}
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", child])
    try:
        conn, _ = server.accept()
        pid, uid = wire.check_peer(conn)
        assert pid == proc.pid and uid == os.getuid()
        msg, fds = wire.recv(conn, timeout=30)
        assert msg == {"op": "hello", "role": "rollout"} and os.pread(fds[0], 5, 0) == b"child"
        os.close(fds[0])
        wire.send(conn, {"op": "welcome"})
        assert proc.wait(timeout=60) == 0
        with pytest.raises(ConnectionError):  # it exited: its end is closed
            wire.recv(conn, timeout=10)
        conn.close()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        server.close()
