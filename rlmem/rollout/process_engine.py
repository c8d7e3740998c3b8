"""Moved to :mod:`rlmem.rollout.remote`: the names of ``rlmem.rollout.process_engine`` resolve from here
for one release, each with a ``DeprecationWarning`` naming its new place."""

from __future__ import annotations

from .._lazy import moved_names

__getattr__ = moved_names(
    __name__,
    {
        "EngineSeat": "rlmem.rollout.remote.peer",
        "PeerEngine": "rlmem.rollout.remote.peer",
        "serve_engine": "rlmem.rollout.remote.peer",
    },
)
