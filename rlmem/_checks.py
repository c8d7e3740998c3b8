"""Argument checks shared by every public entry point: one exception type (``ValueError``) and one message
form per kind of misuse, naming the argument and what is allowed."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

__all__ = ["TAGS", "check_choice", "check_flag", "check_int", "check_sampling", "check_tags"]

# What an engine's wake(tags) takes, in the order it takes them (vLLM's and SGLang's tag names). An engine
# without CUDA graphs of its own to release (rlmem's) has nothing to do for "cuda_graph"; SGLang's are woken
# with "kv_cache" unless named.
TAGS = ("weights", "kv_cache", "cuda_graph")


def check_flag(field: str, value: Any) -> bool:
    """``value`` if it is True or False.

    Raises:
        ValueError: ``"<field> must be True or False, got <value>"``.
    """
    if not isinstance(value, bool):
        raise ValueError(f"{field} must be True or False, got {value!r}")
    return value


def check_int(field: str, value: Any, *, minimum: int = 1) -> int:
    """``value`` if it is an int (not a bool) of at least ``minimum``.

    Raises:
        ValueError: naming ``field`` and the bound.
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{field} must be an integer >= {minimum}, got {value!r}")
    return value


def check_choice(field: str, value: Any, choices: tuple[Any, ...]) -> Any:
    """``value`` if it is one of ``choices`` (and of the same type: ``True`` is not ``1``).

    Raises:
        ValueError: ``"<field> must be one of a, b, c; got <value>"``.
    """
    if value not in choices or not any(type(value) is type(c) for c in choices):
        raise ValueError(f"{field} must be one of {', '.join(map(repr, choices))}; got {value!r}")
    return value


def check_tags(tags: Sequence[str] | None, field: str = "tags") -> list[str] | None:
    """``None`` (everything) or a non-empty list of known :data:`TAGS`, as given.

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


def check_sampling(temperature: Any, top_p: Any) -> None:
    """The one rule for sampling settings, the same in ``rlmem train``, the sampler, ``rlmem serve`` and the
    server clients: ``temperature`` a finite number >= 0 (0: greedy), ``top_p`` a finite number in (0, 1];
    neither a bool.

    Raises:
        ValueError: naming the setting and what is allowed.
    """
    for name, value in (("temperature", temperature), ("top_p", top_p)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"{name} must be a finite number, got {value!r}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0: greedy), got {temperature!r}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")
