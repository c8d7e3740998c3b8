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


class CudaCopies:
    """Copies on dedicated streams of one CUDA device."""

    asynchronous = True

    def __init__(self, device: torch.device) -> None:
        from ..memory import _cuda

        self.device = device
        self._d2h, self._h2d = _cuda.copy_streams(device.index or 0, role="activations")
        self._h2d_fence: torch.cuda.Event | None = None

    def copy_out(self, src: torch.Tensor, host: torch.Tensor) -> torch.cuda.Event:
        """Queue ``src`` (just produced on the current stream) into ``host``; return the copy's event."""
        self._d2h.wait_stream(torch.cuda.current_stream(self.device))
        if self._h2d_fence is not None:
            # The previous step's reloads may still read these host bytes.
            self._d2h.wait_event(self._h2d_fence)
            self._h2d_fence = None
        with torch.cuda.stream(self._d2h):
            host.copy_(src, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self._d2h)
        return done

    def copy_in(self, host: torch.Tensor, buf: torch.Tensor, after: Any) -> torch.cuda.Event:
        """Queue ``host`` into ``buf`` after ``after`` (its copy out) and the work queued so far on the
        current stream (``buf``'s memory may still be read by it); return the copy's event."""
        self._h2d.wait_stream(torch.cuda.current_stream(self.device))
        if after is not None:
            self._h2d.wait_event(after)
        with torch.cuda.stream(self._h2d):
            buf.copy_(host, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(self._h2d)
        return ready

    def order_after(self, event: Any) -> None:
        """Make the current stream wait for ``event`` (no host wait)."""
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

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
        ev.record(torch.cuda.current_stream(self.device))
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
