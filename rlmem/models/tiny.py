"""The tiny model rlmem trains without a download: :data:`TINY` (the one tiny shape: ``rlmem train``'s default
model, ``rlmem serve tiny``, the ``qwen2-tiny`` preset, and at half its width the families' test models) and
its character tokenizer, :class:`CharTokenizer` (the toy task's digits). Imports no torch until a model is
built, so ``rlmem train --help`` answers at once.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["FAMILY_TINY", "TINY", "CharTokenizer", "tiny_model"]

# The embedded policy: Qwen2's architecture at a size that learns the toy task on two CPU cores in minutes.
# Its vocabulary is its tokenizer's and its positions are raised to what a run needs (tiny_model); the
# qwen2-tiny preset is this model with a vocabulary of its own.
TINY = dict(
    hidden_size=128,
    num_hidden_layers=2,
    intermediate_size=384,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    tie_word_embeddings=True,
)
# The models of every family that ``rlmem bench families`` and the tests save (benchmarks/assets.FAMILIES):
# TINY's layers and heads at half its width (head dimension 16), with room for 256 positions (chat-templated
# prompts and their completions), each family keeping its own choice of tied embeddings. Apart on purpose:
# the families' recorded runs (bench/results/families-*.json) were measured at these sizes.
FAMILY_TINY = {
    **{k: v for k, v in TINY.items() if k != "tie_word_embeddings"},
    "hidden_size": 64,
    "intermediate_size": 128,
    "max_position_embeddings": 256,
}


def tiny_model(vocab: int, device: Any, dtype: Any, max_len: int = 0) -> Any:
    """A Qwen2 of :data:`TINY` with ``vocab`` tokens and room for ``max_len`` positions, created on ``device``
    and cast to ``dtype``, its weights drawn from torch's global generator (seed it first).

    Example:
        >>> import torch
        >>> model = tiny_model(CharTokenizer().vocab_size, "cpu", torch.float32)
    """
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    conf = {**TINY, "max_position_embeddings": max(TINY["max_position_embeddings"], max_len)}
    with torch.device(device):
        model = Qwen2ForCausalLM(Qwen2Config(**conf, vocab_size=vocab))
    return model.to(dtype)


class CharTokenizer:
    """Characters to ids: PAD 0, BOS 1, EOS 2, then ``=`` and the ten digits.

    Example:
        >>> tok = CharTokenizer()
        >>> tok.decode(tok.encode("301="))
        '301='
    """

    PAD, BOS, EOS = 0, 1, 2
    CHARS = "=0123456789"

    def __init__(self) -> None:
        self._ids = {c: i + 3 for i, c in enumerate(self.CHARS)}
        self._chars = {i: c for c, i in self._ids.items()}

    @property
    def vocab_size(self) -> int:
        return 3 + len(self.CHARS)

    def encode(self, text: str, *, bos: bool = False) -> list[int]:
        """Ids of ``text``; raises ValueError naming the first character outside the vocabulary."""
        out = [self.BOS] if bos else []
        for c in text:
            if c not in self._ids:
                raise ValueError(f"character {c!r} is not in the vocabulary {self.CHARS!r}")
            out.append(self._ids[c])
        return out

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``, stopping at the first EOS; PAD and BOS are skipped."""
        out = []
        for i in ids:
            i = int(i)
            if i == self.EOS:
                break
            if i in self._chars:
                out.append(self._chars[i])
        return "".join(out)
