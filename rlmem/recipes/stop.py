"""Stopping ``rlmem train`` from outside: Ctrl-C (SIGINT), or SIGTERM, which is how SLURM, Kubernetes and
``timeout`` stop a job. Either ends the run as a finished one ends, one step early: the step in flight is
finished, checkpointed, the summary written, and the process exits with ``128 + the signal`` (130, 143), the
status a shell or a scheduler reads as "stopped by that signal". Under torchrun every rank stops after the
same step: each receives the signal (torchrun forwards it), and the ranks agree at the end of every step.

A second Ctrl-C stops at once (someone at a terminal who will not wait). A second SIGTERM changes nothing: a
scheduler may send it more than once (SLURM signals every process of a job step, torchrun then forwards its
own), and what ends a run that cannot wait is its SIGKILL."""

from __future__ import annotations

import contextlib
import signal
import threading
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["SIGNALS", "RunStopped", "StopRequest"]

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class RunStopped(KeyboardInterrupt):
    """The run ended early on signal ``signum``. ``together``: every rank stopped after the same step (so
    they meet once more before they leave); False when a second Ctrl-C stopped this rank where it was."""

    def __init__(self, signum: int, *, together: bool) -> None:
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum
        self.together = together

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name

    @property
    def exit_status(self) -> int:
        """``128 + signum``: what a shell reports for a process the signal ended."""
        return 128 + self.signum


class StopRequest:
    """The stop signals' handlers while a run is in its loop (:meth:`install`, then :meth:`restore`).

    Args:
        say: where the line acknowledging a signal goes.
    """

    def __init__(self, say: Any) -> None:
        self.signum = 0  # the first stop signal received; 0: none
        self._say = say
        self._old: dict[int, Any] = {}

    def install(self) -> None:
        """Handle SIGINT and SIGTERM from now on (in the main thread only: Python runs handlers there)."""
        if threading.current_thread() is threading.main_thread() and not self._old:
            self._old = {s: signal.signal(s, self._handle) for s in SIGNALS}

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signum:
            if signum == signal.SIGINT:
                raise RunStopped(self.signum, together=False)
            return
        self.signum = signum
        again = "Ctrl-C again to stop now" if signum == signal.SIGINT else "checkpoint and summary next"
        # The line may land while the loop itself is printing: the stream refuses a reentrant write, and the
        # request stands without it.
        with contextlib.suppress(RuntimeError):
            self._say(f"\n{signal.Signals(signum).name}: stopping after this step ({again})")

    def agreed(self, rt: Any) -> int:
        """The stop signal any rank received (the highest number where they differ), 0 for none: every rank
        gets the same answer, so they all stop after the same step. A collective: every rank calls it."""
        got = rt.all_reduce(torch.tensor([float(self.signum)]), op=dist.ReduceOp.MAX)
        self.signum = self.signum or int(got.item())  # a rank that received none stops for the others'
        return int(got.item())

    def restore(self) -> None:
        """The handlers that were there before :meth:`install` (idempotent)."""
        for s, h in self._old.items():
            if h is not None:  # None: a handler not set from Python, which cannot be put back
                signal.signal(s, h)
        self._old = {}
