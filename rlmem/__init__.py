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
    colocate: a trainer and a rollout engine in separate processes on one GPU: SharedWeights, the Broker
        (ledger, grant), Member (fenced release, admitted acquire).
    rollout: the rollout engines: the Engine protocol, HFSampler (rlmem's sampler, its KV cache a Region),
        PeerEngine (a rollout process through the broker), RemoteEngine, ServerRollout.
    HFSampler: a batched sampler for Hugging Face causal LMs whose KV cache is a Region.
    RemoteEngine: an inference server (rlmem's, vLLM's or SGLang's endpoints) as a rollout engine;
        ``rlmem serve`` (``rlmem.serve``) is rlmem's, ``rlmem train engine=server`` trains through it.
    integrations: glue to other frameworks (``integrations.trl``: a callback for TRL's GRPOTrainer;
        ``integrations.megatron``; ``integrations.vllm_transfer``), each imported on first use.
    estimate_memory, recommend, ModelShape, Workload, PlanOptions, Hardware, MemoryEstimate: the memory
        planner behind ``rlmem plan`` (what a step and a rollout take, which options make them fit).
    token_budget_batches: variable-length sequences into micro-batches under a token budget, the same
        number per data-parallel rank, work balanced.
"""

import importlib
from typing import Any

from ._lazy import lazy_names

# Imported on first use (PEP 562), so `rlmem --help` and `rlmem train --help` answer without loading torch.
_WHERE = {
    "ActivationOffloader": ".activations",
    "CheckpointHandle": ".activations",
    "ModuleMap": ".activations",
    "checkpoint": ".activations",
    "offload_activations": ".activations",
    "token_budget_batches": ".data",
    "CudaError": ".errors",
    "HostOutOfMemoryError": ".errors",
    "OutOfMemoryError": ".errors",
    "RegionClosedError": ".errors",
    "Handle": ".memory",
    "Region": ".memory",
    "RegionStats": ".memory",
    "host_memory_held": ".memory",
    "MemoryLeakWarning": ".monitor",
    "MemoryTimeline": ".monitor",
    "Hardware": ".plan",
    "MemoryEstimate": ".plan",
    "ModelShape": ".plan",
    "PlanOptions": ".plan",
    "Workload": ".plan",
    "estimate_memory": ".plan",
    "recommend": ".plan",
    "Engine": ".train",
    "OffloadConfig": ".train",
    "PhaseManager": ".train",
    "TrainState": ".train",
    "RemoteEngine": ".rollout",
    "HFSampler": ".rollout",
}


_names = lazy_names(__name__, _WHERE)


def __getattr__(name: str) -> Any:
    if name in ("comm", "colocate", "integrations", "rollout"):
        return importlib.import_module(f".{name}", __name__)
    return _names(name)


def __dir__() -> list[str]:
    return sorted(__all__)


__version__ = "0.1.0"

__all__ = [
    "ActivationOffloader",
    "CheckpointHandle",
    "CudaError",
    "Engine",
    "HFSampler",
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
    "colocate",
    "comm",
    "estimate_memory",
    "host_memory_held",
    "integrations",
    "rollout",
    "offload_activations",
    "recommend",
    "token_budget_batches",
]
