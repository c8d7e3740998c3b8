"""Host memory for offloaded activations: slabs allocated once, handed out by a bump pointer, reused.

A step's tensors are packed in order and all released when the step ends, so a bump allocator over a list
of slabs is enough: no per-tensor frees, no fragmentation, and after the first step no allocation at all.
Slabs are :class:`rlmem._pinned.HostBuffer` (page-locked where there is a device), so copies run at the
link's rate and pinning is paid once.
"""

from __future__ import annotations

import torch

from ..memory import HostBuffer

_ALIGN = 512
_MIN_SLAB = 256 << 20
_MAX_SLAB = 4 << 30


class HostPool:
    """Bump allocator over reusable host slabs.

    Args:
        device_index: CUDA device whose copies use the slabs (they are page-locked), or ``None`` for
            pageable slabs (host backend).
        min_slab: smallest slab to allocate, bytes.
    """

    def __init__(self, device_index: int | None, *, min_slab: int = _MIN_SLAB) -> None:
        self._index = device_index
        self._min_slab = min_slab
        self._slabs: list[HostBuffer] = []
        self._slab = 0
        self._offset = 0
        self.used = 0
        self.peak = 0

    @property
    def capacity(self) -> int:
        """Bytes of host memory the pool holds."""
        return sum(s.nbytes for s in self._slabs)

    def reserve(self, nbytes: int) -> None:
        """Make sure at least ``nbytes`` are held in one slab (the planner sizes the pool ahead of a step)."""
        if nbytes > self.capacity:
            self._slabs.append(HostBuffer(_round(nbytes - self.capacity), device_index=self._index))

    def alloc(self, nbytes: int) -> torch.Tensor:
        """A ``uint8`` host tensor of ``nbytes``, valid until :meth:`reset`."""
        size = _round(nbytes)
        while self._slab < len(self._slabs):
            slab = self._slabs[self._slab]
            if self._offset + size <= slab.nbytes:
                assert slab.tensor is not None
                out = slab.tensor[self._offset : self._offset + nbytes]
                self._offset += size
                self.used += size
                self.peak = max(self.peak, self.used)
                return out
            self._slab += 1
            self._offset = 0
        grow = max(size, min(max(self._min_slab, self.capacity), _MAX_SLAB))
        self._slabs.append(HostBuffer(grow, device_index=self._index))
        self._slab = len(self._slabs) - 1
        self._offset = 0
        return self.alloc(nbytes)

    def reset(self) -> None:
        """Hand every slab out again from the start (the previous step's tensors are dead)."""
        self._slab = 0
        self._offset = 0
        self.used = 0

    def free(self) -> None:
        """Give every slab back to the OS."""
        for s in self._slabs:
            s.free()
        self._slabs.clear()
        self.reset()


def _round(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN
