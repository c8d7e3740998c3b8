"""Moved to :mod:`rlmem.rollout.remote`: the names of ``rlmem.rollout.http_engine`` resolve from here
for one release, each with a ``DeprecationWarning`` naming its new place."""

from __future__ import annotations

from .._lazy import moved_names

__getattr__ = moved_names(
    __name__,
    {
        "FLAVORS": "rlmem.rollout.remote.base",
        "RemoteEngine": "rlmem.rollout.remote.base",
        "PAUSE_MODES": "rlmem.rollout.remote.vllm",
    },
)
