"""Memory planning: what one training step and one rollout of a decoder-only LM take on a GPU, and which
rlmem options make them fit at the least expected cost.

The estimate walks one step's memory timeline (forward through every layer, the LM head and its loss,
backward layer by layer, the optimizer step) and one rollout (weights, KV cache, prefill, sampling),
adding the bytes alive at each point; the peak is the largest sum. Per-token activation bytes come from
the tensors autograd saves in a Hugging Face Llama/Qwen2-style decoder layer (RMSNorm, SDPA with native
GQA, SwiGLU MLP), module by module under the names of :func:`rlmem.offload_activations`; the LM head is
HF's causal-LM loss (fp32 logits, log-softmax). What is modelled and what is not:

* modelled: parameters, gradients and optimizer states by optimizer and precision (FSDP2 shards divide
  them; the gathered layers and the root module are added back), activations with checkpointing and
  activation offloading (two layers in flight each way, as rlmem's offloader holds them), gradient
  accumulation, the optimizer's temporaries (torch's foreach AdamW allocates one sqrt of the second
  moments), the KV cache and prefill of a rollout, a rough NCCL figure per communicator, the CUDA context;
* not modelled: the caching allocator's fragmentation (the recommender keeps ``headroom`` free for it),
  padding masks in training (packed or causal batches are assumed), MoE layers (refused), other loss
  heads (the GRPO recipe's log-prob head is about the same size: fp32 logits kept for backward).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from .._results import Result
from .._units import GiB
from .shapes import (
    IN_FLIGHT_LAYERS,
    NCCL_GROUP_BYTES,
    NCCL_WORLD_BYTES,
    ModelShape,
    PlanOptions,
    Workload,
)

__all__ = ["MemoryEstimate", "estimate_memory"]


@dataclass(frozen=True)
class MemoryEstimate(Result):
    """Bytes per category and the two phases' peaks (``str()`` is a table; :meth:`as_dict` for JSON)."""

    model: str
    params: int
    categories: dict[str, int]
    per_token_layer: dict[str, int]
    train_peak_bytes: int
    train_peak_at: str
    rollout_peak_bytes: int
    rollout_peak_at: str
    device_peak_bytes: int
    offloaded_activation_bytes: int
    workload: Workload
    options: PlanOptions
    points: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["workload"] = asdict(self.workload)
        d["options"] = asdict(self.options)
        d["options"]["offload_modules"] = list(self.options.offload_modules)
        return d

    def __str__(self) -> str:
        w = self.workload
        lines = [
            f"rlmem plan: {self.model} ({self.params / 1e9:.2f}B parameters), {w.precision}, {w.optimizer}, "
            f"micro-batch {w.micro_batch_tokens} tokens, options: {self.options.label()}",
            f"  {'category':<34}{'GiB':>9}",
        ]
        for k, v in self.categories.items():
            lines.append(f"  {k:<34}{v / GiB:>9.3f}")
        lines.append(f"  {'train peak (' + self.train_peak_at + ')':<34}{self.train_peak_bytes / GiB:>9.3f}")
        if self.rollout_peak_bytes:
            lines.append(
                f"  {'rollout peak (' + self.rollout_peak_at + ')':<34}{self.rollout_peak_bytes / GiB:>9.3f}"
            )
        lines.append(f"  {'device peak (with context, NCCL)':<34}{self.device_peak_bytes / GiB:>9.3f}")
        per = ", ".join(f"{k} {v}" for k, v in self.per_token_layer.items())
        lines.append(f"  activation bytes per token per layer: {per}")
        return "\n".join(lines)


def _phase_points(
    shape: ModelShape, w: Workload, o: PlanOptions, T: int, g_pre: int, persist: int, grads: dict[str, int]
) -> tuple[dict[str, int], int, int]:
    """Bytes alive at each point of one micro-batch's forward and backward, over ``persist``; also the
    bytes offloaded and the activations kept on the device at the start of backward."""
    b, L, h, V = w.compute_bytes, shape.num_hidden_layers, shape.hidden_size, shape.vocab_size
    Tl = w.logits_tokens or T
    parts = shape.saved_tensors_per_token(b)
    per = {k: sum(v) for k, v in parts.items()}
    off_tok = sum(x for m in o.offload_modules for x in parts[m] if x * T >= o.min_offload_bytes)
    layer_full = sum(v for k, v in per.items() if k != "checkpoint_input") * T
    ck = [bool(o.checkpoint_every) and j % o.checkpoint_every == 0 for j in range(L)]
    ck_in = per["checkpoint_input"] * T
    ck_in_off = ck_in if (o.offload_modules and ck_in >= o.min_offload_bytes) else 0
    kept = [ck_in - ck_in_off if c else layer_full - off_tok * T for c in ck]
    off = [ck_in_off if c else off_tok * T for c in ck]
    in_flight = max(off, default=0) * min(IN_FLIGHT_LAYERS, L)
    rope = 2 * shape.head_dim * b * T + 8 * T  # cos, sin (shared by the layers), position ids
    head_in = (4 * h + 4 + b * h) * T + b * h * Tl  # final norm, lm_head input
    fwd_head = (b * V + (4 * V if b != 4 else 0) + 4 * V) * Tl  # logits, fp32 copy, log-softmax out
    bwd_head = 12 * V * Tl  # log-softmax out (saved), nll grad, log-softmax grad (fp32)
    acts = sum(kept)
    base = persist + g_pre + rope
    pts = {
        "forward, loss": base + acts + in_flight + head_in + fwd_head,
        "backward, loss": base + acts + head_in + bwd_head,
    }
    g_new = 0 if g_pre else 1  # gradients appear during the first micro-batch's backward
    head_grad = grads["head"] * g_new
    # With gradients already held, the head's weight gradient is made and then added in: a temporary.
    # Otherwise it is the new gradient itself (head_grad), tied or not.
    transient_head = shape.vocab_size * h * b if g_pre else 0
    pts["backward, lm_head"] = (
        base + acts + head_in + (b * V + 4 * V) * Tl + head_grad + transient_head + b * h * T
    )
    t_b = (
        max(
            3 * b * shape.intermediate_size + 2 * b * h,
            b * (2 * shape.q_dim + 2 * shape.kv_dim)
            + 4 * shape.q_dim
            + 4 * shape.num_attention_heads
            + b * h,
        )
        * T
    )
    worst, where = 0, ""
    for j in range(L - 1, -1, -1):
        below = sum(kept[:j])
        here = layer_full if ck[j] else kept[j]
        reload = off[j] + (off[j - 1] if j else 0)
        g_done = (head_grad + grads["layer"] * (L - j)) * g_new
        v = base + below + here + reload + t_b + g_done + b * h * T
        if v > worst:
            worst, where = v, f"backward, layer {j}"
    pts[where] = worst
    # embedding backward: a new gradient (untied, first micro-batch) or one added into the existing one
    emb_tmp = shape.vocab_size * h * b
    pts["backward, embedding"] = base + (head_grad + grads["layer"] * L) * g_new + emb_tmp + 4 * h * T
    return pts, sum(off), acts


def estimate_memory(
    model: ModelShape | str | Mapping[str, Any], workload: Workload, options: PlanOptions | None = None
) -> MemoryEstimate:
    """Estimate one training step's and one rollout's peak memory on one GPU.

    Args:
        model: a :class:`ModelShape`, or what :meth:`ModelShape.load` takes.
        workload: the step (micro-batch tokens, precision, optimizer, sharding, rollout).
        options: rlmem options (default: none).

    Raises:
        ValueError: a bad model, workload or options (named).

    Example:
        >>> est = estimate_memory("qwen2-2.5b", Workload(micro_batch_tokens=4096))
        >>> round(est.categories["params"] / 2**30, 1)
        4.6
    """
    shape = model if isinstance(model, ModelShape) else ModelShape.load(model)
    if not isinstance(workload, Workload):
        raise ValueError(f"workload must be a Workload, got {type(workload).__name__}")
    o = PlanOptions() if options is None else options
    if not isinstance(o, PlanOptions):
        raise ValueError(f"options must be PlanOptions, got {type(o).__name__}")
    w, b, sb = workload, workload.compute_bytes, workload.state_bytes
    h, V, dp = shape.hidden_size, shape.vocab_size, w.dp_shards
    P = shape.num_params()
    params = math.ceil(P * sb / dp)
    grads_total = math.ceil(P * sb / dp)
    n_states = {"adamw": 2, "adamw_fused": 2, "sgd": 1, "none": 0}[w.optimizer]
    opt = n_states * params
    opt_tmp = {"adamw": params, "adamw_fused": 0, "sgd": 0, "none": 0}[w.optimizer]
    # FSDP2 (sharded, or mixed precision's cast): the root module's embedding/head and two decoder layers
    # (current and prefetched) are gathered unsharded in the compute dtype, plus one layer's unsharded grads.
    fsdp = dp > 1 or w.precision == "mixed"
    gathered = (shape.embed_params() + 2 * shape.layer_params()) * b if fsdp else 0
    gathered_grads = shape.layer_params() * b if fsdp else 0
    # The LM head's weight gradient appears in the head's backward (tied or not); an untied input
    # embedding's at the very end.
    grads = {"head": math.ceil(V * h * sb / dp), "layer": math.ceil(shape.layer_params() * sb / dp)}
    persist = params + opt + gathered
    T = w.micro_batch_tokens
    points, off_bytes, acts = _phase_points(shape, w, o, T, 0, persist, grads)
    if w.grad_accumulation > 1 and grads_total:
        more, _, _ = _phase_points(shape, w, o, T, grads_total, persist, grads)
        points.update({f"{k} (accumulating)": v for k, v in more.items()})
    for k in list(points):
        if k.startswith("backward"):
            points[k] += gathered_grads
    points["optimizer step"] = params + opt + grads_total + opt_tmp
    train_at = max(points, key=lambda k: points[k])
    train_peak = points[train_at]

    kv = w.kv_budget_bytes or w.kv_tokens * shape.kv_bytes_per_token(b)
    roll_pts: dict[str, int] = {}
    graph_pool = fused_qkv = 0
    if kv or w.rollout_batch:
        # Gradients are gone during rollout either way (zero_grad(set_to_none=True), or rlmem's default
        # "discard"); offloading gives back the optimizer states, and the training weights when the engine
        # has its own copy. FSDP2 generates from a gathered copy and keeps its shards.
        if w.rollout_engine == "shared" and not fsdp:
            weights, keep = params, (0 if o.offload_states else opt)
        elif w.rollout_engine == "shared":
            weights, keep = P * b, params + (0 if o.offload_states else opt)
        else:
            weights, keep = P * b, (0 if o.offload_states else params + opt)
        nb = w.rollout_batch or 1
        # a group's prompt is prefilled once (share_prompts): the prefill runs over the groups
        nb_prefill = -(-nb // w.group_size)
        S = w.prompt_len or w.rollout_len or 1
        M = w.rollout_len or S  # a static cache: attention runs over all of its positions
        q, kvd, i = shape.q_dim, shape.kv_dim, shape.intermediate_size
        if w.cuda_graphs:
            # rlmem's sampler with graphs fuses each layer's q/k/v projections over a copy of their weights
            # (and biases), held with the KV cache during rollout.
            fused_qkv = shape.num_hidden_layers * (q + 2 * kvd) * (h + int(shape.attention_bias)) * b
        # With a padding mask, SDPA gets keys and values repeated to every query head (no native GQA
        # with masks), over the whole cache, one layer at a time; the mask is a bool and a float copy.
        rep = 2 * nb_prefill * M * q * b if kvd < q else 0
        mask = nb_prefill * S * M * (1 + b)
        # During a layer's MLP: SwiGLU's activation, up projection and product, beside four hidden-sized
        # tensors (the embeddings and the layer's input, both still referenced by HF's layer loop, the
        # residual and the normalised input); the bool mask lives through the whole forward.
        prefill = max(
            nb_prefill * S * (3 * b * i + 4 * b * h) + nb_prefill * S * M,
            rep + nb_prefill * S * (3 * b * q + 4 * b * h) + mask,
        )
        # A decode step of rlmem's sampler reads a grouped model's cache as it is (``_gqa``): no repeat.
        decode = nb * M * (1 + b) + nb * 3 * b * i
        sampling = nb * V * (b + 4 * 4 + 8)  # logits, fp32 copy, softmax, sorted values and int64 indices
        if w.cuda_graphs:
            # One pool for every batch and cache-length bucket: the largest graph's decode temporaries, the
            # model's logits among them; beside it each batch bucket's logits buffer, which every length's
            # graph writes (1 + 1/2 + 1/4 ... < 2 of the largest). A replay's temporaries are the pool's own.
            graph_pool = decode + nb * V * b + 2 * nb * V * b
            decode = 0
        base = weights + keep + kv + fused_qkv + graph_pool
        roll_pts = {"prefill": base + prefill, "decode": base + decode, "sampling": base + sampling}
    if graph_pool:  # the graphs' pool stays reserved through the train phase
        points = {k: v + graph_pool for k, v in points.items()}
        train_peak = points[train_at]
    roll_at = max(roll_pts, key=lambda k: roll_pts[k]) if roll_pts else ""
    roll_peak = roll_pts.get(roll_at, 0)
    groups = (1 if dp > 1 else 0) if w.comm_groups == -1 else w.comm_groups
    nccl = NCCL_WORLD_BYTES + (groups - 1) * NCCL_GROUP_BYTES if groups else 0
    per = shape.activation_bytes_per_token(b)
    categories = {
        "params": params,
        "grads": grads_total,
        "optimizer states": opt,
        "optimizer temporaries": opt_tmp,
        "FSDP gathered params + grads": gathered + gathered_grads,
        "activations (at backward start)": acts,
        "activations offloaded to host": off_bytes,
        "logits + loss (backward peak)": 12 * V * (w.logits_tokens or T),
        "KV cache": kv,
        "CUDA graph pool (rollout)": graph_pool,
        "fused q/k/v copy (rollout)": fused_qkv,
        "NCCL (rough)": nccl,
        "CUDA context": w.cuda_context_bytes,
    }
    return MemoryEstimate(
        model=shape.name or "model",
        params=P,
        categories=categories,
        per_token_layer=per,
        train_peak_bytes=train_peak,
        train_peak_at=train_at,
        rollout_peak_bytes=roll_peak,
        rollout_peak_at=roll_at,
        device_peak_bytes=max(train_peak, roll_peak) + nccl + w.cuda_context_bytes,
        offloaded_activation_bytes=off_bytes,
        workload=w,
        options=o,
        points={**points, **{f"rollout {k}": v for k, v in roll_pts.items()}},
    )
