"""rlmem: give GPU memory back between the phases of co-located RL post-training, and take it again fast.

Public API:
    Region: a fixed range of device addresses whose physical memory can be paused and resumed.
    TrainState: a model's parameters, gradients and optimizer states adopted into Regions, offloadable.
    OffloadConfig, PhaseManager: rollout/train switching with one flag; engines with sleep()/wake().
    Handle, RegionStats: what ``Region.pause`` / ``Region.resume`` / ``Region.stats`` return.
    OutOfMemoryError, HostOutOfMemoryError, RegionClosedError, CudaError: errors.
    MemoryTimeline, MemoryLeakWarning: memory over time by phase and category, with leak detection.
    host_memory_held: bytes of host backup memory rlmem holds.
"""

from ._pinned import host_memory_held
from .errors import CudaError, HostOutOfMemoryError, OutOfMemoryError, RegionClosedError
from .phases import Engine, OffloadConfig, PhaseManager
from .region import Handle, Region, RegionStats
from .state import TrainState
from .timeline import MemoryLeakWarning, MemoryTimeline

__version__ = "0.1.0"

__all__ = [
    "CudaError",
    "Engine",
    "Handle",
    "HostOutOfMemoryError",
    "MemoryLeakWarning",
    "MemoryTimeline",
    "OffloadConfig",
    "OutOfMemoryError",
    "PhaseManager",
    "Region",
    "RegionClosedError",
    "RegionStats",
    "TrainState",
    "__version__",
    "host_memory_held",
]
