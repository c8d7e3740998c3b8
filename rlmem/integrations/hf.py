"""``rlmem.integrations.hf``: where :class:`~rlmem.rollout.HFSampler` was first published. The sampler is
rlmem's own rollout engine and lives in :mod:`rlmem.rollout.sampler`; its names resolve from here for one
more release, each with a ``DeprecationWarning`` naming its place."""

from __future__ import annotations

from .._lazy import moved_names

__getattr__ = moved_names(
    __name__,
    {"HFSampler": "rlmem.rollout.sampler.hf", "kv_bytes_per_token": "rlmem.rollout.sampler.hf"},
)
