"""Hands a :class:`~rlmem.colocate.SharedWeights`' layout and memory descriptors to whoever connects to a
Unix socket in a private directory (of this user only), until closed: how an inference server's workers
(vLLM's, through rlmem's weight-transfer backend) map the trainer's shared weights, and how they tell the
trainer what became of an update.

A peer's first message says what it wants: ``{"op": "attach"}`` gets the layout and the descriptors;
``{"op": "report", "report": {...}}`` leaves a report (a refused update's reason, a verification's result),
kept in :attr:`Handout.reports` for the trainer to read: the server's own error answer carries no reason
(vLLM answers a failed ``/update_weights`` with a bare 500)."""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from . import wire
from .weights import SharedWeights

log = logging.getLogger(__name__)
_FIRST_S = 10.0  # a peer's first message: it sends it as it connects


class Handout:
    """A listener thread serving ``weights``' :meth:`~SharedWeights.export` at :attr:`path`."""

    def __init__(self, weights: SharedWeights) -> None:
        self.weights = weights
        self._dir = Path(tempfile.mkdtemp(prefix="rlmem-weights-"))  # mode 0700
        self.path = str(self._dir / "weights.sock")
        self._sock = wire.listen(self.path)
        self._closed = False
        self.reports: list[dict[str, Any]] = []
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._serve, name="rlmem-weights-handout", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # closed
            try:
                wire.check_peer(conn)
                msg, got = wire.recv(conn, timeout=_FIRST_S)
                for fd in got:
                    os.close(fd)
                if msg.get("op") == "report":
                    with self._cond:
                        self.reports.append(dict(msg.get("report") or {}))
                        self._cond.notify_all()
                    continue
                spec, fds = self.weights.export()
                try:
                    wire.send(conn, {"spec": spec}, fds)
                finally:
                    for fd in fds:
                        os.close(fd)
            except Exception as e:  # a refused or vanished peer: the next one is served all the same
                if not self._closed:
                    log.warning("rlmem: shared weights not handed out at %s: %s", self.path, e)
            finally:
                conn.close()

    def take_reports(self, wait: float = 0.0, *, want: int = 1) -> list[dict[str, Any]]:
        """The reports left since the last call (waiting up to ``wait`` seconds for ``want`` of them)."""
        deadline = time.monotonic() + wait
        with self._cond:
            while len(self.reports) < want and (left := deadline - time.monotonic()) > 0:
                self._cond.wait(left)
            out, self.reports = self.reports, []
        return out

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:  # wakes the accept() the thread waits in
            wire.connect(self.path, timeout=1.0).close()
        except ConnectionError:
            pass
        self._thread.join(timeout=5)
        self._sock.close()
        shutil.rmtree(self._dir, ignore_errors=True)
