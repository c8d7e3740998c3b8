"""Calling rollout engines by the protocol's levels and tags, and engines that only have bare methods.

An engine's ``wake`` takes ``tags`` (a subset of :data:`TAGS`: ``"weights"``, then ``"kv_cache"``) and its
``sleep`` a ``level`` (1: weights kept in host memory, KV cache discarded; 2: both discarded, the weights
synced again on waking), as vLLM's ``sleep(level)`` / ``wake_up(tags)`` and SGLang's
``release_memory_occupation(tags)`` / ``resume_memory_occupation(tags)`` do. An engine with bare
``sleep()`` / ``wake()`` is woken whole, once.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["TAGS", "check_tags", "sleep", "takes"]

TAGS = ("weights", "kv_cache")


def takes(fn: Callable[..., Any], name: str) -> bool:
    """Whether ``fn`` accepts the keyword argument ``name`` (by name, or through ``**kwargs``)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # builtins without a signature
        return False
    named = (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    anything = inspect.Parameter.VAR_KEYWORD
    return any(p.kind is anything or (p.name == name and p.kind in named) for p in params)


def check_tags(tags: Sequence[str] | None, field: str = "tags") -> list[str] | None:
    """``None`` (everything) or a non-empty list of known tags.

    Raises:
        ValueError: naming ``field`` and the allowed tags.
    """
    if tags is None:
        return None
    if isinstance(tags, str) or not isinstance(tags, (list, tuple)) or not tags:
        raise ValueError(f"{field} must be None or a non-empty list of {', '.join(TAGS)}; got {tags!r}")
    unknown = [t for t in tags if t not in TAGS]
    if unknown:
        raise ValueError(f"{field}: unknown tag(s) {unknown}; allowed: {', '.join(TAGS)}")
    return list(tags)


def sleep(engine: Any, level: int) -> None:
    if takes(engine.sleep, "level"):
        engine.sleep(level=level)
    else:
        engine.sleep()
