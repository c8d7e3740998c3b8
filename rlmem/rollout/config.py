"""Moved to :mod:`rlmem.rollout.sampler.config`: the names of ``rlmem.rollout.config`` resolve from here
for one release, each with a ``DeprecationWarning`` naming its new place."""

from __future__ import annotations

from .._lazy import moved_names

__getattr__ = moved_names(
    __name__,
    {
        "SamplerConfig": "rlmem.rollout.sampler.config",
        "kv_batch": "rlmem.rollout.sampler.config",
    },
)
