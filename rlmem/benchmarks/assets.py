"""What ``rlmem train model=DIR data=FILE`` needs, made here without any download: a byte-level BPE
tokenizer with a chat template trained in memory, a JSONL of arithmetic questions, and tiny model
directories of the families users train, each saved with ``save_pretrained`` beside the tokenizer.

Used by ``rlmem bench families`` and ``scripts/tiny_assets.py``.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from ..models.tiny import FAMILY_TINY

__all__ = ["FAMILIES", "model_dir", "questions", "text_reward", "tokenizer_and_data"]

TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

# The one tiny shape at the families' size (rlmem.models.tiny.FAMILY_TINY); GPT-NeoX has no KV heads to set.
_GROUPED = FAMILY_TINY
_DECODER = {k: v for k, v in FAMILY_TINY.items() if k != "num_key_value_heads"}
# Mixture-of-experts layers: eight experts, two per token (transformers' defaults are the released models'
# widths: Qwen3-MoE's 128 experts of 768, Qwen2-MoE's 60 of 1408 beside a shared expert of 5632).
_EXPERTS = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)
# family -> (config class, model class, the config's sizes): two layers, four query heads over two KV heads
# where the family groups them, the rest of each config its defaults (Gemma2's sliding window and soft
# caps, Qwen3's query/key norms, Phi-3's fused projections, GPT-2's tied embeddings and learned positions,
# OLMo2's norms after attention and MLP, Gemma3's local and global layers; the experts of Qwen3-MoE, of
# Mixtral, and of Qwen2-MoE beside its gated shared expert, dispatched by transformers' grouped GEMM).
FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", _GROUPED),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", _GROUPED),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(_GROUPED, head_dim=16)),
    "mistral": ("MistralConfig", "MistralForCausalLM", _GROUPED),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(_GROUPED, head_dim=16)),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", _GROUPED),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", dict(n_embd=64, n_layer=2, n_head=4, n_positions=256)),
    "gptneox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", _DECODER),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", _GROUPED),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(_GROUPED, head_dim=16)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(_GROUPED, head_dim=16, **_EXPERTS)),
    "mixtral": (
        "MixtralConfig",
        "MixtralForCausalLM",
        dict(_GROUPED, num_local_experts=8, num_experts_per_tok=2),
    ),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        dict(_GROUPED, shared_expert_intermediate_size=64, **_EXPERTS),
    ),
}


def questions(n: int, seed: int) -> list[dict[str, str]]:
    """``n`` sums of two numbers below 100, with the answer in ``\\boxed{}`` (the ``math`` reward)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        out.append({"prompt": f"What is {a}+{b}? Put the answer in \\boxed{{}}.", "answer": str(a + b)})
    return out


def text_reward(prompt: Any, completion: str, answer: Any) -> float:
    """A reward in [0, 1] that every character of the completion moves (its code points' sum mod 101,
    over 100): a random model earns ``math``'s 0.0 on every sample, so its advantages, losses and
    gradients would all be zero and two runs would agree whatever they sampled. Use it as
    ``reward=rlmem.benchmarks.assets:text_reward``."""
    return (sum(map(ord, completion)) % 101) / 100


def tokenizer_and_data(d: str | Path, rows: int = 512) -> tuple[Path, Path]:
    """A BPE tokenizer trained on the questions (``d/tokenizer``) and the questions (``d/arith.jsonl``)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    d = Path(d)
    d.mkdir(parents=True, exist_ok=True)
    data = questions(rows, 0)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    special = ["<|endoftext|>", "<|pad|>", "<|user|>", "<|assistant|>"]
    trainer = trainers.BpeTrainer(vocab_size=512, special_tokens=special, show_progress=False)
    tok.train_from_iterator([f"{r['prompt']} \\boxed{{{r['answer']}}}" for r in data], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|pad|>")
    fast.chat_template = TEMPLATE
    fast.save_pretrained(str(d / "tokenizer"))
    (d / "arith.jsonl").write_text("".join(json.dumps(r) + "\n" for r in data))
    return d / "tokenizer", d / "arith.jsonl"


def model_dir(family: str, d: str | Path, tokenizer: str | Path, seed: int = 0, **sizes: Any) -> Path:
    """A randomly initialised ``family`` model saved with ``save_pretrained`` in ``d``, the tokenizer beside
    it (its vocabulary size, and its pad and EOS ids in the config); ``sizes`` override the family's
    (``hidden_size=128, num_attention_heads=2``: a head dimension an engine's kernels take).

    Raises:
        ValueError: an unknown family.
    """
    import torch
    import transformers

    if family not in FAMILIES:
        raise ValueError(f"family must be one of {', '.join(FAMILIES)}, got {family!r}")
    cfg_cls, model_cls, base = FAMILIES[family]
    sizes = {**base, **sizes}
    tok = transformers.AutoTokenizer.from_pretrained(str(tokenizer))
    ids = dict(bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    config = getattr(transformers, cfg_cls)(vocab_size=len(tok), **ids, **sizes)
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config)
    transformers.utils.logging.disable_progress_bar()  # one shard of a tiny model: no bar on stderr
    d = Path(d)
    model.save_pretrained(str(d))
    tok.save_pretrained(str(d))
    return d
