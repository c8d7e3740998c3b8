"""The copies of the activation offloader, one class per backend: device-to-host during forward and
host-to-device during backward, ordered against the compute stream, and the timing the budget mode reads.

On a GPU copies run on two dedicated streams and complete later (an event per copy); on the host backend
they are synchronous memory copies, so CPU-only machines run the same offloader logic for real.
"""

from __future__ import annotations

import time
from typing import Any

import torch

__all__ = ["CudaCopies", "HostCopies", "make_copies"]

# Private to PyTorch but the calls ``torch.cuda.current_stream`` and ``current_device`` make themselves;
# where a build lacks them the public calls stand in.
_get_stream = getattr(torch._C, "_cuda_getCurrentStream", None)
_get_device = getattr(torch._C, "_cuda_getDevice", None)


def _stream_id(index: int) -> int | None:
    return None if _get_stream is None else _get_stream(index)[0]


def _device() -> int:
    return _get_device() if _get_device is not None else torch.cuda.current_device()


class CudaCopies:
    """Copies on dedicated streams of one CUDA device."""

    asynchronous = True

    def __init__(self, device: torch.device) -> None:
        from ..memory import _cuda

        self.device = device
        self.index = device.index if device.index is not None else torch.cuda.current_device()
        self._d2h, self._h2d = _cuda.copy_streams(self.index, role="activations")
        self._h2d_fence: torch.cuda.Event | None = None
        self._cur: torch.cuda.Stream | None = None
        self._cur_id: int | None = None

    # The hot path runs once per offloaded tensor inside the user's forward pass, and on a host that only
    # just keeps ahead of the GPU every microsecond there shows in the step (on the H100, a small GQA
    # model's forward pass is launched in 20-34 ms for 38 ms of kernels). So: the compute stream's object is
    # cached by its id (reading the id costs 0.3 us, building the object 6 us), events are recorded and
    # waited for directly, and the copy stream is made current with ``set_stream`` rather than the
    # ``torch.cuda.stream`` context (18 us, measured on that host).
    def _compute(self) -> torch.cuda.Stream:
        """The device's current stream (the one the forward and backward passes run on)."""
        sid = _stream_id(self.index)
        if sid is None or sid != self._cur_id or self._cur is None:
            self._cur = torch.cuda.current_stream(self.device)
            self._cur_id = self._cur.stream_id
        return self._cur

    def _on(self, stream: torch.cuda.Stream, cur: torch.cuda.Stream, copy: Any) -> torch.cuda.Event:
        """Run ``copy`` with ``stream`` current; return an event after it."""
        if _device() == self.index:
            torch.cuda.set_stream(stream)
            try:
                copy()
            finally:
                torch.cuda.set_stream(cur)
        else:  # another device is current: the context restores both devices' streams
            with torch.cuda.stream(stream):
                copy()
        done = torch.cuda.Event()
        done.record(stream)
        return done

    def copy_out(self, src: torch.Tensor, host: torch.Tensor) -> torch.cuda.Event:
        """Queue ``src`` (just produced on the current stream) into ``host``; return the copy's event."""
        cur = self._compute()
        produced = torch.cuda.Event()
        produced.record(cur)
        d2h = self._d2h
        d2h.wait_event(produced)
        if self._h2d_fence is not None:
            # The previous step's reloads may still read these host bytes.
            d2h.wait_event(self._h2d_fence)
            self._h2d_fence = None
        return self._on(d2h, cur, lambda: host.copy_(src, non_blocking=True))

    def copy_in(self, host: torch.Tensor, buf: torch.Tensor, after: Any) -> torch.cuda.Event:
        """Queue ``host`` into ``buf`` after ``after`` (its copy out) and the work queued so far on the
        current stream (``buf``'s memory may still be read by it); return the copy's event."""
        cur = self._compute()
        queued = torch.cuda.Event()
        queued.record(cur)
        h2d = self._h2d
        h2d.wait_event(queued)
        if after is not None:
            h2d.wait_event(after)
        return self._on(h2d, cur, lambda: buf.copy_(host, non_blocking=True))

    def order_after(self, event: Any) -> None:
        """Make the current stream wait for ``event`` (no host wait)."""
        if event is not None:
            self._compute().wait_event(event)

    @staticmethod
    def done(event: Any) -> bool:
        return event is None or event.query()

    def end_step(self) -> None:
        """Fence the reloads queued so far: the next step's copies out wait for them before reusing host
        bytes."""
        fence = torch.cuda.Event()
        fence.record(self._h2d)
        self._h2d_fence = fence

    def capturing(self) -> bool:
        return torch.cuda.is_current_stream_capturing()

    def allocated(self) -> int:
        return torch.cuda.memory_allocated(self.device)

    def mark(self) -> torch.cuda.Event:
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(self._compute())
        return ev

    @staticmethod
    def elapsed(a: Any, b: Any) -> float:
        return a.elapsed_time(b) / 1e3

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def link_rate(self, host: torch.Tensor) -> float:
        """Measured device-to-host bytes per second into ``host`` (best of 3)."""
        nbytes = host.numel()
        src = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        best = float("inf")
        for _ in range(3):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(self._d2h):
                a.record(self._d2h)
                host.copy_(src, non_blocking=True)
                b.record(self._d2h)
            b.synchronize()
            best = min(best, a.elapsed_time(b) / 1e3)
        return nbytes / max(best, 1e-9)

    def copy_cost(self, host: torch.Tensor, size: int) -> float:
        """Fixed seconds per copy besides its bytes: ``host`` cut into copies of ``size`` bytes, issued
        through :meth:`copy_out` as the offloader does; the longer of the host's time to issue one and the
        device's time to run one."""
        n = host.numel() // size
        src = torch.empty(host.numel(), dtype=torch.uint8, device=self.device)
        self.copy_out(src[:size], host[:size])  # first use of the stream
        torch.cuda.synchronize(self.device)
        a = torch.cuda.Event(enable_timing=True)
        a.record(self._d2h)
        t0 = time.perf_counter()
        for k in range(n):
            self.copy_out(src[k * size : (k + 1) * size], host[k * size : (k + 1) * size])
        issue = (time.perf_counter() - t0) / n
        b = torch.cuda.Event(enable_timing=True)
        b.record(self._d2h)
        b.synchronize()
        return max(issue, a.elapsed_time(b) / 1e3 / n)


class HostCopies:
    """Synchronous copies between host tensors (the host backend)."""

    asynchronous = False

    def __init__(self, device: torch.device) -> None:
        self.device = device

    @staticmethod
    def copy_out(src: torch.Tensor, host: torch.Tensor) -> None:
        host.copy_(src)

    @staticmethod
    def copy_in(host: torch.Tensor, buf: torch.Tensor, after: Any) -> None:
        buf.copy_(host)

    def order_after(self, event: Any) -> None:
        pass

    @staticmethod
    def done(event: Any) -> bool:
        return True

    def end_step(self) -> None:
        pass

    @staticmethod
    def capturing() -> bool:
        return False

    @staticmethod
    def allocated() -> int:
        return 0

    @staticmethod
    def mark() -> float:
        return time.perf_counter()

    @staticmethod
    def elapsed(a: Any, b: Any) -> float:
        return b - a

    def synchronize(self) -> None:
        pass

    def link_rate(self, host: torch.Tensor) -> float:
        nbytes = host.numel()
        src = torch.empty(nbytes, dtype=torch.uint8)
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            host.copy_(src)
            best = min(best, time.perf_counter() - t0)
        return nbytes / max(best, 1e-9)

    @staticmethod
    def copy_cost(host: torch.Tensor, size: int) -> float:
        n = host.numel() // size
        src = torch.empty(host.numel(), dtype=torch.uint8)
        t0 = time.perf_counter()
        for k in range(n):
            host[k * size : (k + 1) * size].copy_(src[k * size : (k + 1) * size])
        return (time.perf_counter() - t0) / n


def make_copies(device: torch.device) -> CudaCopies | HostCopies:
    return CudaCopies(device) if device.type == "cuda" else HostCopies(device)
