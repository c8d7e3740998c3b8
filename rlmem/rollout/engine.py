"""The rollout engine protocol (:class:`Engine`), and calling engines by its levels and tags, or engines that
only have bare methods.

An engine's ``wake`` takes ``tags`` (a subset of :data:`TAGS`: ``"weights"``, then ``"kv_cache"``) and its
``sleep`` a ``level`` (1: weights kept in host memory, KV cache discarded; 2: both discarded, the weights
synced again on waking), as vLLM's ``sleep(level)`` / ``wake_up(tags)`` and SGLang's
``release_memory_occupation(tags)`` / ``resume_memory_occupation(tags)`` do. An engine with bare
``sleep()`` / ``wake()`` is woken whole, once.

What every engine's ``generate`` takes is settled here too, once for the recipe, the sampler, the server and
the server clients: :class:`Sampling` (``max_new_tokens``, ``temperature``, ``top_p``, validated by
:func:`~rlmem._checks.check_sampling`), and :func:`generation_length`, the one default of the generation
length.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from .._checks import TAGS, check_int, check_sampling, check_tags
from .._section import Section

__all__ = [
    "DEFAULT_MAX_NEW_TOKENS",
    "TAGS",
    "Engine",
    "Sampling",
    "check_tags",
    "generation_length",
    "sleep",
    "takes",
]

DEFAULT_MAX_NEW_TOKENS = 256
"""The generation length where none is given, at most: the recipe's, ``RemoteEngine``'s and the server's."""


def generation_length(max_new_tokens: int | None, *, room: int | None = None) -> int:
    """The tokens a generation may add: ``max_new_tokens`` as given (an int >= 1), or where it is None,
    :data:`DEFAULT_MAX_NEW_TOKENS`, at most ``room`` (what the caller knows fits: the server's cache length
    less the longest prompt, the task's longest answer).

    Raises:
        ValueError: ``max_new_tokens`` not None nor an int >= 1; ``room`` < 1 where it decides.
    """
    if max_new_tokens is not None:
        return check_int("max_new_tokens", max_new_tokens)
    if room is None:
        return DEFAULT_MAX_NEW_TOKENS
    return min(DEFAULT_MAX_NEW_TOKENS, check_int("room", room))


@dataclass(kw_only=True)
class Sampling(Section):
    """How a rollout samples: the keys ``max_new_tokens``, ``temperature`` and ``top_p`` of ``rlmem train``,
    defined, defaulted and validated here once, and handed whole to the engine's ``generate``.

    Args:
        max_new_tokens: completion limit; None: :func:`generation_length`'s default (at most 256; the
            embedded task: its answer's length plus two).
        temperature: a finite number >= 0; 0 samples greedily (in GRPO every completion of a group is then
            the same and every advantage 0).
        top_p: the nucleus, in (0, 1].

    Raises:
        ValueError: naming the key.
    """

    max_new_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if self.max_new_tokens is not None:
            generation_length(self.max_new_tokens)
        check_sampling(self.temperature, self.top_p)

    def generate_kwargs(self, *, room: int | None = None) -> dict[str, Any]:
        """The keyword arguments of an engine's ``generate``: the generation length resolved (``room``: see
        :func:`generation_length`), the temperature and the nucleus."""
        length = generation_length(self.max_new_tokens, room=room)
        return {"max_new_tokens": length, "temperature": self.temperature, "top_p": self.top_p}


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
