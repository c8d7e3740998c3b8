"""What the planner is asked about: a model's shape (:class:`ModelShape`), the work of a step and a rollout
(:class:`Workload`), rlmem's options (:class:`PlanOptions`) and the GPU (:class:`Hardware`). Each validates
itself on construction."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..activations.modmap import DENSE_NAMES, check_names
from ..models.presets import QWEN2

__all__ = [
    "ENGINES",
    "OPTIMIZERS",
    "PRECISIONS",
    "Hardware",
    "ModelShape",
    "PlanOptions",
    "Workload",
    "kv_bytes_per_token",
]

PRECISIONS = ("bf16", "fp16", "fp32", "mixed")
OPTIMIZERS = ("adamw", "adamw_fused", "sgd", "none")
ENGINES = ("shared", "separate")
_DENSE_TYPES = ("llama", "qwen2", "qwen3", "mistral")
# rlmem.activations releases a layer's device copies two layers later (RELEASE_LAG) and prefetches one
# layer ahead in backward: about two layers' offloaded bytes stay on the device either way.
IN_FLIGHT_LAYERS = 2
# Rough NCCL figures measured on the lent H200s (docs/design.md): the first (world) communicator, then each
# more.
NCCL_WORLD_BYTES = 860 << 20
NCCL_GROUP_BYTES = 485 << 20


def kv_bytes_per_token(layers: int, kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    """Bytes of KV cache one token takes across all layers (keys and values): the one formula the planner
    and the samplers both use."""
    return 2 * layers * kv_heads * head_dim * dtype_bytes


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
            if text.count("/") == 1 and not os.path.exists(text.split("/")[0]):
                raise ValueError(
                    f"model: {text!r} looks like a Hugging Face hub ID; rlmem plan reads no network: "
                    f"download its config (hf download {text} config.json --local-dir DIR) and pass DIR"
                )
            raise ValueError(
                f"model must be a preset ({', '.join(QWEN2)}), a config.json or a directory holding one; "
                f"got {text!r}"
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
        return kv_bytes_per_token(
            self.num_hidden_layers, self.num_key_value_heads, self.head_dim, dtype_bytes
        )

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
        group_size: completions per prompt held once in the KV cache (``share_prompts``: each group's
            ``prompt_len`` tokens once and each sequence's ``rollout_len - prompt_len`` of its own, one
            prefill per group); 1: every sequence holds its own prompt.
        kv_budget_bytes: a fixed KV cache size, as an engine's memory fraction sets it (default: what
            ``rollout_batch x rollout_len`` needs).
        rollout_engine: ``shared`` (rollout runs on the training weights, as rlmem's HF sampler) or
            ``separate`` (an engine such as vLLM or SGLang with its own copy of the weights).
        cuda_context_bytes: the CUDA context and libraries outside PyTorch's allocator.
        cuda_graphs: the rollout decodes with CUDA graphs (as rlmem's HF sampler does on a GPU): their
            private memory pool holds a decode step's temporaries and every bucket's logits, in rollout and,
            since it stays reserved while the graphs live, in training too; and (its fused kernels, on with
            graphs) a copy of each layer's q/k/v weights, in rollout only.

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
    group_size: int = 1
    kv_budget_bytes: int = 0
    rollout_engine: str = "shared"
    cuda_context_bytes: int = 600 << 20
    cuda_graphs: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.cuda_graphs, bool):
            raise ValueError(f"Workload.cuda_graphs must be True or False; got {self.cuda_graphs!r}")
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
        _positive("Workload", "group_size", self.group_size)
        if self.group_size > 1 and not 0 < self.prompt_len < self.rollout_len:
            raise ValueError(
                "Workload.group_size > 1 holds each group's prompt once: give prompt_len, between 1 and "
                f"rollout_len - 1 ({self.rollout_len - 1}); got prompt_len={self.prompt_len}"
            )

    @property
    def kv_tokens(self) -> int:
        """Token columns the rollout's KV cache holds: ``rollout_batch x rollout_len``, or with
        ``group_size`` > 1 each group's prompt once and each sequence's completion."""
        if self.group_size == 1:
            return self.rollout_batch * self.rollout_len
        groups = -(-self.rollout_batch // self.group_size)
        return groups * self.prompt_len + self.rollout_batch * (self.rollout_len - self.prompt_len)

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
        if mods:
            mods = check_names(mods, "PlanOptions.offload_modules", DENSE_NAMES)
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


@dataclass(frozen=True, kw_only=True)
class Hardware:
    """What the cost model assumes of the GPU (defaults: the H100 measured in bench/results).

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
