"""Rollout engines: what samples the policy's completions, in this process or in another one.

- :class:`Engine` (``engine.py``): the protocol ``PhaseManager`` drives, ``sleep(level)`` / ``wake(tags)``,
  as vLLM's and SGLang's engines have it;
- :class:`HFSampler` (``sampler.py``): rlmem's own batched sampler for Hugging Face causal LMs, its KV cache
  a Region (``_cache``), decoding under CUDA graphs over length buckets (``_graphs``); beside it the rollout
  copy and the FSDP twin (``_weights``), generation one batch at a time or kept full (``_generate``,
  ``_slots``), sampling (``_sampling``) and its kernels (``_gqa``, ``_qkv``, ``_fused``); its settings as
  one config (:class:`SamplerConfig`, ``config.py``);
- engines that drive another process: :class:`PeerEngine` (``process_engine.py``: a rollout process on the
  same GPU, reached through the broker; :class:`EngineSeat` and :func:`serve_engine` on its side),
  :class:`RemoteEngine` (``http_engine.py``: rlmem's, vLLM's or SGLang's server over HTTP),
  :class:`ServerRollout` (``server_rollout.py``: ``rlmem train engine=server``'s ``rlmem serve`` per rank).

Imports :mod:`rlmem.memory`, :mod:`rlmem.plan` and :mod:`rlmem.colocate` (process coordination and shared
tensors); :mod:`rlmem.train` imports the protocol from here. Names are loaded on first use, so the
protocol does not bring the sampler in.
"""

from __future__ import annotations

from .._lazy import lazy_names

_WHERE = {
    "TAGS": ".engine",
    "Engine": ".engine",
    "HFSampler": ".sampler",
    "SamplerConfig": ".config",
    "kv_bytes_per_token": ".sampler",
    "EngineSeat": ".process_engine",
    "PeerEngine": ".process_engine",
    "serve_engine": ".process_engine",
    "FLAVORS": ".http_engine",
    "RemoteEngine": ".http_engine",
    "EngineLostError": ".server_rollout",
    "ServerRollout": ".server_rollout",
}

__all__ = sorted(_WHERE)


__getattr__ = lazy_names(__name__, _WHERE)


def __dir__() -> list[str]:
    return sorted(__all__)
