"""A member's connection to the broker: the socket, the reader thread that sorts what arrives, and requests
matched to their replies.

:class:`Link` connects, checks the broker's credentials and says hello. Its reader thread hands each message
on: a reply wakes the request waiting for it (by id), a call from another member goes to :attr:`Link.calls`
for the serve loop (``_calls.py``), a peer's death is recorded and passed to the callbacks. When the broker
goes, every request waiting and the serve loop are woken with the reason, and later sends raise it. Every
wait is bounded; :meth:`Link.close` leaves no thread in a read.
"""

from __future__ import annotations

import itertools
import os
import queue
import socket
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from . import wire
from ._outcomes import PeerLostError

__all__ = ["Link"]


class Link:
    """The connection of one member to the broker at ``path``.

    Args:
        path: the broker's socket.
        hello: the first message (role and name); its reply is :attr:`hello`.
        timeout: the bound, in seconds, of the connect and of the hello's reply.
        report: what every message after the hello carries (the member's holdings and the device's memory).
        thread_name: the reader thread's name.

    Raises:
        ConnectionError: no broker listens at ``path``.
        wire.PeerRefusedError: the broker runs as another user.
        RuntimeError: the broker refused the hello.
    """

    def __init__(
        self,
        path: Path,
        hello: dict[str, Any],
        *,
        timeout: float,
        report: Callable[[], dict[str, Any]],
        thread_name: str,
    ) -> None:
        self.path = path
        self._report = report
        self._ids = itertools.count(1)
        self._waiting: dict[int, list[Any]] = {}  # request id -> [event, (msg, fds) or exception]
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        # Calls from other members, for the serve loop; None once the broker is gone.
        self.calls: queue.Queue[tuple[dict[str, Any], list[int]] | None] = queue.Queue()
        self.lost: Exception | None = None
        self.lost_peers: list[dict[str, Any]] = []
        self.on_lost: list[Callable[[dict[str, Any]], None]] = []
        self._sock = wire.connect(path, timeout=timeout)
        try:
            self.broker_pid, _ = wire.check_peer(self._sock)
            self._reader = threading.Thread(target=self._read, name=thread_name, daemon=True)
            self._reader.start()
            self.hello: dict[str, Any] = self.request(hello, wait=timeout)
        except BaseException:
            self._sock.close()
            raise

    def send(self, msg: dict[str, Any], fds: list[int] | tuple[int, ...] = ()) -> None:
        """Send ``msg`` with ``fds`` (one sender at a time).

        Raises:
            PeerLostError: the broker is gone (or ``wire.PeerRefusedError``, if it refused this process).
        """
        if self.lost is not None:
            raise self.lost
        try:
            with self._send_lock:
                wire.send(self._sock, msg, fds)
        except OSError as e:
            self._reader.join(1.0)  # it may know why (a refusal it was sent)
            raise self.lost or PeerLostError(f"the broker at {self.path} is gone: {e}") from e

    def request(
        self,
        msg: dict[str, Any],
        *,
        wait: float,
        fds: list[int] | tuple[int, ...] = (),
        with_fds: bool = False,
    ) -> Any:
        """Send ``msg`` (with the report, but for a hello) and wait up to ``wait`` seconds for its reply: the
        reply, or ``(reply, fds)`` with ``with_fds`` (else the descriptors that came back are closed).

        Raises:
            TimeoutError: no reply within ``wait``.
            PeerLostError: the broker went away meanwhile.
            RuntimeError: the broker refused the request (a bad hello, a protocol error).
        """
        rid = next(self._ids)
        slot: list[Any] = [threading.Event(), None]
        with self._lock:
            self._waiting[rid] = slot
        try:
            payload = {**msg, "id": rid} if msg.get("op") == "hello" else {**msg, "id": rid, **self._report()}
            self.send(payload, fds)
            if not slot[0].wait(wait):
                raise TimeoutError(f"the broker did not answer {msg.get('op')!r} within {wait:g} s")
        finally:
            with self._lock:
                self._waiting.pop(rid, None)
        got = slot[1]
        if isinstance(got, BaseException):
            raise got
        reply, rfds = got
        if with_fds:
            return reply, rfds
        for fd in rfds:
            os.close(fd)
        if not reply.get("ok", False) and reply.get("error") in ("hello", "protocol", "refused"):
            raise RuntimeError(f"the broker at {self.path} refused {msg.get('op')!r}: {reply.get('message')}")
        return reply

    def close(self) -> None:
        """Shut the socket, wait for the reader to end (unless this is the reader), and close it."""
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        if self._reader is not threading.current_thread():
            self._reader.join(5.0)  # it sees the shutdown and ends: no thread left in a read at exit
        self._sock.close()

    def _read(self) -> None:
        err: Exception | None = None
        while True:
            try:
                msg, fds = wire.recv(self._sock, timeout=None)
            except (ConnectionError, OSError) as e:
                err = PeerLostError(f"the broker at {self.path} is gone ({e})")
                break
            except wire.WireError as e:
                err = PeerLostError(f"the broker at {self.path} speaks another protocol: {e}")
                break
            if msg.get("op") == "call":
                self.calls.put((msg, fds))
            elif msg.get("op") == "peer_lost":
                self.lost_peers.append(msg["peer"])
                for fn in self.on_lost:
                    fn(msg["peer"])
            elif msg.get("re") == 0 and msg.get("error") == "refused":
                err = wire.PeerRefusedError(str(msg.get("message")))
                break
            else:
                with self._lock:
                    slot = self._waiting.get(msg.get("re"))
                if slot is None:
                    for fd in fds:
                        os.close(fd)
                    continue
                slot[1] = (msg, fds)
                slot[0].set()
        self.lost = err
        with self._lock:
            for slot in self._waiting.values():
                slot[1] = err
                slot[0].set()
        self.calls.put(None)
