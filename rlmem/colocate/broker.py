"""The broker: a device-wide ledger of the processes on one GPU, the grant of the device to one role at a
time, and the relay of calls between them.

Each process connects as a :class:`~rlmem.colocate.Member` with a role (``"train"`` or ``"rollout"``, seed
001's group id; ``"observer"`` for ``rlmem colocate status``) and reports what it holds by category with
every message. The device is granted to one role at a time: an ``acquire`` waits, bounded, until the holder
has released (its release counted only after its fence: see :meth:`Member.release`), and a holder that does
not release in time is named in the answer, with what it holds. A process that dies is noticed when its
socket closes: it leaves the ledger, a grant it held is returned, calls waiting on it are answered with its
death, and the others are told. The broker holds no device memory and creates no CUDA context (the device's
figures come from the members' reports), so it can run in a thread of any process, or alone
(``rlmem colocate broker``).
"""

from __future__ import annotations

import itertools
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import wire

__all__ = ["ROLES", "Broker", "default_path"]

ROLES = ("train", "rollout", "observer")


def default_path(device: str = "cuda:0") -> Path:
    """The socket of ``device``'s broker: ``$XDG_RUNTIME_DIR/rlmem`` (else ``/tmp/rlmem-UID``), one per
    device, e.g. ``.../colocate-cuda0.sock``."""
    base = os.environ.get("XDG_RUNTIME_DIR")
    root = Path(base) / "rlmem" if base else Path(f"/tmp/rlmem-{os.getuid()}")
    return root / f"colocate-{device.replace(':', '')}.sock"


@dataclass(eq=False)
class _Conn:
    sock: socket.socket
    pid: int
    role: str = ""
    name: str = ""
    holdings: dict[str, int] = field(default_factory=dict)
    mapped: dict[str, int] = field(default_factory=dict)
    device: dict[str, int] = field(default_factory=dict)
    serving: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)

    def send(self, msg: dict[str, Any], fds: list[int] | tuple[int, ...] = ()) -> bool:
        """Send; False if the peer is gone (its reader notices and drops it)."""
        try:
            with self.lock:
                wire.send(self.sock, msg, fds)
            return True
        except OSError:
            return False

    def info(self, holder: bool) -> dict[str, Any]:
        return {
            "pid": self.pid,
            "role": self.role,
            "name": self.name,
            "holdings": dict(self.holdings),
            "mapped": dict(self.mapped),
            "holds_device": holder,
            "serving": self.serving,
        }


def _refuse(sock: socket.socket, message: str, drain_s: float = 2.0) -> None:
    """Tell a refused peer why, then close. What the peer sent meanwhile (its hello) is read first: a Unix
    socket closed with bytes unread resets the connection, and the peer's read then fails with
    ``ECONNRESET`` before the refusal waiting in its buffer is read."""
    try:
        wire.send(sock, {"re": 0, "ok": False, "error": "refused", "message": message})
        sock.shutdown(socket.SHUT_WR)
        sock.settimeout(drain_s)
        while sock.recv(1 << 16):
            pass
    except OSError:
        pass  # the peer left first, or took longer than drain_s: nothing more is owed to it
    finally:
        sock.close()


class Broker:
    """The ledger and grant of one device, listening at ``path`` (default: :func:`default_path`).

    Args:
        path: the socket; its directory is made private (mode 0700).
        capacity: bytes the members' holdings may add up to (default: no limit but the device's); an
            ``acquire`` that would take the ledger over it fails like one that finds the device full.
        uid: the user peers must run as (default: this process's).

    Raises:
        ValueError: a bad argument, or something other than a socket at ``path``.
        RuntimeError: a broker is listening at ``path`` already.

    Example:
        >>> broker = Broker("/tmp/rlmem-doc/b.sock").start()   # in the trainer, or alone
        >>> broker.close()
    """

    def __init__(
        self,
        path: str | os.PathLike[str] | None = None,
        *,
        capacity: int | None = None,
        uid: int | None = None,
    ) -> None:
        if capacity is not None and (
            not isinstance(capacity, int) or isinstance(capacity, bool) or capacity <= 0
        ):
            raise ValueError(f"capacity must be a positive int (bytes) or None, got {capacity!r}")
        self.path = Path(path) if path is not None else default_path()
        self.capacity = capacity
        self._uid = os.getuid() if uid is None else uid
        self._cv = threading.Condition()
        self._members: dict[str, _Conn] = {}  # by role (observers are not members)
        self._conns: set[_Conn] = set()
        self._holder: _Conn | None = None
        self._calls: dict[int, tuple[_Conn, Any, _Conn]] = {}  # call id -> (caller, request id, callee)
        self._ids = itertools.count(1)
        self._sock: socket.socket | None = None
        self._closed = False
        # The last 200 joins, grants, releases (with their fences) and departures: (time, what, detail).
        self.events: list[tuple[float, str, dict[str, Any]]] = []

    def start(self) -> Broker:
        """Listen and serve on daemon threads; returns self."""
        self._sock = wire.listen(self.path)
        threading.Thread(target=self._accept, name="rlmem-broker", daemon=True).start()
        return self

    def __enter__(self) -> Broker:
        return self.start() if self._sock is None else self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop listening, close every connection and remove the socket file."""
        with self._cv:
            if self._closed:
                return
            self._closed = True
            conns = list(self._conns)
        if self._sock is not None:
            self._sock.close()
            self.path.unlink(missing_ok=True)
        for c in conns:
            try:
                c.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    # -- the ledger -------------------------------------------------------------------------------------
    def ledger(self) -> dict[str, Any]:
        """Every member (pid, role, holdings by category, memory it maps of others', whether it holds the
        device), the device's last reported free and total bytes, and the capacity."""
        with self._cv:
            members = [c.info(c is self._holder) for c in self._members.values()]
            reports = [c.device for c in self._members.values() if c.device]
        dev = max(reports, key=lambda d: d.get("at", 0)) if reports else {}
        return {
            "path": str(self.path),
            "members": members,
            "device": {k: dev[k] for k in ("free", "total") if k in dev},
            "capacity": self.capacity,
            "holder": next((m["role"] for m in members if m["holds_device"]), None),
        }

    def _log(self, what: str, **detail: Any) -> None:
        self.events.append((time.time(), what, detail))
        del self.events[:-200]

    # -- connections ------------------------------------------------------------------------------------
    def _accept(self) -> None:
        assert self._sock is not None
        while True:
            try:
                sock, _ = self._sock.accept()
            except OSError:
                return  # closed
            try:
                pid, _ = wire.check_peer(sock, self._uid)
            except wire.PeerRefusedError as e:
                # On a thread of its own: the refusal waits (briefly) for the peer, never the accept loop.
                threading.Thread(target=_refuse, args=(sock, str(e)), daemon=True).start()
                continue
            conn = _Conn(sock, pid)
            with self._cv:
                if self._closed:
                    sock.close()
                    return
                self._conns.add(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: _Conn) -> None:
        try:
            while True:
                try:
                    msg, fds = wire.recv(conn.sock, timeout=None)
                except wire.WireError as e:
                    conn.send({"re": 0, "ok": False, "error": "wire", "message": str(e)})
                    continue
                try:
                    self._handle(conn, msg, fds)
                finally:
                    for fd in fds:
                        os.close(fd)
        except (ConnectionError, OSError):
            pass
        finally:
            self._drop(conn)

    def _handle(self, conn: _Conn, msg: dict[str, Any], fds: list[int]) -> None:
        op, rid = msg.get("op"), msg.get("id")
        for key in ("holdings", "mapped", "device"):
            if isinstance(msg.get(key), dict):
                setattr(conn, key, {k: int(v) for k, v in msg[key].items()})
        if op != "hello" and not conn.role:
            conn.send({"re": rid, "ok": False, "error": "protocol", "message": "say hello first"})
        elif op == "hello":
            self._hello(conn, msg)
        elif op == "report":
            conn.send({"re": rid, "ok": True})
        elif op == "serving":
            with self._cv:
                conn.serving = True
                self._cv.notify_all()
        elif op == "status":
            conn.send({"re": rid, "ok": True, "ledger": self.ledger()})
        elif op == "acquire":
            threading.Thread(target=self._acquire, args=(conn, msg), daemon=True).start()
        elif op == "release":
            with self._cv:
                if self._holder is conn:
                    self._holder = None
                    self._cv.notify_all()
            self._log("release", role=conn.role, fence=msg.get("fence"))
            conn.send({"re": rid, "ok": True})
        elif op == "wait_for":
            threading.Thread(target=self._wait_for, args=(conn, msg), daemon=True).start()
        elif op == "call":
            self._call(conn, msg, fds)
        elif op == "result":
            with self._cv:
                caller, crid, _ = self._calls.pop(int(msg.get("cid", -1)), (None, None, None))
            if caller is not None:
                out = {k: v for k, v in msg.items() if k not in ("op", "cid", "holdings", "mapped", "device")}
                caller.send({**out, "re": crid}, fds)
        else:
            conn.send({"re": rid, "ok": False, "error": "protocol", "message": f"unknown op {op!r}"})

    def _hello(self, conn: _Conn, msg: dict[str, Any]) -> None:
        role, rid = msg.get("role"), msg.get("id")
        with self._cv:
            other = self._members.get(role) if isinstance(role, str) else None
            if role not in ROLES:
                err = f"role must be one of {', '.join(ROLES)}, got {role!r}"
            elif other is not None:
                err = f"role {role!r} is taken by pid {other.pid}: one process per role on a device"
            else:
                err = None
                conn.role, conn.name = role, str(msg.get("name", ""))
                if role != "observer":
                    self._members[role] = conn
                self._cv.notify_all()
        if err is not None:
            conn.send({"re": rid, "ok": False, "error": "hello", "message": err})
            return
        self._log("join", role=role, pid=conn.pid)
        conn.send({"re": rid, "ok": True, "pid": conn.pid, "capacity": self.capacity})

    def _acquire(self, conn: _Conn, msg: dict[str, Any]) -> None:
        rid = msg.get("id")
        deadline = time.monotonic() + float(msg.get("timeout", 0))
        with self._cv:
            while self._holder is not None and self._holder is not conn:
                left = deadline - time.monotonic()
                if left <= 0 or self._closed:
                    holder = self._holder.info(True)
                    reply = {"ok": False, "error": "busy", "holder": holder}
                    break
                self._cv.wait(left)
            else:
                self._holder = conn
                others = [c.info(False) for c in self._members.values() if c is not conn]
                reply = {"ok": True, "others": others, "capacity": self.capacity}
        self._log("acquire", role=conn.role, ok=reply["ok"])
        conn.send({**reply, "re": rid})

    def _wait_for(self, conn: _Conn, msg: dict[str, Any]) -> None:
        role, rid, serving = msg.get("role"), msg.get("id"), bool(msg.get("serving"))
        deadline = time.monotonic() + float(msg.get("timeout", 0))

        def ready() -> bool:
            peer = self._members.get(role)
            return peer is not None and (peer.serving or not serving)

        with self._cv:
            while not ready() and time.monotonic() < deadline and not self._closed:
                self._cv.wait(deadline - time.monotonic())
            peer = self._members.get(role) if ready() else None
            info = peer.info(peer is self._holder) if peer is not None else None
        conn.send({"re": rid, "ok": info is not None, "peer": info, "error": "absent"})

    def _call(self, conn: _Conn, msg: dict[str, Any], fds: list[int]) -> None:
        rid = msg.get("id")
        with self._cv:
            callee = self._members.get(msg.get("to"))
            cid = next(self._ids)
            if callee is not None:
                self._calls[cid] = (conn, rid, callee)
        if callee is None:
            conn.send({"re": rid, "ok": False, "error": "absent", "message": f"no {msg.get('to')!r} member"})
            return
        fwd = {"op": "call", "cid": cid, "from": conn.role, "method": msg.get("method")}
        fwd["args"] = msg.get("args", {})
        if not callee.send(fwd, fds):
            with self._cv:
                self._calls.pop(cid, None)
            conn.send({"re": rid, "ok": False, "error": "peer_lost", "peer": callee.info(False)})

    def _drop(self, conn: _Conn) -> None:
        with self._cv:
            self._conns.discard(conn)
            gone = self._members.get(conn.role) is conn
            if gone:
                del self._members[conn.role]
            if self._holder is conn:
                self._holder = None
            orphans = [(cid, c) for cid, c in self._calls.items() if c[2] is conn or c[0] is conn]
            for cid, _ in orphans:
                del self._calls[cid]
            others = list(self._members.values())
            self._cv.notify_all()
        conn.sock.close()
        if not gone:
            return
        info = conn.info(False)
        self._log("left", role=conn.role, pid=conn.pid)
        for _, (caller, crid, callee) in orphans:
            if callee is conn:
                caller.send({"re": crid, "ok": False, "error": "peer_lost", "peer": info})
        for c in others:
            c.send({"op": "peer_lost", "peer": info})
