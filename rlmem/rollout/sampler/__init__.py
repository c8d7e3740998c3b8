"""rlmem's own sampler, in the trainer's process: :class:`HFSampler`, a batched sampler for Hugging Face
causal LMs.

- ``hf.py``: the sampler (its engine protocol, weights, generate);
- ``_cache.py``: the KV cache, a Region; ``_graphs.py``: decoding under CUDA graphs over length buckets;
- ``_generate.py``: generation one batch at a time or kept full (``_slots.py``), sampling (``_sampling.py``);
- ``_weights.py``: the rollout copy and the FSDP twin;
- ``_prefix.py``: a group's prompt held once (``share_prompts``): the prompt pool and each row's own columns
  in the cache's Region, decode attention over both merged by log-sum-exp;
- the kernels: the grouped decode (``_gqa.py``), fused QKV and MLP (``_qkv.py``, ``_fused.py``), mixtures of
  experts (``_experts.py``);
- ``config.py``: its settings as one config (:class:`SamplerConfig`).

Names are loaded on first use: importing the package loads neither torch nor transformers.
"""

from __future__ import annotations

from ..._lazy import lazy_names

_WHERE = {
    "HFSampler": ".hf",
    "kv_bytes_per_token": ".hf",
    "SamplerConfig": ".config",
    "kv_batch": ".config",
    "kv_batch_shared": ".config",
    "kv_rows": ".config",
    "shared_layout": ".config",
}

__all__ = sorted(_WHERE)

__getattr__ = lazy_names(__name__, _WHERE)


def __dir__() -> list[str]:
    return sorted(__all__)
