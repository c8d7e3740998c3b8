"""The rollout engine protocol (:class:`Engine`), and calling engines by its levels and tags, or engines that
only have bare methods.

An engine's ``wake`` takes ``tags`` (a subset of :data:`TAGS`: ``"weights"``, then ``"kv_cache"``) and its
``sleep`` a ``level`` (1: weights kept in host memory, KV cache discarded; 2: both discarded, the weights
synced again on waking), as vLLM's ``sleep(level)`` / ``wake_up(tags)`` and SGLang's
``release_memory_occupation(tags)`` / ``resume_memory_occupation(tags)`` do. An engine with bare
``sleep()`` / ``wake()`` is woken whole, once.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

from .._checks import TAGS, check_tags

__all__ = ["TAGS", "Engine", "check_tags", "sleep", "takes"]


@runtime_checkable
class Engine(Protocol):
    """A rollout engine sharing the GPU: ``sleep(level)`` gives its device memory back (level 1: weights kept
    in host memory, KV cache discarded; level 2: both discarded, the weights synced again on waking) and
    ``wake(tags)`` takes it again, by tag (:data:`TAGS`: ``"weights"`` then ``"kv_cache"``; None: all).

    An engine with bare ``sleep()`` / ``wake()`` works too: it is woken whole, after the train state is
    offloaded. vLLM maps onto the protocol as ``sleep(level) -> llm.sleep(level=level)`` and ``wake(tags) ->
    llm.wake_up(tags=tags)``; SGLang as ``sleep(level) -> engine.release_memory_occupation()`` and
    ``wake(tags) -> engine.resume_memory_occupation(tags=tags)``.
    """

    def sleep(self, level: int = 1) -> Any: ...

    def wake(self, tags: Sequence[str] | None = None) -> Any: ...


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
    """Put ``engine`` to sleep at ``level``, or whole where its ``sleep()`` takes no level."""
    if takes(engine.sleep, "level"):
        engine.sleep(level=level)
    else:
        engine.sleep()
