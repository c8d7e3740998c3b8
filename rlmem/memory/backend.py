"""The contract between :class:`~rlmem.memory.region.Region` and the memory it manages.

A Region keeps the bookkeeping (chunks, states, backups, errors, threads); a backend does the physical work
on one device. :class:`~rlmem.memory._cuda.CudaBackend` maps and unmaps CUDA physical memory in a reserved
virtual range and copies on two driver streams; :class:`~rlmem.memory._host.HostBackend` does the same with
an anonymous host mapping (``madvise`` to release) and synchronous copies, so CPU-only machines run the
Region's logic for real. "Token" below is whatever a backend uses to order work: CUDA events on a GPU,
``None`` on the host.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch

__all__ = ["Backend"]


@runtime_checkable
class Backend(Protocol):
    """What a Region needs from the memory of one device."""

    kind: str  # "cuda" or "cpu": the device type of the tensors carved from the Region
    asynchronous: bool  # copies and releases complete later than the calls that queue them
    pinned_backup: bool  # backups must be page-locked (registered with the device) for DMA
    granularity: int  # bytes: every chunk's offset and size are multiples of it
    device: torch.device

    @property
    def ptr(self) -> int:
        """The first address of the range (valid after :meth:`open`)."""
        ...

    def open(self, nbytes: int) -> None:
        """Reserve ``nbytes`` of addresses; nothing is backed yet."""
        ...

    def tensor_at(self, offset: int, nbytes: int) -> torch.Tensor:
        """A uint8 tensor with a storage of its own over ``nbytes`` at ``offset`` (mapped already)."""
        ...

    def map(self, offset: int, size: int) -> None:
        """Back ``size`` bytes at ``offset`` with physical memory; undo everything on failure."""
        ...

    def unmap(self, offset: int) -> None:
        """Release the chunk mapped at ``offset``."""
        ...

    def mem_info(self) -> tuple[int, int]:
        """(free, total) bytes of the device."""
        ...

    def reclaim_cache(self) -> None:
        """Give other allocators' cached, unused memory back before a map is retried."""
        ...

    def thread_setup(self) -> None:
        """Prepare a worker thread to issue this backend's calls."""
        ...

    def order(self, extra: Any = None) -> Any:
        """A token for the work queued so far on the caller's stream (and ``extra``)."""
        ...

    def wait(self, token: Any) -> None:
        """Block the host until the work behind ``token`` has completed."""
        ...

    def begin_out(self, after: Any) -> None:
        """Order the device-to-host copies queued next after ``after``."""
        ...

    def copy_out(self, offset: int, size: int, host: torch.Tensor) -> Any:
        """Queue a copy of ``size`` bytes at ``offset`` into ``host``; return its completion token."""
        ...

    def copy_in(self, offset: int, size: int, host: torch.Tensor) -> None:
        """Queue a copy of ``host`` into ``size`` bytes at ``offset``."""
        ...

    def mark_in(self, timing: bool = False) -> Any:
        """A token after the host-to-device copies queued so far."""
        ...

    def synchronize(self) -> None:
        """Block until all work on the device has completed."""
        ...

    def close(self) -> None:
        """Release every mapped chunk; the address range stays reserved."""
        ...

    def destroy(self) -> None:
        """Release every chunk and the address range (only when nothing views it)."""
        ...
