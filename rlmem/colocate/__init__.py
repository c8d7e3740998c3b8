"""Trainer and rollout engine in separate processes on one GPU (seed 001's co-card).

Owns what two processes share and how they hand the device over:

- the rollout weights a trainer keeps in a shareable Region, laid out by parameter name, which a rollout
  process maps and runs its model on (:class:`SharedWeights`, :func:`attach_weights`): a weight sync is the
  trainer's in-place cast-copy, nothing travels;
- the device-wide ledger and grant (:class:`Broker`), each process's seat at it (:class:`Member`: fenced
  ``release``, admitted ``acquire``, calls), and the rollout process as an engine of the trainer's
  ``PhaseManager`` (:class:`PeerEngine`, :func:`serve_engine`); an inference server as one
  (:class:`RemoteEngine`: rlmem's, vLLM's or SGLang's endpoints over HTTP, its sleep fenced);
- how they talk (:mod:`~rlmem.colocate.wire`: framed, versioned messages with descriptors over a Unix socket
  in a private directory, peers checked by their credentials).

Imports :mod:`rlmem.memory`, nothing above it.
"""

from . import wire
from .broker import Broker, default_path
from .member import Fence, FenceError, Grant, Member, PeerLostError, RemoteError, describe
from .peer import EngineSeat, PeerEngine, serve_engine
from .remote import FLAVORS, RemoteEngine
from .weights import AttachedWeights, SharedWeights, attach_weights

__all__ = [
    "FLAVORS",
    "AttachedWeights",
    "Broker",
    "EngineSeat",
    "Fence",
    "FenceError",
    "Grant",
    "Member",
    "PeerEngine",
    "PeerLostError",
    "RemoteEngine",
    "RemoteError",
    "SharedWeights",
    "attach_weights",
    "default_path",
    "describe",
    "serve_engine",
    "wire",
]
