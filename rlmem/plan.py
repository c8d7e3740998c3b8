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

import json
import math
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from .presets import QWEN2

__all__ = [
    "Hardware",
    "MemoryEstimate",
    "ModelShape",
    "PlanOptions",
    "Recommendation",
    "Workload",
    "estimate_memory",
    "format_recommendations",
    "parse_bytes",
    "recommend",
]

_GiB = float(1 << 30)
# Names of rlmem.offload_activations a dense decoder layer has (attn_proj's input is core_attn's output).
DENSE_NAMES = ("attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm")
PRECISIONS = ("bf16", "fp16", "fp32", "mixed")
OPTIMIZERS = ("adamw", "adamw_fused", "sgd", "none")
ENGINES = ("shared", "separate")
_DENSE_TYPES = ("llama", "qwen2", "qwen3", "mistral")
# rlmem.activations releases a layer's device copies two layers later (RELEASE_LAG) and prefetches one
# layer ahead in backward: about two layers' offloaded bytes stay on the device either way.
_IN_FLIGHT_LAYERS = 2
# Rough NCCL figures measured on the lent H200s (DESIGN.md): the first (world) communicator, then each more.
NCCL_WORLD_BYTES = 860 << 20
NCCL_GROUP_BYTES = 485 << 20


def _positive(owner: str, name: str, v: Any, *, zero: bool = False) -> None:
    ok = isinstance(v, int) and not isinstance(v, bool) and (v >= 0 if zero else v > 0)
    if not ok:
        raise ValueError(f"{owner}.{name} must be an integer {'>= 0' if zero else '> 0'}, got {v!r}")


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    """The shape of a dense decoder-only LM (the fields of a Hugging Face ``config.json``).

    Build one with :meth:`load` from a preset name, a ``config.json`` (or its folder) or a dict.

    Raises:
        ValueError: a size is not a positive integer, or heads do not divide as attention needs.
    """

    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    head_dim: int = 0
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    name: str = ""

    def __post_init__(self) -> None:
        for f in (
            "hidden_size",
            "num_hidden_layers",
            "intermediate_size",
            "num_attention_heads",
            "num_key_value_heads",
            "vocab_size",
        ):
            _positive("ModelShape", f, getattr(self, f))
        _positive("ModelShape", "head_dim", self.head_dim, zero=True)
        if self.head_dim == 0:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError(
                    f"ModelShape.num_attention_heads ({self.num_attention_heads}) must divide hidden_size "
                    f"({self.hidden_size}) when head_dim is not given"
                )
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"ModelShape.num_key_value_heads ({self.num_key_value_heads}) must divide "
                f"num_attention_heads ({self.num_attention_heads})"
            )

    @classmethod
    def load(cls, source: str | os.PathLike | Mapping[str, Any]) -> ModelShape:
        """A shape from a preset name (``qwen2-2.5b``, ...), a ``config.json`` path or folder, or a dict.

        Raises:
            ValueError: an unknown preset or file, a model type rlmem does not model (MoE, non-decoder),
                or a missing field (named).
        """
        if isinstance(source, Mapping):
            return cls._from_config(dict(source), "config")
        text = os.fspath(source)
        if text in QWEN2:
            return cls._from_config({"model_type": "qwen2", "attention_bias": True, **QWEN2[text]}, text)
        path = os.path.join(text, "config.json") if os.path.isdir(text) else text
        if not os.path.isfile(path):
            raise ValueError(
                f"model must be a preset ({', '.join(QWEN2)}) or a config.json path; got {text!r}"
            )
        with open(path) as f:
            try:
                cfg = json.load(f)
            except json.JSONDecodeError as e:
                raise ValueError(f"model: {path} is not valid JSON ({e})") from None
        return cls._from_config(cfg, os.path.basename(os.path.dirname(os.path.abspath(path))) or path)

    @classmethod
    def _from_config(cls, cfg: dict[str, Any], name: str) -> ModelShape:
        if "text_config" in cfg and "hidden_size" not in cfg:
            cfg = {**cfg["text_config"], "tie_word_embeddings": cfg.get("tie_word_embeddings", False)}
        mtype = cfg.get("model_type", "")
        if cfg.get("num_experts") or cfg.get("num_local_experts") or "moe" in mtype:
            raise ValueError(
                f"model: model_type {mtype!r} has MoE layers, which rlmem plan does not model yet"
            )
        if mtype and mtype not in _DENSE_TYPES:
            raise ValueError(
                f"model: model_type {mtype!r} is not modelled; supported: {', '.join(_DENSE_TYPES)}"
            )
        need = ("hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads", "vocab_size")
        missing = [k for k in need if k not in cfg]
        if missing:
            raise ValueError(f"model: the config lacks {', '.join(missing)}")
        return cls(
            hidden_size=cfg["hidden_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            intermediate_size=cfg["intermediate_size"],
            num_attention_heads=cfg["num_attention_heads"],
            num_key_value_heads=cfg.get("num_key_value_heads") or cfg["num_attention_heads"],
            vocab_size=cfg["vocab_size"],
            head_dim=cfg.get("head_dim") or 0,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            # Qwen2 has q/k/v biases without saying so in its config.
            attention_bias=bool(cfg.get("attention_bias", mtype == "qwen2")),
            qk_norm=mtype == "qwen3",
            name=name,
        )

    @property
    def q_dim(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_key_value_heads * self.head_dim

    def layer_params(self) -> int:
        h, q, kv, i = self.hidden_size, self.q_dim, self.kv_dim, self.intermediate_size
        n = h * (q + 2 * kv) + q * h + 3 * h * i + 2 * h
        if self.attention_bias:
            n += q + 2 * kv
        if self.qk_norm:
            n += 2 * self.head_dim
        return n

    def embed_params(self) -> int:
        """Input embedding plus the LM head when it is not tied."""
        return self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)

    def num_params(self) -> int:
        return self.num_hidden_layers * self.layer_params() + self.embed_params() + self.hidden_size

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        """KV cache bytes of one token over all layers (keys and values)."""
        return 2 * self.num_hidden_layers * self.kv_dim * dtype_bytes

    def saved_tensors_per_token(self, dtype_bytes: int = 2) -> dict[str, list[int]]:
        """Per token, the storages autograd saves in one decoder layer, by rlmem module name (one entry per
        storage, as the offloader sees them; ``mlp`` is the part no name covers; ``checkpoint_input`` is
        what a checkpointed layer keeps instead of all of them)."""
        h, q, kv, i, b = self.hidden_size, self.q_dim, self.kv_dim, self.intermediate_size, dtype_bytes
        nh, nkv = self.num_attention_heads, self.num_key_value_heads
        # RMSNorm: its fp32 input (pow, mul), rsqrt per token, the normalised tensor cast back (weight mul)
        norm = [4 * h, 4, b * h]
        core = [b * q, b * kv, b * kv, b * q, 4 * nh]  # q, k (roped), v, output, fp32 log-sum-exp per head
        if self.qk_norm:  # Qwen3's per-head RMSNorm of q and k
            core += [4 * q, 4 * nh, b * q, 4 * kv, 4 * nkv, b * kv]
        return {
            "attn_norm": norm,
            "qkv_linear": [b * h],  # the norm's output, the projections' input
            "core_attn": core,
            "attn_proj": [],  # o_proj's input is core_attn's output (one storage)
            "mlp_norm": norm,
            "mlp": [b * h, b * i, b * i, b * i, b * i],  # gate/up input; gate out, SiLU out, up out, product
            "checkpoint_input": [b * h],
        }

    def activation_bytes_per_token(self, dtype_bytes: int = 2) -> dict[str, int]:
        """Bytes autograd saves per token in one decoder layer, by rlmem module name (see
        :meth:`saved_tensors_per_token`)."""
        return {k: sum(v) for k, v in self.saved_tensors_per_token(dtype_bytes).items()}


@dataclass(frozen=True, kw_only=True)
class Workload:
    """What one RL step asks of one GPU.

    Args:
        micro_batch_tokens: tokens in one training micro-batch (padded ``batch x seq`` or a token budget).
        seq_len: the longest sequence in it (default ``micro_batch_tokens``); a token budget below it is
            impossible.
        train_tokens: tokens trained on per step on this GPU (default: ``rollout_batch x rollout_len``, else
            one micro-batch); sets how many micro-batches a smaller token budget needs, and the step time
            the recommender's slowdowns are relative to.
        grad_accumulation: micro-batches whose gradients add up before one optimizer step.
        logits_tokens: tokens the LM head and loss run on per micro-batch (default all).
        precision: ``bf16``/``fp16``/``fp32`` (parameters, gradients and states in that dtype, as a model cast
            to it trains with torch's optimizers) or ``mixed`` (fp32 parameters, gradients and states,
            bf16 compute through FSDP2's MixedPrecisionPolicy).
        optimizer: ``adamw`` (torch's foreach default), ``adamw_fused``, ``sgd`` (with momentum), ``none``
            (no optimizer state here; gradients are still made).
        dp_shards: FSDP2 ranks the parameters, gradients and optimizer states are sharded over (1: none).
        comm_groups: NCCL communicators of the training process (default one when ``dp_shards > 1``).
        rollout_batch, rollout_len: sequences generated together and their prompt + completion length
            (0: no rollout on this GPU).
        prompt_len: prompt tokens prefilled per sequence (default ``rollout_len``: an upper bound).
        kv_budget_bytes: a fixed KV cache size, as an engine's memory fraction sets it (default: what
            ``rollout_batch x rollout_len`` needs).
        rollout_engine: ``shared`` (rollout runs on the training weights, as rlmem's HF sampler) or
            ``separate`` (an engine such as vLLM or SGLang with its own copy of the weights).
        cuda_context_bytes: the CUDA context and libraries outside PyTorch's allocator.

    Raises:
        ValueError: a field out of range; the message names it.
    """

    micro_batch_tokens: int
    seq_len: int = 0
    train_tokens: int = 0
    grad_accumulation: int = 1
    logits_tokens: int = 0
    precision: str = "bf16"
    optimizer: str = "adamw"
    dp_shards: int = 1
    comm_groups: int = -1
    rollout_batch: int = 0
    rollout_len: int = 0
    prompt_len: int = 0
    kv_budget_bytes: int = 0
    rollout_engine: str = "shared"
    cuda_context_bytes: int = 600 << 20

    def __post_init__(self) -> None:
        _positive("Workload", "micro_batch_tokens", self.micro_batch_tokens)
        for f in ("seq_len", "train_tokens", "logits_tokens", "rollout_batch", "rollout_len", "prompt_len"):
            _positive("Workload", f, getattr(self, f), zero=True)
        for f in ("kv_budget_bytes", "cuda_context_bytes"):
            _positive("Workload", f, getattr(self, f), zero=True)
        _positive("Workload", "grad_accumulation", self.grad_accumulation)
        _positive("Workload", "dp_shards", self.dp_shards)
        if self.comm_groups != -1:
            _positive("Workload", "comm_groups", self.comm_groups, zero=True)
        for f, allowed in (("precision", PRECISIONS), ("optimizer", OPTIMIZERS), ("rollout_engine", ENGINES)):
            if getattr(self, f) not in allowed:
                raise ValueError(
                    f"Workload.{f} must be one of {', '.join(allowed)}; got {getattr(self, f)!r}"
                )
        if self.seq_len > self.micro_batch_tokens:
            raise ValueError(
                f"Workload.seq_len ({self.seq_len}) must not exceed micro_batch_tokens "
                f"({self.micro_batch_tokens})"
            )
        if self.logits_tokens > self.micro_batch_tokens:
            raise ValueError(
                f"Workload.logits_tokens ({self.logits_tokens}) must not exceed micro_batch_tokens "
                f"({self.micro_batch_tokens})"
            )
        if (self.rollout_batch == 0) != (self.rollout_len == 0) and not self.kv_budget_bytes:
            raise ValueError("Workload.rollout_batch and rollout_len go together: give both or neither")
        if self.prompt_len > self.rollout_len:
            raise ValueError(
                f"Workload.prompt_len ({self.prompt_len}) must not exceed rollout_len ({self.rollout_len})"
            )

    @property
    def longest(self) -> int:
        return self.seq_len or self.micro_batch_tokens

    @property
    def compute_bytes(self) -> int:
        return 4 if self.precision == "fp32" else 2

    @property
    def state_bytes(self) -> int:
        return 4 if self.precision in ("fp32", "mixed") else 2


@dataclass(frozen=True, kw_only=True)
class PlanOptions:
    """The rlmem options an estimate is for (all off by default).

    Args:
        checkpoint_every: checkpoint one decoder layer in every N (``rlmem.checkpoint(every=N)``); 0: none.
        offload_modules: names for :func:`rlmem.offload_activations` (with checkpointing, the checkpointed
            layers' inputs are offloaded too).
        offload_states: rlmem gives gradients and optimizer states back during rollout (and the training
            weights too when the rollout engine has its own copy).
        min_offload_bytes: saved tensors smaller than this stay on the device (the offloader's ``min_bytes``).

    Raises:
        ValueError: a bad value; the message names the field.
    """

    checkpoint_every: int = 0
    offload_modules: tuple[str, ...] = ()
    offload_states: bool = False
    min_offload_bytes: int = 1 << 20

    def __post_init__(self) -> None:
        _positive("PlanOptions", "checkpoint_every", self.checkpoint_every, zero=True)
        _positive("PlanOptions", "min_offload_bytes", self.min_offload_bytes, zero=True)
        if isinstance(self.offload_modules, str):
            raise ValueError(
                f"PlanOptions.offload_modules must be a tuple of names, not {self.offload_modules!r}"
            )
        mods = tuple(self.offload_modules)
        bad = [m for m in mods if m not in DENSE_NAMES]
        if bad:
            raise ValueError(f"PlanOptions.offload_modules: unknown {bad}; valid: {', '.join(DENSE_NAMES)}")
        if "attn_proj" in mods and "core_attn" not in mods:
            raise ValueError("PlanOptions.offload_modules: 'attn_proj' requires 'core_attn'")
        object.__setattr__(self, "offload_modules", mods)
        if not isinstance(self.offload_states, bool):
            raise ValueError(f"PlanOptions.offload_states must be True or False, got {self.offload_states!r}")

    def label(self) -> str:
        parts = []
        if self.offload_states:
            parts.append("state offload in rollout")
        if self.checkpoint_every:
            parts.append("ckpt all" if self.checkpoint_every == 1 else f"ckpt 1/{self.checkpoint_every}")
        if self.offload_modules:
            mods = self.offload_modules
            parts.append("act offload: " + ("all" if set(mods) >= set(DENSE_NAMES) else ",".join(mods)))
        return " + ".join(parts) or "none"


@dataclass
class MemoryEstimate:
    """Bytes per category and the two phases' peaks (``str()`` is a table; :meth:`to_dict` for JSON)."""

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

    def to_dict(self) -> dict[str, Any]:
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
            lines.append(f"  {k:<34}{v / _GiB:>9.3f}")
        lines.append(f"  {'train peak (' + self.train_peak_at + ')':<34}{self.train_peak_bytes / _GiB:>9.3f}")
        if self.rollout_peak_bytes:
            lines.append(
                f"  {'rollout peak (' + self.rollout_peak_at + ')':<34}{self.rollout_peak_bytes / _GiB:>9.3f}"
            )
        lines.append(f"  {'device peak (with context, NCCL)':<34}{self.device_peak_bytes / _GiB:>9.3f}")
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
    in_flight = max(off, default=0) * min(_IN_FLIGHT_LAYERS, L)
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

    kv = w.kv_budget_bytes or w.rollout_batch * w.rollout_len * shape.kv_bytes_per_token(b)
    roll_pts: dict[str, int] = {}
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
        S = w.prompt_len or w.rollout_len or 1
        M = w.rollout_len or S  # a static cache: attention runs over all of its positions
        q, kvd, i = shape.q_dim, shape.kv_dim, shape.intermediate_size
        # With a padding mask, SDPA gets keys and values repeated to every query head (no native GQA
        # with masks), over the whole cache, one layer at a time; the mask is a bool and a float copy.
        rep = 2 * nb * M * q * b if kvd < q else 0
        mask = nb * S * M * (1 + b)
        # During a layer's MLP: SwiGLU's activation, up projection and product, beside four hidden-sized
        # tensors (the embeddings and the layer's input, both still referenced by HF's layer loop, the
        # residual and the normalised input); the bool mask lives through the whole forward.
        prefill = max(
            nb * S * (3 * b * i + 4 * b * h) + nb * S * M,
            rep + nb * S * (3 * b * q + 4 * b * h) + mask,
        )
        decode = rep + nb * M * (1 + b) + nb * 3 * b * i
        sampling = nb * V * (b + 4 * 4 + 8)  # logits, fp32 copy, softmax, sorted values and int64 indices
        base = weights + keep + kv
        roll_pts = {"prefill": base + prefill, "decode": base + decode, "sampling": base + sampling}
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


@dataclass
class Recommendation:
    """One row of :func:`recommend`: options, token budget, the estimate, whether it fits, expected cost."""

    options: PlanOptions
    micro_batch_tokens: int
    estimate: MemoryEstimate
    fits: bool
    overhead_s: float
    slowdown: float
    notes: list[str] = field(default_factory=list)
    budgeted: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {
            "options": _row_label(self),
            "micro_batch_tokens": self.micro_batch_tokens,
            "fits": self.fits,
            "device_peak_bytes": self.estimate.device_peak_bytes,
            "train_peak_bytes": self.estimate.train_peak_bytes,
            "rollout_peak_bytes": self.estimate.rollout_peak_bytes,
            "overhead_s": self.overhead_s,
            "slowdown": self.slowdown,
            "notes": self.notes,
            "estimate": self.estimate.to_dict(),
        }


@dataclass(frozen=True, kw_only=True)
class Hardware:
    """What the cost model assumes of the GPU (defaults: the lent H100, DESIGN.md and bench/results).

    Args:
        memory_bytes: the GPU's memory.
        link_bytes_per_s: pinned host<->device copy rate (55 GB/s measured on the H100, PCIe 5).
        tflops: sustained dense bf16 rate of a training step (340 measured for the 2.47B model's full
            step at bs 2 x 2048 on the H100: 6 x params x tokens / 179 ms).
        hbm_bytes_per_s: device memory bandwidth (a pass reads the weights once forward, twice backward).
        headroom: share of memory left free for the caching allocator's fragmentation and what is not
            modelled (bench/results/plan_accuracy: reserved exceeded allocated by up to 7.8 GiB, 10% of an
            80 GiB GPU, with expandable segments).
    """

    memory_bytes: int
    link_bytes_per_s: float = 50e9
    tflops: float = 340.0
    hbm_bytes_per_s: float = 3.0e12
    headroom: float = 0.10

    def __post_init__(self) -> None:
        _positive("Hardware", "memory_bytes", self.memory_bytes)
        for f in ("link_bytes_per_s", "tflops", "hbm_bytes_per_s"):
            v = getattr(self, f)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not v > 0:
                raise ValueError(f"Hardware.{f} must be a positive number, got {v!r}")
        if not isinstance(self.headroom, (int, float)) or not 0 <= self.headroom < 1:
            raise ValueError(f"Hardware.headroom must be in [0, 1), got {self.headroom!r}")


def _forward_s(shape: ModelShape, w: Workload, tokens: int, hw: Hardware) -> tuple[float, float]:
    """Forward seconds of ``tokens`` tokens: the whole model, and the decoder layers alone."""
    L, S = shape.num_hidden_layers, w.longest
    # 2 FLOPs per weight per token, and causal attention over half the sequence on average (QK^T and AV)
    layer = 2 * shape.layer_params() + 2 * shape.q_dim * S
    head = (
        2
        * shape.vocab_size
        * shape.hidden_size
        * (w.logits_tokens or w.micro_batch_tokens)
        / w.micro_batch_tokens
    )
    rate = hw.tflops * 1e12
    return (L * layer + head) * tokens / rate, L * layer * tokens / rate


def _train_tokens(w: Workload) -> int:
    """Tokens one RL step trains on: given, or the rollout's (what it generated), or one micro-batch."""
    return w.train_tokens or (w.rollout_batch * w.rollout_len) or w.micro_batch_tokens


def _cost(
    shape: ModelShape, w: Workload, o: PlanOptions, est: MemoryEstimate, T: int, hw: Hardware
) -> tuple[float, float, list[str]]:
    """Seconds one RL step spends on what the options add, and that over the step's training compute."""
    tokens = _train_tokens(w)
    base_mb = math.ceil(tokens / w.micro_batch_tokens)
    n_mb = math.ceil(tokens / T)
    t_fwd, t_layers = _forward_s(shape, w, T, hw)
    t_train = 3 * _forward_s(shape, w, tokens, hw)[0]
    notes = []
    extra = 0.0
    if o.checkpoint_every:
        n_ck = len(range(0, shape.num_hidden_layers, o.checkpoint_every))
        extra += n_mb * t_layers * n_ck / shape.num_hidden_layers
        notes.append(f"recomputes {n_ck} of {shape.num_hidden_layers} layers")
    if est.offloaded_activation_bytes:
        copy = est.offloaded_activation_bytes / hw.link_bytes_per_s
        stall = max(0.0, copy - t_fwd) + max(0.0, copy - 2 * t_fwd)
        extra += n_mb * stall
        notes.append(
            f"copies {est.offloaded_activation_bytes / _GiB:.2f} GiB per micro-batch each way "
            + ("(hidden)" if stall == 0 else f"({stall * 1e3:.0f} ms not hidden)")
        )
    if n_mb > base_mb:
        weights = shape.num_params() * w.compute_bytes / w.dp_shards
        extra += (n_mb - base_mb) * 3 * weights / hw.hbm_bytes_per_s
        notes.append(f"token budget {T}: {n_mb} micro-batches instead of {base_mb}")
    if o.offload_states and (w.rollout_batch or w.kv_budget_bytes):
        moved = est.categories["optimizer states"]
        if w.rollout_engine == "separate":
            moved += est.categories["params"]
        extra += 2 * moved / hw.link_bytes_per_s
        notes.append(f"moves {moved / _GiB:.2f} GiB out and back per step")
    return extra, extra / t_train if t_train else 0.0, notes


def _train_choices(shape: ModelShape, w: Workload, hw: Hardware) -> list[PlanOptions]:
    """Activation options from the cheapest up: none, offload what the link hides, checkpointing, both."""
    T = w.micro_batch_tokens
    t_fwd = _forward_s(shape, w, T, hw)[0]
    per = shape.activation_bytes_per_token(w.compute_bytes)
    hidden: list[str] = []
    total = 0
    for name in DENSE_NAMES:  # in the order the forward pass produces them
        nbytes = per[name] * T * shape.num_hidden_layers
        if total + nbytes > hw.link_bytes_per_s * t_fwd:
            break
        hidden.append(name)
        total += nbytes
    if "core_attn" in hidden and "attn_proj" not in hidden:
        hidden.insert(hidden.index("core_attn") + 1, "attn_proj")
    out = [PlanOptions()]
    if hidden:
        out.append(PlanOptions(offload_modules=tuple(hidden)))
    if tuple(hidden) != DENSE_NAMES:
        out.append(PlanOptions(offload_modules=DENSE_NAMES))
    out += [PlanOptions(checkpoint_every=k) for k in (4, 2, 1)]
    out.append(PlanOptions(checkpoint_every=1, offload_modules=DENSE_NAMES))
    return out


def recommend(
    model: ModelShape | str | Mapping[str, Any], workload: Workload, hardware: Hardware
) -> list[Recommendation]:
    """Which rlmem options fit ``workload`` on the GPU, cheapest first; those that do not fit follow.

    Each activation option (none, offloading what the link can hide, all offloadable modules,
    checkpointing one layer in 4, 2 or every layer, checkpointing plus offload) is tried with and without
    rlmem's offload of the training state during rollout; where one does not fit, the largest token budget
    (at least the longest sequence) that fits is tried too. Costs are modelled, not measured: recompute of
    checkpointed layers, copies the link cannot hide under the forward (and backward) pass, more
    micro-batches, the state moved out and back; relative to the step's training compute.

    Raises:
        ValueError: bad model, workload or hardware (named).
    """
    shape = model if isinstance(model, ModelShape) else ModelShape.load(model)
    if not isinstance(hardware, Hardware):
        raise ValueError(f"hardware must be a Hardware, got {type(hardware).__name__}")
    limit = hardware.memory_bytes * (1 - hardware.headroom)
    rollout = bool(workload.rollout_batch or workload.kv_budget_bytes)
    rows: list[Recommendation] = []
    for states in (False, True) if rollout else (False,):
        for base in _train_choices(shape, workload, hardware):
            o = replace(base, offload_states=states)
            est = estimate_memory(shape, workload, o)
            candidates = [(workload.micro_batch_tokens, est)]
            if est.device_peak_bytes > limit and est.rollout_peak_bytes + _fixed(est) <= limit:
                T = _largest_budget(shape, workload, o, limit)
                if T:
                    candidates.append((T, estimate_memory(shape, _with_tokens(workload, T), o)))
            for k, (T, e) in enumerate(candidates):
                extra, slow, notes = _cost(shape, workload, o, e, T, hardware)
                rows.append(
                    Recommendation(
                        options=o,
                        micro_batch_tokens=T,
                        estimate=e,
                        fits=e.device_peak_bytes <= limit,
                        overhead_s=extra,
                        slowdown=slow,
                        notes=notes,
                        budgeted=k > 0,
                    )
                )
    rows.sort(key=lambda r: (not r.fits, r.overhead_s if r.fits else r.estimate.device_peak_bytes))
    return rows


def _fixed(est: MemoryEstimate) -> int:
    return est.device_peak_bytes - max(est.train_peak_bytes, est.rollout_peak_bytes)


def _with_tokens(w: Workload, T: int) -> Workload:
    return replace(w, micro_batch_tokens=T, seq_len=w.longest, logits_tokens=min(w.logits_tokens, T))


def _largest_budget(shape: ModelShape, w: Workload, o: PlanOptions, limit: float) -> int:
    """The most tokens per micro-batch (>= the longest sequence) whose estimate fits, or 0."""
    lo, hi = w.longest, w.micro_batch_tokens
    if estimate_memory(shape, _with_tokens(w, lo), o).device_peak_bytes > limit:
        return 0
    while hi - lo > max(1, lo // 64):
        mid = (lo + hi) // 2
        if estimate_memory(shape, _with_tokens(w, mid), o).device_peak_bytes <= limit:
            lo = mid
        else:
            hi = mid
    return lo


def _row_label(r: Recommendation) -> str:
    lab = r.options.label()
    if r.budgeted:
        lab = f"token budget + {lab}" if lab != "none" else "token budget"
    return lab


def format_recommendations(rows: list[Recommendation], hardware: Hardware, limit_rows: int = 12) -> str:
    """The recommender's table."""
    width = max([len(_row_label(r)) for r in rows[:limit_rows]] + [8]) + 2
    lines = [
        f"rlmem plan: options for {hardware.memory_bytes / _GiB:.1f} GiB "
        f"({hardware.headroom:.0%} kept free), cheapest first",
        f"  {'options':<{width}}{'tokens/mb':>10}{'train':>8}{'rollout':>9}{'device':>8}{'fits':>6}"
        f"{'+s/step':>9}{'slowdown':>10}",
    ]
    for r in rows[:limit_rows]:
        e = r.estimate
        lines.append(
            f"  {_row_label(r):<{width}}{r.micro_batch_tokens:>10}{e.train_peak_bytes / _GiB:>8.1f}"
            f"{e.rollout_peak_bytes / _GiB:>9.1f}{e.device_peak_bytes / _GiB:>8.1f}"
            f"{'yes' if r.fits else 'no':>6}{r.overhead_s:>9.3f}{r.slowdown:>9.1%}"
        )
    best = next((r for r in rows if r.fits), None)
    if best is None:
        lines.append(
            "  nothing fits: a smaller micro-batch than the longest sequence, more GPUs (dp_shards), "
            "or a smaller rollout batch / KV budget is needed"
        )
    else:
        lines.append(
            f"  recommended: {_row_label(best)}, {best.micro_batch_tokens} tokens per micro-batch"
            + (f" ({'; '.join(best.notes)})" if best.notes else "")
        )
    return "\n".join(lines)


_UNITS = {
    "": 1,
    "b": 1,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
}


def parse_bytes(text: str, name: str) -> int:
    """``80GiB``, ``81920MiB``, ``85e9`` or a plain integer, as bytes.

    Raises:
        ValueError: not a positive size (naming ``name``).
    """
    import re

    m = re.fullmatch(r"\s*([0-9.]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
    unit = m.group(2).lower() if m else ""
    if not m or unit not in _UNITS:
        raise ValueError(f"{name} must be a size like 80GiB, 40GB or 1073741824; got {text!r}")
    value = float(m.group(1)) * _UNITS[unit]
    if value <= 0:
        raise ValueError(f"{name} must be positive, got {text!r}")
    return int(value)


def main(argv: list[str] | None = None) -> int:
    """``rlmem plan``: the estimate for the given options, and the recommender's table."""
    import argparse

    p = argparse.ArgumentParser(
        prog="rlmem plan",
        description="Estimate a training step's and a rollout's GPU memory, and which rlmem options fit.",
    )
    p.add_argument(
        "model", help=f"a preset ({', '.join(QWEN2)}) or a Hugging Face config.json (or its folder)"
    )
    p.add_argument("--micro-batch-tokens", type=int, required=True, help="tokens per training micro-batch")
    p.add_argument("--seq-len", type=int, default=0, help="longest sequence (default: the micro-batch)")
    p.add_argument("--train-tokens", type=int, default=0, help="tokens trained per step on this GPU")
    p.add_argument("--grad-accumulation", type=int, default=1)
    p.add_argument("--logits-tokens", type=int, default=0, help="tokens the LM head runs on (default: all)")
    p.add_argument("--precision", default="bf16", choices=PRECISIONS)
    p.add_argument("--optimizer", default="adamw", choices=OPTIMIZERS)
    p.add_argument("--dp-shards", type=int, default=1, help="FSDP2 ranks sharding the state")
    p.add_argument("--rollout-batch", type=int, default=0)
    p.add_argument("--rollout-len", type=int, default=0, help="prompt + completion tokens")
    p.add_argument("--prompt-len", type=int, default=0)
    p.add_argument("--kv-budget", default=None, help="fixed KV cache size, e.g. 20GiB")
    p.add_argument(
        "--engine", default="shared", choices=ENGINES, help="rollout on the training weights or not"
    )
    p.add_argument("--checkpoint-every", type=int, default=0)
    p.add_argument("--offload-modules", default="", help="comma-separated names, or 'all'")
    p.add_argument("--offload-states", action="store_true", help="rlmem offload during rollout")
    p.add_argument("--gpu-memory", default=None, help="e.g. 80GiB (default: this machine's GPU)")
    p.add_argument("--headroom", type=float, default=0.10, help="share of the GPU kept free")
    p.add_argument("--link-gbps", type=float, default=50.0, help="pinned host<->device GB/s")
    p.add_argument("--tflops", type=float, default=340.0, help="sustained training TFLOP/s")
    p.add_argument("--json", action="store_true", help="print JSON for tools")
    args = p.parse_args(argv)
    try:
        shape = ModelShape.load(args.model)
        mods = (
            tuple(DENSE_NAMES)
            if args.offload_modules == "all"
            else tuple(m for m in args.offload_modules.split(",") if m)
        )
        w = Workload(
            micro_batch_tokens=args.micro_batch_tokens,
            seq_len=args.seq_len,
            train_tokens=args.train_tokens,
            grad_accumulation=args.grad_accumulation,
            logits_tokens=args.logits_tokens,
            precision=args.precision,
            optimizer=args.optimizer,
            dp_shards=args.dp_shards,
            rollout_batch=args.rollout_batch,
            rollout_len=args.rollout_len,
            prompt_len=args.prompt_len,
            kv_budget_bytes=parse_bytes(args.kv_budget, "--kv-budget") if args.kv_budget else 0,
            rollout_engine=args.engine,
        )
        o = PlanOptions(
            checkpoint_every=args.checkpoint_every, offload_modules=mods, offload_states=args.offload_states
        )
        est = estimate_memory(shape, w, o)
        mem = parse_bytes(args.gpu_memory, "--gpu-memory") if args.gpu_memory else _this_gpu()
        hw = None
        if mem:
            hw = Hardware(
                memory_bytes=mem,
                link_bytes_per_s=args.link_gbps * 1e9,
                tflops=args.tflops,
                headroom=args.headroom,
            )
    except ValueError as e:
        p.error(str(e))
    rows = recommend(shape, w, hw) if hw else []
    if args.json:
        out = {"estimate": est.to_dict(), "recommendations": [r.to_dict() for r in rows]}
        if hw:
            out["hardware"] = asdict(hw)
        print(json.dumps(out, indent=1))
        return 0
    print(est)
    if hw:
        print()
        print(format_recommendations(rows, hw))
    else:
        print("\n(no GPU here: pass --gpu-memory for the table of options that fit)")
    return 0


def _this_gpu() -> int:
    try:
        import torch

        if torch.cuda.is_available():
            return int(torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory)
    except Exception:  # a broken CUDA set-up only means: no default
        pass
    return 0
