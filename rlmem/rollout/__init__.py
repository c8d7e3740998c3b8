"""Rollout engines: what samples the policy's completions, in this process or in another one.

- :class:`Engine` (``engine.py``): the protocol ``PhaseManager`` drives, ``sleep(level)`` / ``wake(tags)``,
  as vLLM's and SGLang's engines have it;
- :mod:`~rlmem.rollout.sampler`: rlmem's own batched sampler for Hugging Face causal LMs
  (:class:`HFSampler`, its settings :class:`SamplerConfig`), its KV cache a Region, decoding under CUDA
  graphs;
- :mod:`~rlmem.rollout.remote`: engines that drive another process: :class:`RemoteEngine` (rlmem's, vLLM's
  or SGLang's server over HTTP, one module per server chosen by flavor), :class:`PeerEngine` (a rollout
  process on the same GPU, reached through the broker; :class:`EngineSeat` and :func:`serve_engine` on its
  side), :class:`ServerRollout` (``rlmem train engine=server``'s ``rlmem serve`` per rank).

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
    "SamplerConfig": ".sampler",
    "kv_bytes_per_token": ".sampler",
    "EngineSeat": ".remote",
    "PeerEngine": ".remote",
    "serve_engine": ".remote",
    "FLAVORS": ".remote",
    "RemoteEngine": ".remote",
    "EngineLostError": ".remote",
    "ServerRollout": ".remote",
}

__all__ = sorted(_WHERE)


__getattr__ = lazy_names(__name__, _WHERE)


def __dir__() -> list[str]:
    return sorted(__all__)
