"""``rlmem.integrations.hf``: where :class:`~rlmem.rollout.HFSampler` was first published; the sampler is
rlmem's own rollout engine and lives in :mod:`rlmem.rollout` (this name keeps working)."""

from ..rollout.sampler import HFSampler, kv_bytes_per_token

__all__ = ["HFSampler", "kv_bytes_per_token"]
