"""Trainer and rollout engine in separate processes on one GPU: process coordination and shared tensors.

Owns what two processes share and how they hand the device over:

- the rollout weights a trainer keeps in a shareable Region, laid out by parameter name, which a rollout
  process maps and runs its model on (:class:`SharedWeights`, :func:`attach_weights`): a weight sync is the
  trainer's in-place cast-copy, nothing travels;
- the device-wide ledger and grant (:class:`Broker`), each process's seat at it (:class:`Member`: fenced
  ``release``, admitted ``acquire``, calls);
- how they talk (:mod:`~rlmem.colocate.wire`: framed, versioned messages with descriptors over a Unix socket
  in a private directory, peers checked by their credentials).

The engines that drive another process (``PeerEngine``, ``EngineSeat``, ``serve_engine``, ``RemoteEngine``)
live in :mod:`rlmem.rollout.remote`, on a floor above this one.

Imports :mod:`rlmem.memory`, nothing above it.
"""

from . import wire
from .broker import Broker, default_path
from .member import Fence, FenceError, Grant, Member, PeerLostError, RemoteError, describe
from .weights import AttachedWeights, SharedWeights, attach_weights

__all__ = [
    "AttachedWeights",
    "Broker",
    "Fence",
    "FenceError",
    "Grant",
    "Member",
    "PeerLostError",
    "RemoteError",
    "SharedWeights",
    "attach_weights",
    "default_path",
    "describe",
    "wire",
]
