"""Activation memory of the training step: the tensors autograd saves, offloaded to host memory per module
name (Megatron-Core's names) or under a measured budget, and activation checkpointing of chosen decoder
layers. Owns the saved-tensor scopes and hooks, the copy streams and host pool, budget planning from a
measured step, checkpointing, and the module maps that find those names in a model. Imports
:mod:`rlmem.memory` (pinned host memory) and nothing above it.
"""

from .checkpointing import CheckpointHandle, checkpoint
from .modmap import NAMES, ModuleMap
from .offloader import ActivationOffloader, ActivationStats, offload_activations

__all__ = [
    "NAMES",
    "ActivationOffloader",
    "ActivationStats",
    "CheckpointHandle",
    "ModuleMap",
    "checkpoint",
    "offload_activations",
]
