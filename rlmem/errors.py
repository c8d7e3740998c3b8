"""Exceptions raised by rlmem."""

from __future__ import annotations

import torch

__all__ = ["CudaError", "HostOutOfMemoryError", "OutOfMemoryError", "RegionClosedError"]


class OutOfMemoryError(torch.OutOfMemoryError):
    """Device memory could not be obtained (a resume, or a new Region).

    A subclass of ``torch.OutOfMemoryError``, so handlers written for PyTorch's OOM catch it too. Whatever the
    failed call had mapped is undone; a paused region stays paused with its kept contents intact, so the call
    can be retried once memory has been freed.

    Attributes:
        needed: bytes the call had to map.
        free: bytes the device reported free when the call failed.
        device: the device, as a string.
    """

    def __init__(self, message: str, *, needed: int = 0, free: int = 0, device: str = "") -> None:
        super().__init__(message)
        self.needed = needed
        self.free = free
        self.device = device


class HostOutOfMemoryError(MemoryError):
    """Host memory for a kept pause (the backup) could not be obtained; nothing was released.

    Attributes:
        needed: bytes of host memory the backup needs.
        available: bytes the host reported available.
    """

    def __init__(self, message: str, *, needed: int = 0, available: int = 0) -> None:
        super().__init__(message)
        self.needed = needed
        self.available = available


class RegionClosedError(RuntimeError):
    """A closed Region was used."""


class CudaError(RuntimeError):
    """A CUDA driver call failed.

    Attributes:
        code: the ``CUresult`` value as an int.
        call: the driver function that failed.
    """

    def __init__(self, call: str, code: int, text: str) -> None:
        super().__init__(f"{call} failed: CUDA error {code} ({text})")
        self.call = call
        self.code = code
