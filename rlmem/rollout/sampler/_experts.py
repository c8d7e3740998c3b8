"""Mixture-of-experts layers in the decode steps the sampler captures into CUDA graphs.

transformers 5 runs the experts of its MoE families (Qwen2-MoE, Qwen3-MoE, Mixtral, ...) through one
dispatcher, ``config._experts_implementation``, ``"grouped_mm"`` by default (``integrations/moe.py`` of
5.17.0, ``grouped_mm_experts_forward`` and ``_grouped_mm``): a step's (token, expert) pairs sorted by expert,
counted per expert on the device, and multiplied by ``torch._grouped_mm`` over those offsets, the input cast
to the weights' dtype outside autocast. torch's CUDA kernel for it (``_grouped_mm_cuda`` in
``aten/src/ATen/native/cuda``) is a grouped GEMM for bf16 operands on compute capability 9.x and 10.x only;
any other dtype or device takes ``_grouped_mm_fallback`` (``aten/src/ATen/native/GroupedMMUtils.h``), which
copies the offsets to the host and multiplies group by group: a copy a capture refuses ("Cannot copy between
CPU and CUDA tensors during CUDA graph capture"), over group bounds a graph would freeze. So a decode step
over fp32 weights under autocast (the grouped GEMM runs in the weights' dtype), over fp16 weights, or on
another GPU could not be captured. transformers' other dispatchers do not do either: ``"eager"`` loops over
the experts a step reached (``nonzero``: a sync), ``"batched_mm"`` gathers a copy of the weights of every
(token, expert) pair (bf16 Mixtral 8x7B: 336 MiB a pair, 42 GiB for a decode step of 64 tokens at top-2).

:func:`static_experts` puts in their place, for the duration of a block, a form whose shapes do not depend
on the routing (:func:`dense_forward`): every expert over every token of the step (one GEMM over all the
experts' up projections, a batched GEMM for the down projections), then each token takes its top-k
experts' rows, weighted and summed in the router's order, as transformers sums them. It reads every
expert's weights once, as the grouped kernel does when a step's tokens reach every expert (a batch of 64 at
top-8 of 128 experts leaves each expert out with probability (1 - 8/128)^64 = 1.6%), and makes
``num_experts / top_k`` times the products the routing asks for: at a decode step's few rows, a small cost
beside reading the weights in bf16 or fp16, larger in fp32 (which runs without tensor cores). Experts whose
own dispatch a graph can capture (``"batched_mm"``; ``"grouped_mm"`` on the bf16 grouped kernel; a
dispatcher rlmem does not know) keep it, unless ``force``. The arithmetic is the grouped path's: the GEMMs in
the weights' dtype outside autocast, the model's gate and activation, the routing weights' products summed
over the top-k; the GEMM kernels differ, so the rounding of a product may differ in the last bit.

Only experts modules of transformers' form are touched (3-D ``down_proj`` and ``gate_up_proj`` or
``up_proj`` parameters, ``num_experts``, the ``has_gate`` / ``has_bias`` / ``is_transposed`` flags its
``use_experts_implementation`` sets); anything else runs as it is.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["dense_forward", "experts_modules", "own_is_capturable", "static_experts"]

# Dispatchers that copy to the host or sync in a step: the experts a step reached, found by ``nonzero``
# (``"eager"``), and the grouped GEMM off its bf16 kernel (see ``own_is_capturable``).
_UNSAFE = ("eager", "grouped_mm")


def experts_modules(model: nn.Module) -> list[nn.Module]:
    """``model``'s experts modules of transformers' form (see the module docstring)."""
    out = []
    for m in model.modules():
        params = m._parameters
        up = params.get("gate_up_proj") if getattr(m, "has_gate", None) else params.get("up_proj")
        down = params.get("down_proj")
        if not isinstance(up, torch.Tensor) or not isinstance(down, torch.Tensor):
            continue
        if up.dim() != 3 or down.dim() != 3 or not isinstance(getattr(m, "num_experts", None), int):
            continue
        if not all(isinstance(getattr(m, f, None), bool) for f in ("has_gate", "has_bias", "is_transposed")):
            continue
        if getattr(m, "_is_expert_parallel", False):  # the experts of other ranks come in as sentinels
            continue
        out.append(m)
    return out


def own_is_capturable(m: nn.Module, weight: torch.Tensor) -> bool:
    """Whether ``m``'s own dispatch, over ``weight`` (its up projection as the step reads it), makes no host
    copy or sync: anything but ``"eager"``, and ``"grouped_mm"`` only where torch runs its grouped GEMM
    kernel (bf16 operands on compute capability 9.x or 10.x, not ROCm)."""
    impl = getattr(getattr(m, "config", None), "_experts_implementation", None)
    if impl not in _UNSAFE:
        return impl is not None
    if impl == "eager" or weight.device.type != "cuda" or torch.version.hip is not None:
        return False
    return weight.dtype == torch.bfloat16 and torch.cuda.get_device_capability(weight.device)[0] in (9, 10)


def dense_forward(
    m: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """The output of experts module ``m`` for ``hidden_states`` (tokens x hidden) routed to ``top_k_index``
    with ``top_k_weights`` (tokens x top-k), with no shape that depends on the routing."""
    up_w = m.gate_up_proj if m.has_gate else m.up_proj
    down_w = m.down_proj
    tokens, hidden = hidden_states.shape
    experts = up_w.shape[0]
    device = hidden_states.device.type
    # As transformers' grouped path: the GEMMs in the weights' dtype, outside autocast (torch's grouped GEMM
    # is not an autocast op); the gate and the activation as the model has them, under the caller's autocast.
    with torch.autocast(device, enabled=False):
        x = hidden_states.to(up_w.dtype)
        if m.is_transposed:  # (E, hidden, out)
            up = torch.matmul(x, up_w).transpose(0, 1)
        else:  # (E, out, hidden): one GEMM against every expert's rows at once
            up = F.linear(x, up_w.reshape(-1, hidden)).view(tokens, experts, -1)
        if m.has_bias:
            up = up + (m.gate_up_proj_bias if m.has_gate else m.up_proj_bias)
    flat = up.reshape(tokens * experts, up.shape[-1])
    act = (m._apply_gate(flat) if m.has_gate else m.act_fn(flat)).reshape(tokens, experts, -1)
    with torch.autocast(device, enabled=False):
        act = act.to(down_w.dtype).transpose(0, 1)  # (E, tokens, inner)
        out = torch.bmm(act, down_w if m.is_transposed else down_w.transpose(1, 2))  # (E, tokens, hidden)
        if m.has_bias:
            out = out + m.down_proj_bias.unsqueeze(1)
    # Each token's rows of its top-k experts, in the router's order, summed as transformers sums them.
    k = top_k_index.shape[-1]
    index = top_k_index.reshape(tokens, k, 1).expand(tokens, k, hidden)
    picked = out.transpose(0, 1).gather(1, index)
    if getattr(m, "has_post_expert_norm", False):
        picked = m.post_expert_norm(picked.reshape(tokens * k, hidden)).reshape(tokens, k, hidden)
    weighted = picked * top_k_weights.reshape(tokens, k, 1)
    return weighted.sum(dim=1).to(hidden_states.dtype)


def _forward(
    m: nn.Module,
    own: Any,
    force: bool,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
) -> torch.Tensor:
    """``m``'s forward within :func:`static_experts` (its arguments named as transformers names them): its
    own where a graph can capture it, else :func:`dense_forward`."""
    if not force and own_is_capturable(m, m.gate_up_proj if m.has_gate else m.up_proj):
        return own(hidden_states, top_k_index, top_k_weights)
    return dense_forward(m, hidden_states, top_k_index, top_k_weights)


@contextlib.contextmanager
def static_experts(model: nn.Module, *, force: bool = False) -> Iterator[int]:
    """Within the block, ``model``'s experts modules whose own dispatch a CUDA graph cannot capture (all of
    them with ``force``) run :func:`dense_forward`; the others run as they are.

    Yields the number of experts modules found (0: nothing changes).
    """
    found = experts_modules(model)
    # What each module had as its own ``forward`` attribute (a hook's wrapper, e.g. accelerate's), put back
    swapped: list[tuple[nn.Module, Any]] = []
    try:
        for m in found:
            before = vars(m).get("forward")
            m.forward = functools.partial(_forward, m, m.forward, force)  # type: ignore[method-assign]
            swapped.append((m, before))
        yield len(found)
    finally:
        for m, before in swapped:
            if before is None:
                del m.forward
            else:
                m.forward = before  # type: ignore[method-assign]
