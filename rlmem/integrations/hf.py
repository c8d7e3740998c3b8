"""A rollout engine for Hugging Face causal LMs whose KV cache lives in a Region.

``HFSampler`` samples with ``model.generate`` (temperature, top-p, EOS, max new tokens) into a
``transformers.StaticCache``. The cache's per-layer key and value tensors are re-pointed into one Region, so
``sleep()`` gives the whole cache back to the device (a discarded pause: milliseconds) and ``wake()`` takes it
again at the same addresses. Its size comes from a byte budget, like vLLM's ``gpu_memory_utilization``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from .. import _dtensor
from ..region import Region

__all__ = ["HFSampler", "kv_bytes_per_token"]


def _kv_shape(config: Any) -> tuple[int, int, int]:
    layers = config.num_hidden_layers
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return layers, kv_heads, head_dim


def kv_bytes_per_token(config: Any, dtype: torch.dtype) -> int:
    """Bytes of KV cache one token takes across all layers (keys and values)."""
    layers, kv_heads, head_dim = _kv_shape(config)
    return 2 * layers * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


class HFSampler:
    """Batched sampling from a Hugging Face causal LM into a Region-backed static KV cache.

    Args:
        model: a ``transformers`` causal LM (its config gives the cache's shape).
        max_len: prompt plus completion tokens per sequence.
        batch_size: sequences per generate call; or None to size it from ``kv_budget_bytes``.
        kv_budget_bytes: bytes the cache may take (used when ``batch_size`` is None).
        pad_token_id, eos_token_id: the tokenizer's ids.

    Raises:
        ValueError: a size is not positive, or the budget holds less than one sequence.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        max_len: int,
        batch_size: int | None = None,
        kv_budget_bytes: int | None = None,
        pad_token_id: int,
        eos_token_id: int,
        name: str = "kv-cache",
    ) -> None:
        from transformers import StaticCache

        if not isinstance(max_len, int) or max_len < 2:
            raise ValueError(f"max_len must be an int >= 2, got {max_len!r}")
        param = next(model.parameters())
        dtype, device = param.dtype, param.device
        per_seq = kv_bytes_per_token(model.config, dtype) * max_len
        if batch_size is None:
            if not isinstance(kv_budget_bytes, int) or kv_budget_bytes < per_seq:
                raise ValueError(
                    f"kv_budget_bytes must hold at least one sequence of max_len={max_len} "
                    f"({per_seq} bytes); got {kv_budget_bytes!r}"
                )
            batch_size = kv_budget_bytes // per_seq
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
        self.model = model
        self.max_len = max_len
        self.batch_size = batch_size
        self.pad_token_id = pad_token_id
        self.eos_token_id = eos_token_id
        self.cache = StaticCache(config=model.config, max_cache_len=max_len)
        # One forward step allocates every layer's tensors at this batch size (through the public path, which
        # holds across transformers releases); they are then moved into the Region.
        with torch.no_grad():
            probe = torch.full((batch_size, 1), pad_token_id, dtype=torch.long, device=device)
            model(input_ids=probe, past_key_values=self.cache, use_cache=True)
        tensors = [t for layer in self.cache.layers for t in (layer.keys, layer.values)]
        self.region = Region(
            sum(t.numel() * t.element_size() for t in tensors) + 256 * len(tensors), device, name=name
        )
        for t in tensors:
            flat = self.region.empty(t.numel() * t.element_size(), torch.uint8)
            _dtensor.repoint([t], flat)
        self.cache.reset()
        self.tokens_generated = 0

    @property
    def kv_bytes(self) -> int:
        return self.region.nbytes

    def sleep(self) -> None:
        """Give the KV cache's memory back (its contents are not needed between rollouts)."""
        self.region.pause(keep=False)

    def wake(self) -> None:
        """Take the KV cache's memory again, at the same addresses."""
        self.region.resume()

    @torch.no_grad()
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        generator_seed: int | None = None,
    ) -> list[list[int]]:
        """Completions (token ids, up to and including EOS) for each prompt, in batches of ``batch_size``.

        Raises:
            RuntimeError: the engine is asleep.
            ValueError: a prompt plus ``max_new_tokens`` exceeds ``max_len``.
        """
        if self.region.paused:
            raise RuntimeError("HFSampler is asleep: call wake() before generate()")
        longest = max((len(p) for p in prompts), default=0)
        if longest + max_new_tokens > self.max_len:
            raise ValueError(
                f"a prompt of {longest} tokens plus max_new_tokens={max_new_tokens} exceeds "
                f"max_len={self.max_len}"
            )
        if generator_seed is not None:
            torch.manual_seed(generator_seed)
        device = self.region.device
        out: list[list[int]] = []
        for start in range(0, len(prompts), self.batch_size):
            chunk = list(prompts[start : start + self.batch_size])
            n = len(chunk)
            chunk += [chunk[-1]] * (self.batch_size - n)  # the static cache has a fixed batch
            width = max(len(p) for p in chunk)
            ids = torch.full((self.batch_size, width), self.pad_token_id, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for i, p in enumerate(chunk):  # left padding: every row ends where generation starts
                ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
                mask[i, width - len(p) :] = 1
            self.cache.reset()
            seqs = self.model.generate(
                input_ids=ids.to(device),
                attention_mask=mask.to(device),
                past_key_values=self.cache,
                max_new_tokens=max_new_tokens,
                do_sample=temperature > 0,
                temperature=temperature if temperature > 0 else None,
                top_p=top_p if temperature > 0 else None,
                eos_token_id=self.eos_token_id,
                pad_token_id=self.pad_token_id,
            )
            for row in seqs[:n, width:].tolist():
                if self.eos_token_id in row:
                    row = row[: row.index(self.eos_token_id) + 1]
                out.append(row)
                self.tokens_generated += len(row)
        return out
