"""Engines that drive a rollout engine in another process.

- ``base.py``: :class:`RemoteEngine`, what every server's client shares, and the registry of flavors;
  one module per server: ``rlmem.py`` (``rlmem serve``), ``vllm.py`` (vLLM's server, and the staging of its
  ``ipc`` weight transfer), ``sglang.py`` (SGLang's server, kept clear of the rules that kill it);
- ``peer.py``: :class:`PeerEngine`, a rollout process on the same GPU reached through the broker
  (:class:`EngineSeat` and :func:`serve_engine` on its side);
- ``server_rollout.py``: :class:`ServerRollout`, ``rlmem train engine=server``'s ``rlmem serve`` per rank.

Names are loaded on first use.
"""

from __future__ import annotations

from ..._lazy import lazy_names

_WHERE = {
    "FLAVORS": ".base",
    "RemoteEngine": ".base",
    "engine_class": ".base",
    "RlmemRemote": ".rlmem",
    "VLLMRemote": ".vllm",
    "SGLangRemote": ".sglang",
    "EngineSeat": ".peer",
    "PeerEngine": ".peer",
    "serve_engine": ".peer",
    "EngineLostError": ".server_rollout",
    "SERVER_CATEGORIES": ".server_rollout",
    "ServerRollout": ".server_rollout",
}

__all__ = sorted(_WHERE)

__getattr__ = lazy_names(__name__, _WHERE)


def __dir__() -> list[str]:
    return sorted(__all__)
