"""Fused elementwise pieces of a Llama-family decoder layer for rollout decoding.

At decode batch sizes a step's GEMMs and attention read the weights and the KV cache at close to the
device's bandwidth, but Hugging Face's RMSNorm (8 kernels), rotary embedding (10) and SiLU gate (2) launch
~20 tiny kernels per layer that each take a few microseconds: on the 2.7B Qwen2 shape at batch 64 they were
a third of a CUDA-graph step (H100, ``bench/NOTES.md``). ``fused(model)`` swaps them, for the duration of a
forward pass, for the same arithmetic written as one function each and compiled by ``torch.compile``
(Inductor emits one kernel per function; shapes dynamic, so batch and length buckets share the compiled
code). Off a CUDA device the functions run uncompiled, op for op what the model runs itself.

Only modules whose classes are known to compute exactly this are touched: the RMSNorm and MLP of Llama,
Mistral, Qwen2 and Qwen3 (a SiLU gate), and the ``apply_rotary_pos_emb`` of their attention modules'
source files; anything else runs as it is. The swap is undone on leaving, so training never sees it
(unless it runs in another thread during a rollout: the rotary function is swapped in its module).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

_NORMS = {"LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm"}
_MLPS = {"LlamaMLP", "MistralMLP", "Qwen2MLP", "Qwen3MLP"}
ATTENTIONS = {"LlamaAttention", "MistralAttention", "Qwen2Attention", "Qwen3Attention"}


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama's RMSNorm: normalised in fp32, cast back, then scaled."""
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotary(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """Llama's rotary embedding of queries and keys."""
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def silu_gate(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The SiLU-gated product of a Llama MLP."""
    return nn.functional.silu(gate) * up


_COMPILED: dict[str, Callable[..., Any]] = {}  # once per process: every sampler shares the compiled code


def kernels(device: torch.device) -> tuple[Callable[..., Any], ...]:
    """``rms_norm``, ``rotary`` and ``silu_gate``: compiled for a CUDA device, as they are otherwise."""
    fns = (rms_norm, rotary, silu_gate)
    if device.type != "cuda":
        return fns
    for fn in fns:
        if fn.__name__ not in _COMPILED:
            # Without fullgraph: past the recompilation limit a call runs the function as written (unfused,
            # the same arithmetic) instead of raising in the middle of a rollout.
            _COMPILED[fn.__name__] = torch.compile(fn, dynamic=True)
    return tuple(_COMPILED[fn.__name__] for fn in fns)


def _is_silu(act: Any) -> bool:
    return isinstance(act, nn.SiLU) or type(act).__name__ == "SiLUActivation"


@contextlib.contextmanager
def fused(model: nn.Module, fns: tuple[Callable[..., Any], ...]) -> Iterator[int]:
    """Within the block, ``model``'s known RMSNorms, MLPs and rotary embeddings run as the fused functions.

    Yields the number of modules and source files swapped (0: nothing known, the model runs as it is).
    """
    norm, rot, gate = fns
    swapped: list[nn.Module] = []
    files: dict[Any, Any] = {}
    # Each dtype, a dimension of size 1 (batch 1, a decode step) and each model's epsilon is a separate
    # compilation of the same three functions; dynamo's default of 8 per function is too few for a process
    # that samples from several models or dtypes (past it, calls would run unfused).
    cfg = torch._dynamo.config
    limit = "recompile_limit" if hasattr(cfg, "recompile_limit") else "cache_size_limit"
    compiled = fns[0] is not rms_norm
    raised = cfg.patch(**{limit: max(getattr(cfg, limit), 64)}) if compiled else contextlib.nullcontext()
    with raised:
        try:
            for m in model.modules():
                name = type(m).__name__
                if name in _NORMS and hasattr(m, "variance_epsilon"):
                    m.forward = lambda x, m=m: norm(x, m.weight, m.variance_epsilon)  # type: ignore[method-assign]
                    swapped.append(m)
                elif name in _MLPS and _is_silu(getattr(m, "act_fn", None)):
                    m.forward = lambda x, m=m: m.down_proj(gate(m.gate_proj(x), m.up_proj(x)))  # type: ignore
                    swapped.append(m)
                elif name in ATTENTIONS:
                    source = sys.modules.get(type(m).__module__)
                    if source is not None and source not in files and hasattr(source, "apply_rotary_pos_emb"):
                        files[source] = source.apply_rotary_pos_emb
                        source.apply_rotary_pos_emb = rot
            yield len(swapped) + len(files)
        finally:
            for m in swapped:
                del m.forward
            for source, original in files.items():
                source.apply_rotary_pos_emb = original
