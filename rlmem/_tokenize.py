"""Prompt token ids from a Hugging Face tokenizer, the same under transformers 4.57 and 5: a chat template's
``apply_chat_template(..., tokenize=True)`` returns a list of ids in 4.x and a ``BatchEncoding`` in 5.x
(``return_dict`` became its default), so both are asked for the dict and its ``input_ids`` read."""

from __future__ import annotations

from typing import Any

__all__ = ["chat_ids", "text_ids"]


def chat_ids(tok: Any, conversations: list[list[dict[str, Any]]], **kwargs: Any) -> list[list[int]]:
    """Each conversation through the tokenizer's chat template, the generation prompt added (the template
    writes any BOS itself: transformers tokenizes what it renders without special tokens).

    Args:
        tok: a ``transformers`` tokenizer or processor with a chat template.
        conversations: one list of ``{"role": ..., "content": ...}`` messages per prompt.
        kwargs: passed on to ``apply_chat_template`` (``tools``, ``chat_template``, the template's own).
    """
    out = tok.apply_chat_template(
        conversations, add_generation_prompt=True, tokenize=True, return_dict=True, **kwargs
    )
    rows = out["input_ids"] if hasattr(out, "keys") else out  # a tokenizer that ignores return_dict
    return [[int(i) for i in row] for row in rows]


def text_ids(tok: Any, texts: list[str]) -> list[list[int]]:
    """Each text as the tokenizer's plain call gives it, with its default special tokens (a BOS where the
    tokenizer adds one)."""
    return [[int(i) for i in row] for row in tok(text=texts)["input_ids"]]
