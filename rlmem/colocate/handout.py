"""Hands a :class:`~rlmem.colocate.SharedWeights`' layout and memory descriptors to whoever connects to a
Unix socket in a private directory (of this user only), until closed: how an inference server's workers
(vLLM's, through rlmem's weight-transfer backend) map the trainer's shared weights."""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import threading
from pathlib import Path

from . import wire
from .weights import SharedWeights

log = logging.getLogger(__name__)


class Handout:
    """A listener thread serving ``weights``' :meth:`~SharedWeights.export` at :attr:`path`."""

    def __init__(self, weights: SharedWeights) -> None:
        self.weights = weights
        self._dir = Path(tempfile.mkdtemp(prefix="rlmem-weights-"))  # mode 0700
        self.path = str(self._dir / "weights.sock")
        self._sock = wire.listen(self.path)
        self._closed = False
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
