"""Calling rollout engines by the protocol's levels and tags, and engines that only have bare methods.

An engine's ``wake`` takes ``tags`` (a subset of :data:`TAGS`: ``"weights"``, then ``"kv_cache"``) and its
``sleep`` a ``level`` (1: weights kept in host memory, KV cache discarded; 2: both discarded, the weights
synced again on waking), as vLLM's ``sleep(level)`` / ``wake_up(tags)`` and SGLang's
``release_memory_occupation(tags)`` / ``resume_memory_occupation(tags)`` do. An engine with bare
``sleep()`` / ``wake()`` is woken whole, once.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from .._checks import TAGS, check_tags

__all__ = ["TAGS", "check_tags", "sleep", "takes"]


def takes(fn: Callable[..., Any], name: str) -> bool:
    """Whether ``fn`` accepts the keyword argument ``name`` (by name, or through ``**kwargs``)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # builtins without a signature
        return False
    named = (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    anything = inspect.Parameter.VAR_KEYWORD
    return any(p.kind is anything or (p.name == name and p.kind in named) for p in params)


def sleep(engine: Any, level: int) -> None:
    if takes(engine.sleep, "level"):
        engine.sleep(level=level)
    else:
        engine.sleep()
