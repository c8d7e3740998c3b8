"""rlmem: give GPU memory back between the phases of co-located RL post-training, and take it again fast.

Public API:
    Region: a fixed range of device addresses whose physical memory can be paused and resumed.
    TrainState: a model's parameters, gradients and optimizer states adopted into Regions, offloadable.
    OffloadConfig, PhaseManager: rollout/train switching with one flag; engines with sleep()/wake().
    Handle, RegionStats: what ``Region.pause`` / ``Region.resume`` / ``Region.stats`` return.
    OutOfMemoryError, HostOutOfMemoryError, RegionClosedError, CudaError: errors.
    MemoryTimeline, MemoryLeakWarning: memory over time by phase and category, with leak detection.
    host_memory_held: bytes of host backup memory rlmem holds.
    offload_activations, ActivationOffloader: per-module activation offloading (names as Megatron-Core's),
        by hand or under a measured budget.
    checkpoint, CheckpointHandle: activation checkpointing of chosen decoder layers (inputs offloaded when
        combined with offload_activations).
    ModuleMap: module-path patterns for models whose layout rlmem does not recognise.
    comm: suspend(), resume(), memory_stats() of NCCL communicator memory, keeping the process groups.
    estimate_memory, recommend, ModelShape, Workload, PlanOptions, Hardware, MemoryEstimate: the memory
        planner behind ``rlmem plan`` (what a step and a rollout take, which options make them fit).
    token_budget_batches: variable-length sequences into micro-batches under a token budget, the same
        number per data-parallel rank, work balanced.
"""

from . import comm
from .activations import ActivationOffloader, CheckpointHandle, ModuleMap, checkpoint, offload_activations
from .data import token_budget_batches
from .errors import CudaError, HostOutOfMemoryError, OutOfMemoryError, RegionClosedError
from .memory import Handle, Region, RegionStats
from .memory._pinned import host_memory_held
from .monitor import MemoryLeakWarning, MemoryTimeline
from .plan import Hardware, MemoryEstimate, ModelShape, PlanOptions, Workload, estimate_memory, recommend
from .train import Engine, OffloadConfig, PhaseManager, TrainState

__version__ = "0.1.0"

__all__ = [
    "ActivationOffloader",
    "CheckpointHandle",
    "CudaError",
    "Engine",
    "Handle",
    "Hardware",
    "HostOutOfMemoryError",
    "MemoryEstimate",
    "MemoryLeakWarning",
    "MemoryTimeline",
    "ModelShape",
    "ModuleMap",
    "OffloadConfig",
    "OutOfMemoryError",
    "PhaseManager",
    "PlanOptions",
    "Region",
    "RegionClosedError",
    "RegionStats",
    "TrainState",
    "Workload",
    "__version__",
    "checkpoint",
    "comm",
    "estimate_memory",
    "host_memory_held",
    "offload_activations",
    "recommend",
    "token_budget_batches",
]
