"""Named model presets (random init, no downloads): the 2.47B Qwen2-shaped anchor model
of docs/design.md and small ones.

``qwen2-2.5b``: hidden 2048, 28 layers, MLP 11008, 16 heads / 2 KV heads, vocabulary 151936, tied
embeddings: 2.47B parameters; in bf16 with AdamW that is 4.6 GiB each of parameters and gradients and
9.2 GiB of optimizer state (18.4 GiB). ``qwen2-tiny`` is the embedded tiny model (:data:`.tiny.TINY`) with
a vocabulary of 512; ``mlp-tiny`` needs no ``transformers`` (CPU smoke runs). ``qwen2-1.5b`` is Qwen2-1.5B's
shape, ``smollm2-135m`` SmolLM2-135M's (Llama).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .tiny import TINY

__all__ = ["LLAMA", "PRESETS", "QWEN2", "build", "vocab_size"]

QWEN2 = {
    "qwen2-2.5b": dict(
        hidden_size=2048,
        num_hidden_layers=28,
        intermediate_size=11008,
        num_attention_heads=16,
        num_key_value_heads=2,
        vocab_size=151936,
        tie_word_embeddings=True,
        max_position_embeddings=8192,
    ),
    "qwen2-1.5b": dict(
        hidden_size=1536,
        num_hidden_layers=28,
        intermediate_size=8960,
        num_attention_heads=12,
        num_key_value_heads=2,
        vocab_size=151936,
        tie_word_embeddings=True,
        max_position_embeddings=8192,
    ),
    # the embedded tiny model (tiny.TINY), with a vocabulary and positions of its own: it has no tokenizer
    "qwen2-tiny": {**TINY, "vocab_size": 512, "max_position_embeddings": 512},
}
# Qwen2.5-3B's shape (the 2.5B preset's layers, 36 of them): 3.1B parameters.
QWEN2["qwen2-3b"] = {**QWEN2["qwen2-2.5b"], "num_hidden_layers": 36}
# Qwen2's 2.5B shape with one KV head per query head (as Qwen1.5): 8x the KV cache per token, so a KV budget
# of tens of GiB fills with a rollout that one step can also train on in a benchmark.
QWEN2["qwen2-2.7b-mha"] = {**QWEN2["qwen2-2.5b"], "num_key_value_heads": 16}
# Llama-architecture shapes: SmolLM2-135M's (grouped: 9 query heads over 3 KV heads, head dim 64).
LLAMA = {
    "smollm2-135m": dict(
        hidden_size=576,
        num_hidden_layers=30,
        intermediate_size=1536,
        num_attention_heads=9,
        num_key_value_heads=3,
        vocab_size=49152,
        tie_word_embeddings=True,
        max_position_embeddings=8192,
        rope_theta=100000.0,
    ),
}
PRESETS = (*QWEN2, *LLAMA, "mlp-tiny")


class _MLPLM(nn.Module):
    def __init__(self, vocab: int = 512, dim: int = 128) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.body = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.head = nn.Linear(dim, vocab, bias=False)
        self.vocab = vocab

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> Any:
        logits = self.head(self.embed(input_ids) + self.body(self.embed(input_ids)))
        loss = nn.functional.cross_entropy(logits.float().flatten(0, 1), labels.flatten())
        return type("Out", (), {"loss": loss, "logits": logits})()


def vocab_size(preset: str) -> int:
    shapes = {**QWEN2, **LLAMA}
    return int(shapes[preset]["vocab_size"]) if preset in shapes else 512


def build(preset: str, device: torch.device, dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> nn.Module:
    """A randomly initialised model of ``preset``, created directly on ``device`` in ``dtype``."""
    if preset not in PRESETS:
        raise ValueError(f"preset must be one of {', '.join(PRESETS)}; got {preset!r}")
    torch.manual_seed(seed)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            if preset == "mlp-tiny":
                return _MLPLM()
            try:
                import transformers
            except ImportError as e:
                raise RuntimeError(f"preset {preset!r} needs the 'transformers' package") from e
            if preset in LLAMA:
                return transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA[preset], dtype=dtype))
            return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**QWEN2[preset], torch_dtype=dtype))
    finally:
        torch.set_default_dtype(old)
