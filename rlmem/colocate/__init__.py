"""Trainer and rollout engine in separate processes on one GPU (seed 001's co-card).

Owns what two processes share: the rollout weights a trainer keeps in a shareable Region, laid out by
parameter name, which a rollout process maps and runs its model on (:class:`SharedWeights`,
:func:`attach_weights`): a weight sync is the trainer's in-place cast-copy, nothing travels; and how they
talk (:mod:`~rlmem.colocate.wire`: framed, versioned messages with descriptors over a Unix socket in a
private directory, peers checked by their credentials). Imports :mod:`rlmem.memory`, nothing above it.
"""

from . import wire
from .weights import AttachedWeights, SharedWeights, attach_weights

__all__ = ["AttachedWeights", "SharedWeights", "attach_weights", "wire"]
