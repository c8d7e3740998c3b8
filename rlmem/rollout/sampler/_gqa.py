"""Grouped-query attention for a decode step, reading each KV head once for its group of query heads.

A model with fewer key/value heads than query heads (Llama 3, Qwen2, Qwen3, Mistral, SmolLM2) attends
through ``repeat_kv`` in Hugging Face's SDPA path whenever a mask is given (always while sampling a batch of
different lengths, on transformers releases before it packed decode queries itself): each step copies the
whole cache, expanded to every query head, before attention reads it. At one query position per sequence
the copy is not needed: the ``G`` query heads of one KV head are laid out as ``G`` query positions of that
head (a view, no copy) and one SDPA call over the cache as it is, with the mask broadcast over them,
computes the same attention.

:func:`grouped_decode` puts this in place of ``"sdpa"`` for a model, for the duration of a block: a decode
step (one query position) of a grouped model runs packed; anything else (prefill, models whose heads are
not grouped) runs transformers' own SDPA function unchanged. Registered with transformers' attention and
mask interfaces under :data:`NAME` (the mask is SDPA's), so it is captured into CUDA graphs like any
attention function.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from ..._attention import attending, register

__all__ = ["NAME", "grouped_decode"]

NAME = "rlmem_grouped_decode"


def _attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    groups = int(getattr(module, "num_key_value_groups", 1))
    b, h, q_len, d = query.shape
    mask_ok = attention_mask is None or (attention_mask.dim() == 4 and attention_mask.shape[1] == 1)
    if q_len != 1 or groups == 1 or not mask_ok or dropout or kwargs.get("softcap") is not None:
        return sdpa_attention_forward(
            module,
            query,
            key,
            value,
            attention_mask,
            dropout=dropout,
            scaling=scaling,
            is_causal=is_causal,
            **kwargs,
        )
    # (b, h, 1, d) -> (b, h_kv, G, d): the heads of a group are consecutive, so this is a view
    q = query.reshape(b, h // groups, groups, d)
    out = torch.nn.functional.scaled_dot_product_attention(
        q, key, value, attn_mask=attention_mask, scale=scaling, is_causal=False
    )
    # (b, h_kv, G, d) -> (b, 1, h, d), the layout transformers' attention functions return
    return out.reshape(b, h, 1, d).transpose(1, 2), None


def grouped(model: nn.Module) -> bool:
    """Whether ``model`` attends with SDPA over fewer KV heads than query heads (what the swap applies to)."""
    cfg = getattr(model, "config", None)
    if cfg is None or getattr(cfg, "_attn_implementation", None) not in ("sdpa", NAME):
        return False
    heads = getattr(cfg, "num_attention_heads", None)
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    return bool(heads) and kv < heads


@contextlib.contextmanager
def grouped_decode(model: nn.Module) -> Iterator[bool]:
    """Within the block, ``model``'s decode steps attend without copying the cache (see the module
    docstring). Yields whether the model is grouped; nothing changes for a model that is not."""
    if not grouped(model):
        yield False
        return
    register(NAME, _attention)
    with attending(model.config, NAME):
        yield True
