"""rlmem: give GPU memory back between the phases of co-located RL post-training, and take it again fast.

Public API:
    Region: a fixed range of device addresses whose physical memory can be paused and resumed.
    Handle, RegionStats: what ``Region.pause`` / ``Region.resume`` / ``Region.stats`` return.
    OutOfMemoryError, HostOutOfMemoryError, RegionClosedError, CudaError: errors.
    host_memory_held: bytes of host backup memory rlmem holds.
"""

from ._pinned import host_memory_held
from .errors import CudaError, HostOutOfMemoryError, OutOfMemoryError, RegionClosedError
from .region import Handle, Region, RegionStats

__version__ = "0.1.0"

__all__ = [
    "CudaError",
    "Handle",
    "HostOutOfMemoryError",
    "OutOfMemoryError",
    "Region",
    "RegionClosedError",
    "RegionStats",
    "__version__",
    "host_memory_held",
]
