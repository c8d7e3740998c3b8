"""Moved to :mod:`rlmem.rollout.remote`: the names of ``rlmem.rollout.server_rollout`` resolve from here
for one release, each with a ``DeprecationWarning`` naming its new place."""

from __future__ import annotations

from .._lazy import moved_names

__getattr__ = moved_names(
    __name__,
    {
        "SERVER_CATEGORIES": "rlmem.rollout.remote.server_rollout",
        "EngineLostError": "rlmem.rollout.remote.server_rollout",
        "ServerRollout": "rlmem.rollout.remote.server_rollout",
    },
)
