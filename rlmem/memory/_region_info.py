"""What a :class:`~rlmem.memory.region.Region` reports about itself: its size, device and chunking, the bytes
handed out, mapped, committed and backed up, whether it is paused or closed, and :class:`RegionStats`.

The Region's base classes, and nothing else: this one declares the Region's state, once for both (set by
``Region._build``, changed under its lock; see ``region.py``), and reads it; ``_shared_region.SharedRegion``
builds on it.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from . import _chunks as table
from ._pinned import HostBuffer
from ._stats import RegionStats, Timings
from .backend import Backend

__all__ = ["RegionInfo"]


class RegionInfo:
    """The state of :class:`~rlmem.memory.region.Region` (its base class, through ``SharedRegion``), its
    properties, ``repr`` and :meth:`stats`."""

    # The Region's state, for these properties and SharedRegion's methods (set by Region._build).
    name: str
    _lock: threading.RLock
    _device: torch.device
    _backend: Backend
    _nbytes: int
    _chunk: int
    _chunks: list[Any]
    _state: list[Any]
    _shareable: bool
    _peer: bool
    _generation: int
    _used: int
    _paused: bool
    _closed: bool
    _ptr: int
    _backup: HostBuffer | None
    _timings: Timings

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def nbytes(self) -> int:
        """Size of the range in bytes (after rounding up to the granularity)."""
        return self._nbytes

    @property
    def chunk_bytes(self) -> int:
        return self._chunk

    @property
    def used_bytes(self) -> int:
        """Bytes handed out by :meth:`empty` so far, alignment padding included."""
        return self._used

    @property
    def resident_bytes(self) -> int:
        """Bytes of physical memory currently mapped (falls chunk by chunk during a pause)."""
        return table.resident(self._chunks, self._state)

    @property
    def committed_bytes(self) -> int:
        """Bytes of memory the mapped chunks take now: what pausing gives back to the device. On a GPU, and
        on the plain host backend, :attr:`resident_bytes`; on a shareable host Region, the pages its own
        files hold, which a chunk gets page by page as it is first touched: a chunk mapped but never
        touched (a Region partly written, or resumed after ``pause(keep=False)``) takes none, so shared
        memory will not fall by it. The fences of :mod:`rlmem.colocate` wait for the device to get this
        back, not :attr:`resident_bytes`."""
        return table.committed(self._backend, self._chunks, self._state)

    @property
    def backup_bytes(self) -> int:
        """Bytes of host backup held (kept across cycles so later pauses pin nothing)."""
        b = self._backup
        return b.nbytes if b is not None and b.alive else 0

    @property
    def paused(self) -> bool:
        """True from a ``pause()`` call until the next ``resume()``."""
        return self._paused

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def data_ptr(self) -> int:
        """Address of the start of the range; fixed for the Region's life."""
        return self._ptr

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("paused" if self._paused else "resident")
        return (
            f"Region(name={self.name!r}, device={str(self._device)!r}, nbytes={self._nbytes}, "
            f"used={self._used}, {state})"
        )

    def stats(self) -> RegionStats:
        """A :class:`RegionStats` snapshot."""
        return RegionStats(
            name=self.name,
            device=str(self._device),
            nbytes=self._nbytes,
            chunk_bytes=self._chunk,
            used_bytes=self._used,
            resident_bytes=0 if self._closed else self.resident_bytes,
            backup_bytes=self.backup_bytes,
            paused=self._paused,
            **self._timings.figures(),
        )
