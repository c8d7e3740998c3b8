"""Which rlmem options make a step and a rollout fit a GPU, and what each costs: :func:`recommend` scores
every activation option (none, offload what the link hides, checkpointing, both) at the largest token budget
that fits, with a cost model of the step (compute, copies that do not hide, state moves)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from .._results import Result
from .._units import GiB
from ..activations.modmap import DENSE_NAMES, SHARED_INPUT
from .estimate import MemoryEstimate, estimate_memory
from .shapes import Hardware, ModelShape, PlanOptions, Workload

__all__ = ["Recommendation", "format_recommendations", "recommend"]


@dataclass(frozen=True)
class Recommendation(Result):
    """One row of :func:`recommend`: options, token budget, the estimate, whether it fits, expected cost."""

    options: PlanOptions
    micro_batch_tokens: int
    estimate: MemoryEstimate
    fits: bool
    overhead_s: float
    slowdown: float
    notes: list[str] = field(default_factory=list)
    budgeted: bool = False

    def as_dict(self) -> dict[str, Any]:
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
            "estimate": self.estimate.as_dict(),
        }


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
            f"copies {est.offloaded_activation_bytes / GiB:.2f} GiB per micro-batch each way "
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
        notes.append(f"moves {moved / GiB:.2f} GiB out and back per step")
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
    for name, src in SHARED_INPUT.items():  # no further bytes once the storage it shares is offloaded
        if src in hidden and name not in hidden:
            hidden.insert(hidden.index(src) + 1, name)
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
        f"rlmem plan: options for {hardware.memory_bytes / GiB:.1f} GiB "
        f"({hardware.headroom:.0%} kept free), cheapest first",
        f"  {'options':<{width}}{'tokens/mb':>10}{'train':>8}{'rollout':>9}{'device':>8}{'fits':>6}"
        f"{'+s/step':>9}{'slowdown':>10}",
    ]
    for r in rows[:limit_rows]:
        e = r.estimate
        lines.append(
            f"  {_row_label(r):<{width}}{r.micro_batch_tokens:>10}{e.train_peak_bytes / GiB:>8.1f}"
            f"{e.rollout_peak_bytes / GiB:>9.1f}{e.device_peak_bytes / GiB:>8.1f}"
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
