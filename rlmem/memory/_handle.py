"""The completion of a Region's pause, resume or backup reservation: :class:`Handle`, and what completes it.

Owns the handle a caller waits on, the worker thread a non-blocking operation runs on (its failure kept on
the handle, to be raised by ``wait()``), and the joining of a finished worker before the Region starts its
next operation (a failure nobody waited for is warned about then, not lost). Which operation is in flight
is the Region's to know, under its lock; this module only runs and finishes one.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = ["Handle", "finish", "note_copies", "worker"]


class Handle:
    """Completion of a :meth:`Region.pause` or :meth:`Region.resume`.

    ``wait()`` makes the result usable by the caller: after a pause the memory has been released; after a
    resume the caller's current CUDA stream (or ``stream``) is ordered after the copies, without blocking
    the host, so work queued before it overlaps the copy. ``synchronize()`` blocks the host until all of it
    is done. A failure inside a non-blocking operation is raised by ``wait()`` and ``synchronize()``.
    ``wait_copied()`` orders a stream after a pause's copies to the backup (not its release).
    """

    def __init__(
        self,
        kind: str,
        *,
        thread: threading.Thread | None = None,
        event: Any = None,
        device: torch.device | None = None,
    ) -> None:
        self.kind = kind
        self._thread = thread
        self._event = event
        self._device = device
        self.error: BaseException | None = None
        self.observed = False
        self._copied: Any = None  # a pause's last copy to the backup (CUDA event), while it may be pending

    def done(self) -> bool:
        """True once the operation has completed (never blocks)."""
        if self._thread is not None and self._thread.is_alive():
            return False
        return self._event is None or bool(self._event.query())

    def _join(self) -> None:
        if self._thread is not None:
            self._thread.join()
        if self.error is not None:
            self.observed = True
            raise self.error

    def wait(self, stream: torch.cuda.Stream | None = None) -> None:
        """Order ``stream`` (default: the current stream) after the operation; see the class docstring."""
        self._join()
        if self._event is not None:
            (stream or torch.cuda.current_stream(self._device)).wait_event(self._event)

    def wait_copied(self, stream: torch.cuda.Stream | None = None) -> None:
        """After a pause: order ``stream`` (default: the current stream) after its copies to the host backup,
        without blocking the host. Work queued on it from then on that reads
        ``region.host_view(t, mapped=True)`` sees the kept bytes, while the release goes on in the background.
        On the host backend the copies are done when ``pause()`` returns."""
        if self._copied is not None:
            (stream or torch.cuda.current_stream(self._device)).wait_event(self._copied)

    def synchronize(self) -> None:
        """Block the host until the operation is complete."""
        self._join()
        if self._event is not None:
            self._event.synchronize()

    def __repr__(self) -> str:
        return f"<rlmem.Handle {self.kind} {'done' if self.done() else 'pending'}>"


def note_copies(handle: Handle, event: Any) -> None:
    """Give a pause's ``handle`` the token of its last copy to the backup, for ``wait_copied()``; None once
    the memory is released (the copies are done by then, and the event need not be held)."""
    handle._copied = event


def worker(
    handle: Handle,
    fn: Callable[..., Any],
    args: Sequence[Any],
    *,
    setup: Callable[[], None],
    name: str,
) -> threading.Thread:
    """A thread, not started yet, that runs ``setup()`` then ``fn(*args)`` and completes ``handle``: its
    failure is kept as ``handle.error``. The caller records ``handle`` as its operation in flight before
    starting the thread, so the record exists whatever the thread does."""
    thread = threading.Thread(target=_run, args=(handle, setup, fn, *args), name=name, daemon=True)
    handle._thread = thread
    return thread


def _run(handle: Handle, setup: Callable[[], None], fn: Callable[..., Any], *args: Any) -> None:
    try:
        setup()
        fn(*args)
    except BaseException as e:
        handle.error = e


def finish(op: Handle, region_name: str) -> None:
    """Join ``op``'s worker; if it failed and nobody waited for the handle, warn (once) rather than lose it.

    Called from ``Region._settle``, itself called by the Region's public method: ``stacklevel=4`` points the
    warning at the line that called that method."""
    if op._thread is not None:
        op._thread.join()
    if op.error is not None and not op.observed:
        op.observed = True
        warnings.warn(
            f"a non-blocking {op.kind}() of region {region_name!r} failed and nobody waited for it: "
            f"{op.error!r}; the region's chunks are left in a consistent state",
            RuntimeWarning,
            stacklevel=4,
        )
