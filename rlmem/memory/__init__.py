"""Device memory that can be paused and resumed at stable addresses, and the host memory behind it.

Owns :class:`Region` (a fixed range of device addresses whose physical memory is released and mapped back,
with its contents kept in a pinned host backup or discarded), the two backends a Region runs on behind one
:class:`~rlmem.memory.backend.Backend` protocol (CUDA virtual memory management through the driver, and a
host backend that runs the same logic on a CPU-only machine), sharing a Region's memory with another
process (:class:`SharedLayout`, ``Region.export`` / ``Region.attach``), and the pinned host buffers and their
accounting. The bottom layer: it imports only :mod:`rlmem.errors` and :mod:`rlmem._units`.
"""

from ._pinned import HostBuffer, host_memory_held
from .backend import Backend
from .region import Handle, Region, RegionStats
from .sharing import SharedLayout

__all__ = ["Backend", "Handle", "HostBuffer", "Region", "RegionStats", "SharedLayout", "host_memory_held"]
