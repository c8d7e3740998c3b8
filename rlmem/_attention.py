"""rlmem's own attention functions run by transformers' models: each registered once under its name in
transformers' ``AttentionInterface`` (with SDPA's mask function, or none: the model then builds no mask),
and put in force for a block by naming it in the model's config (``config._attn_implementation``), which
every attention module of the model reads at each call."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["attending", "register"]

_registered: set[str] = set()


def register(name: str, fn: Callable[..., Any], *, sdpa_mask: bool = True) -> None:
    """Register ``fn`` under ``name`` (once): with ``sdpa_mask`` the model builds SDPA's mask for it, else
    none."""
    if name in _registered:
        return
    from transformers import AttentionInterface

    AttentionInterface.register(name, fn)
    if sdpa_mask:
        from transformers.masking_utils import AttentionMaskInterface
        from transformers.masking_utils import sdpa_mask as mask

        AttentionMaskInterface.register(name, mask)
    _registered.add(name)


@contextlib.contextmanager
def attending(config: Any, name: str) -> Iterator[str]:
    """Within the block the model of ``config`` attends with the function registered as ``name``; yields
    the implementation in force before, which comes back after."""
    before = config._attn_implementation
    config._attn_implementation = name
    try:
        yield before
    finally:
        config._attn_implementation = before
