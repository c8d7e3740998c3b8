"""The training state between phases: parameters, gradients, optimizer states and buffers adopted into
Regions and offloaded or discarded per category (:class:`TrainState`), the rollout/train switch that drives
it together with NCCL communicators and rollout engines (:class:`PhaseManager`), the re-pointing of every
tensor holder while state is away, and FSDP2/DTensor adoption. Imports :mod:`rlmem.memory` and
:mod:`rlmem.comm`, nothing above them.
"""

from .phases import Engine, OffloadConfig, PhaseManager, PhaseStats, SwitchStats
from .state import CategoryStats, TrainState, TrainStateStats

__all__ = [
    "CategoryStats",
    "Engine",
    "OffloadConfig",
    "PhaseManager",
    "PhaseStats",
    "SwitchStats",
    "TrainState",
    "TrainStateStats",
]
