"""Benchmark of activation offloading and checkpointing: step time and peak memory of one training step
(forward + backward) on docs/design.md's 2.47B Qwen2-shaped model, a wider one (hidden 4096), a small MoE and
a small GQA model (12 query heads over 2 KV heads), and small models of other families: a Mixtral-shaped MoE,
GPT-2 medium's shape (tied embeddings) and Llama 3.2 1B's (GQA).

A step is the decoder body over ``bs x seq`` tokens plus the LM head on the last 256 tokens (so the
vocabulary does not dominate), bf16 weights, gradients set to None before each step: the peak is over the
weights, so the bf16 gradients are inside every figure. Contenders, each on the same model and batch:

* ``none``; ``save_on_cpu``: ``torch.autograd.graph.save_on_cpu(pin_memory=True)``;
* ``ckpt``: every decoder layer checkpointed with ``torch.utils.checkpoint`` (non-reentrant);
* ``rlmem:<names>``: ``rlmem.offload_activations`` with one name, or ``all`` names;
* ``rlmem:auto``: the budget mode (its steps until the plan settles are not timed); ``rlmem:ckpt+off``:
  ``rlmem.checkpoint`` of every layer with offloading of all names (so the checkpoint inputs are offloaded).

The link's D2H and H2D rates (pinned, 1 GiB) and the forward time of ``none`` are measured in the same run;
``host_forward_s`` (every contender) is the host's time to launch the forward pass, without a sync.
The summary's figures, and the targets they are checked against, are ``_activations_summary.py``'s.
``--only rlmem:auto --merge`` measures ``rlmem:auto`` again, keeping the other contenders of an earlier run.

Long context (``--long``, default ``1x32768,1x65536,1x131072`` of the 2.47B model): only ``ckpt`` and
``rlmem:ckpt+off``. The bf16 gradients are 4.6 GiB; the checkpointed layer inputs are 3.5 GiB at 32k tokens
and outweigh them from 64k on. ``ckpt_offload_peak_vs_ckpt`` and its overhead come from the longest point that
ran (``ckpt_offload_point`` names it; every long point in ``long_points``), else from the largest grid point.
"""

from __future__ import annotations

import contextlib
import gc
import time
from typing import Any

import torch
import torch.nn.functional as F

from .. import checkpoint as rl_checkpoint
from .. import offload_activations
from .._units import GiB as _GiB
from ..activations.modmap import SHARED_INPUT
from ..models.presets import QWEN2
from ._activations_summary import AUTO_TARGETS as AUTO_TARGETS  # "as": re-exported, as it was defined here
from ._activations_summary import TARGETS, summarize
from ._activations_summary import auto_figures as auto_figures  # "as": re-exported, as it was defined here
from ._common import (
    format_table,
    link_rates,
    median,
    warm_steps,
)
from ._harness import Run

NAME = "activations"
HEAD_TOKENS = 256
NAMES_DENSE = ["attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm"]

MODELS: dict[str, dict[str, Any]] = {
    "qwen2-2.5b": {"kind": "qwen2", "cfg": QWEN2["qwen2-2.5b"]},
    "qwen2-wide": {
        "kind": "qwen2",
        "cfg": {
            **QWEN2["qwen2-2.5b"],
            "hidden_size": 4096,
            "num_hidden_layers": 8,
            "intermediate_size": 22016,
            "num_attention_heads": 32,
            "num_key_value_heads": 4,
        },
    },
    "qwen2-moe-small": {
        "kind": "qwen2_moe",
        "cfg": {
            "hidden_size": 1024,
            "num_hidden_layers": 12,
            "intermediate_size": 2816,
            "num_attention_heads": 16,
            "num_key_value_heads": 4,
            "vocab_size": 151936,
            "tie_word_embeddings": True,
            "num_experts": 16,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 704,
            "shared_expert_intermediate_size": 2816,
            "max_position_embeddings": 8192,
        },
    },
    "qwen2-gqa-small": {
        "kind": "qwen2",
        "cfg": {
            **QWEN2["qwen2-2.5b"],
            "hidden_size": 1536,
            "num_hidden_layers": 16,
            "intermediate_size": 8960,
            "num_attention_heads": 12,
            "num_key_value_heads": 2,
        },
    },
    # Other families, where a budget that offloads little must cost about nothing: a Mixtral-shaped MoE,
    # GPT-2 medium's shape (tied embeddings, learned positions, Conv1D projections), Llama 3.2 1B's shape.
    "mixtral-small": {
        "kind": "mixtral",
        "cfg": {
            "hidden_size": 1024,
            "num_hidden_layers": 12,
            "intermediate_size": 1408,
            "num_attention_heads": 16,
            "num_key_value_heads": 4,
            "num_local_experts": 8,
            "num_experts_per_tok": 2,
            "vocab_size": 32000,
            "max_position_embeddings": 8192,
        },
    },
    "gpt2-tied": {
        "kind": "gpt2",
        "cfg": {"n_embd": 1024, "n_layer": 24, "n_head": 16, "vocab_size": 50257, "n_positions": 8192},
    },
    "llama-gqa-small": {
        "kind": "llama",
        "cfg": {
            "hidden_size": 2048,
            "num_hidden_layers": 16,
            "intermediate_size": 8192,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "vocab_size": 128256,
            "tie_word_embeddings": True,
            "max_position_embeddings": 8192,
            "rope_theta": 500000.0,
        },
    },
}
# kind -> transformers' (config, model) classes
_CLASSES = {
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel"),
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
}
_MOE = ("qwen2_moe", "mixtral")


def _build(name: str, device: torch.device) -> torch.nn.Module:
    import transformers

    spec = MODELS[name]
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg_cls, model_cls = (getattr(transformers, c) for c in _CLASSES[spec["kind"]])
    cfg = cfg_cls(**spec["cfg"], attn_implementation="sdpa", use_cache=False)
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = model_cls(cfg)
    finally:
        torch.set_default_dtype(old)
    return model.train()


def _step(model: torch.nn.Module, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    hidden = model.base_model(input_ids=ids, use_cache=False).last_hidden_state
    logits = model.get_output_embeddings()(hidden[:, -HEAD_TOKENS:]).float()
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


class _Torch:
    """Baselines behind the same interface as rlmem's handles."""

    def __init__(self, kind: str, model: torch.nn.Module) -> None:
        self.kind = kind
        self.model = model
        self._orig: list[Any] = []
        if kind == "ckpt":
            from torch.utils.checkpoint import checkpoint

            from ..activations.modmap import find_module_map

            for _, layer in find_module_map(model).layers:
                f = layer.forward

                def wrapped(*a: Any, _f: Any = f, **k: Any) -> Any:
                    return checkpoint(_f, *a, use_reentrant=False, **k)

                layer.forward = wrapped
                self._orig.append(layer)

    def ctx(self) -> Any:
        if self.kind == "save_on_cpu":
            return torch.autograd.graph.save_on_cpu(pin_memory=True)
        import contextlib

        return contextlib.nullcontext()

    def remove(self) -> None:
        for layer in self._orig:
            del layer.forward


def _contender(name: str, model: torch.nn.Module) -> tuple[Any, Any]:
    """(context factory, cleanup) for contender ``name``."""
    if name in ("none", "save_on_cpu", "ckpt"):
        t = _Torch(name, model)
        return t.ctx, t.remove
    assert name.startswith("rlmem:")
    what = name.split(":", 1)[1]
    ck = None
    if what == "auto":
        off = offload_activations(model, budget="auto")
    elif what == "ckpt+off":
        ck = rl_checkpoint(model, every=1)
        off = _all(model)
    elif what == "all":
        off = _all(model)
    else:
        names = what.split("+")
        for name, src in SHARED_INPUT.items():  # a name needs the one whose output it saves
            if name in names and src not in names:
                names.insert(0, src)
        off = offload_activations(model, names)

    def cleanup() -> None:
        off.remove()
        if ck is not None:
            ck.remove()

    return (lambda: off), cleanup


def _all(model: torch.nn.Module) -> Any:
    from ..activations.modmap import find_module_map

    return offload_activations(model, find_module_map(model).names())


def _measure(
    model: torch.nn.Module, name: str, bs: int, seq: int, device: torch.device, steps: int, pairs: int = 15
) -> dict:
    vocab = model.config.vocab_size
    g = torch.Generator(device=device).manual_seed(0)
    ids = torch.randint(0, vocab, (bs, seq), device=device, generator=g)
    labels = torch.randint(0, vocab, (bs, HEAD_TOKENS), device=device, generator=g)
    ctx, cleanup = _contender(name, model)
    times, fwd, host_fwd, plain = [], [], [], []
    peak = peak_fwd = 0
    handle = None
    paired = name == "rlmem:auto"
    if paired:
        # A few percent to resolve: 5 pairs left +-7% on 60 ms steps (a median of them came out 6.9% under
        # the steps without the handle).
        steps = max(steps, pairs)
    model.zero_grad(set_to_none=True)
    gc.collect()
    base = torch.cuda.memory_allocated(device)  # what each step's peaks are over (see _timed)
    try:
        # budget="auto" measures a step, then the step without offloading, then checks its plan on the
        # steps after (until the handle says it has settled); the timed steps run the settled plan.
        warm, i = 1, 0
        while i < warm + steps:
            if paired and i >= warm and i % 2:
                # The settled plan's timed steps alternate with steps out of the handle (its layer hooks
                # stay, returning at once): a small step drifts by over 10% between blocks of steps
                # measured apart in one process, more than the few percent auto may cost.
                plain.append(_timed(model, None, ids, labels, device, name)[0])
            c = ctx()
            handle = c
            dt, th, fwd_peak, step_peak, tf, loss = _timed(model, c, ids, labels, device, name)
            if paired and i >= warm and not i % 2:
                plain.append(_timed(model, None, ids, labels, device, name)[0])
            if i >= warm:
                times.append(dt)
                peak = max(peak, step_peak)
                peak_fwd = max(peak_fwd, fwd_peak)
                host_fwd.append(th)
                if tf is not None:
                    fwd.append(tf)
            i += 1
            warm = warm_steps(handle, i, warm)
        out: dict[str, Any] = {
            "step_s": median(times),
            "peak_bytes": peak,
            "forward_peak_bytes": peak_fwd,
            "loss": float(loss),
        }
        if plain:
            out["none_step_s"] = median(plain)
        if fwd:
            out["forward_s"] = median(fwd)
        out["host_forward_s"] = median(host_fwd)
        stats = getattr(handle, "stats", None)
        if stats is not None:
            st = stats().as_dict()
            out["offloaded_bytes"] = st["offloaded_bytes"]
            out["by_name"] = st["by_name"]
            out["reloaded"] = {
                k: st[k] for k in ("reloaded_prefetched", "reloaded_on_demand", "served_resident")
            }
            out["pool_bytes"] = st["pool_bytes"]
            for k in ("copying_at_backward_bytes", "held_elsewhere_bytes"):
                out[k] = st[k]
            out["allocated_at_backward"] = st["allocated_at_backward"] - base
            if getattr(handle, "plan", None) is not None:
                out["plan"] = handle.plan.selection()
                out["plan_report"] = str(handle.plan)
                out["plan_trials"] = [list(t) for t in handle.plan.trials]
                out["plan_baseline_s"] = handle.plan.baseline_s
                out["activation_bytes"] = handle.plan.activation_bytes
                out["warm_steps"] = warm
    except torch.OutOfMemoryError:
        out = {"error": "out of memory"}
    finally:
        model.zero_grad(set_to_none=True)
        cleanup()
        gc.collect()
        torch.cuda.empty_cache()
        if name == "save_on_cpu":
            torch._C._host_emptyCache()
    return out


def _timed(
    model: torch.nn.Module, c: Any, ids: torch.Tensor, labels: torch.Tensor, device: torch.device, name: str
) -> tuple[float, float, int, int, float | None, torch.Tensor]:
    """One step (inside ``c``, a contender's context, or out of any): (step s, host s to launch the
    forward, forward peak, step peak, forward s for ``none``, loss); peaks over what was allocated before."""
    model.zero_grad(set_to_none=True)
    gc.collect()
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    tf = None
    t0 = time.perf_counter()
    with c if c is not None else contextlib.nullcontext():
        loss = _step(model, ids, labels)
        th = time.perf_counter() - t0  # the host's time to launch the forward pass (no sync)
        # The allocator's counters are kept on the host: no sync needed to read them.
        fwd_peak = torch.cuda.max_memory_allocated(device) - base
        if name == "none":
            torch.cuda.synchronize(device)
            tf = time.perf_counter() - t0
        loss.backward()
    torch.cuda.synchronize(device)
    dt = time.perf_counter() - t0
    return dt, th, fwd_peak, torch.cuda.max_memory_allocated(device) - base, tf, loss


def _contenders(model_name: str, largest: bool, full: bool) -> list[str]:
    base = ["none", "ckpt", "rlmem:all", "rlmem:auto", "rlmem:ckpt+off"]
    if MODELS[model_name]["kind"] in _MOE:
        extra = ["rlmem:expert_fc1", "rlmem:moe_act"]
    else:
        extra = [f"rlmem:{n}" for n in NAMES_DENSE] + ["rlmem:core_attn+attn_proj+mlp_norm"]
    names = base + (extra if (largest or full) else [])
    return [*names, "save_on_cpu"]


def _points(text: str) -> list[tuple[int, int]]:
    out = []
    for p in filter(None, text.split(",")):
        b, s = p.split("x")
        out.append((int(b), int(s)))
    return out


def main(argv: list[str] | None = None) -> int:
    run_ = Run(NAME, __doc__.splitlines()[0], TARGETS)
    p = run_.parser
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--grid", default="1x2048,2x2048,2x4096,4x4096", help="bs x seq points of qwen2-2.5b")
    p.add_argument("--grid-wide", default="2x2048,4x4096")
    p.add_argument("--grid-moe", default="2x2048,4x4096")
    p.add_argument("--grid-gqa", default="2x4096")
    p.add_argument("--grid-other", default="2x2048,4x4096", help="points of the other families' models")
    p.add_argument(
        "--long",
        default="1x32768,1x65536,1x131072",
        help="long-context points of qwen2-2.5b (ckpt and ckpt+off)",
    )
    p.add_argument("--full-at", default="2x2048", help="points that also run every single name")
    p.add_argument("--only", default="", help="run only these contenders (comma-separated), for diagnosis")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--auto-pairs", type=int, default=15, help="timed rlmem:auto steps (each paired)")
    p.add_argument("--merge", action="store_true", help="keep models of an existing JSON not run now")
    args = run_.parse(argv)
    old = run_.previous_file() if args.merge else {}  # read first: a file of another device is refused
    if not run_.needs_cuda():
        return 2
    device = run_.device
    d2h, h2d = link_rates(device)
    link = {"d2h_bytes_per_s": d2h, "h2d_bytes_per_s": h2d}
    print(f"link: D2H {d2h / 1e9:.1f} GB/s, H2D {h2d / 1e9:.1f} GB/s", flush=True)
    grids = {
        "qwen2-2.5b": args.grid,
        "qwen2-wide": args.grid_wide,
        "qwen2-moe-small": args.grid_moe,
        "qwen2-gqa-small": args.grid_gqa,
        **dict.fromkeys(("mixtral-small", "gpt2-tied", "llama-gqa-small"), args.grid_other),
    }
    full = set(args.full_at.split(","))
    res: dict[str, Any] = {}
    weights_bytes: dict[str, int] = {}
    rows = []
    for mname in [m for m in args.models.split(",") if m]:
        model = _build(mname, device)
        weights = torch.cuda.memory_allocated(device)
        pts = _points(grids[mname])
        long_pts = _points(args.long) if mname == "qwen2-2.5b" and args.long else []
        res[mname] = {}
        for k, (bs, seq) in enumerate(pts + long_pts):
            key = f"{bs}x{seq}"
            is_long = k >= len(pts)
            res[mname][key] = {"long": True} if is_long else {}
            only = [c for c in args.only.split(",") if c]
            last = k == len(pts) - 1
            todo = ["ckpt", "rlmem:ckpt+off"] if is_long else _contenders(mname, last, key in full)
            for c in only or todo:
                r = _measure(model, c, bs, seq, device, args.steps, args.auto_pairs)
                res[mname][key][c] = r
                none = res[mname][key].get("none", {})
                row = {"model": mname, "point": key, "who": c, **r}
                if "step_s" in r and "step_s" in none:
                    row["x_none"] = r["step_s"] / none["step_s"]
                    row["peak_x"] = r["peak_bytes"] / none["peak_bytes"]
                row["peak_gib"] = r.get("peak_bytes", 0) / _GiB or None
                row["off_gib"] = r.get("offloaded_bytes", 0) / _GiB or None
                row["ms"] = r["step_s"] * 1e3 if "step_s" in r else None
                rows.append(row)
                print(
                    f"{mname} {key} {c}: "
                    + (
                        r["error"]
                        if "error" in r
                        else f"{r['step_s'] * 1e3:.1f} ms, peak {r['peak_bytes'] / _GiB:.2f} GiB"
                    ),
                    flush=True,
                )
                if "held_elsewhere_bytes" in r:
                    print(
                        "  forward peak {:.2f} GiB, at backward {:.2f} GiB; offloaded {:.2f} GiB, of which "
                        "still copying {:.2f} GiB, held elsewhere {:.2f} GiB".format(
                            r["forward_peak_bytes"] / _GiB,
                            r["allocated_at_backward"] / _GiB,
                            r["offloaded_bytes"] / _GiB,
                            r["copying_at_backward_bytes"] / _GiB,
                            r["held_elsewhere_bytes"] / _GiB,
                        ),
                        flush=True,
                    )
                if "plan_report" in r:
                    print(r["plan_report"], flush=True)
        weights_bytes[mname] = weights
        del model
        gc.collect()
        torch.cuda.empty_cache()
    # The link rates each model's figures were measured with (ratios count only within one run).
    model_links = {m: link for m in res}
    if old:
        for m, r in old.get("results", {}).items():
            if m in res:  # points of a model run now that were not run now, contenders of a point not run now
                kept = {k: v for k, v in r.items() if k not in res[m]}
                mixed = [k for k in res[m] if k in r and set(r[k]) - set(res[m][k]) - {"long"}]
                for k in mixed:
                    res[m][k] = {**r[k], **res[m][k]}
                res[m] = {**kept, **res[m]}
                if mixed or any(not v.get("long") for v in kept.values()):
                    # The grid's figures are ratios over the link measured with them; long points use none.
                    model_links[m] = old.get("model_links", {}).get(m, old["link"])
                continue
            if m not in res:
                res[m] = r
                weights_bytes[m] = old.get("weights_bytes", {}).get(m)
                model_links[m] = old.get("model_links", {}).get(m, old["link"])
    summary = summarize(res, model_links.get("qwen2-2.5b", link), model_links)
    cols = [
        ("model", "model", "s"),
        ("point", "bs x seq", "s"),
        ("who", "contender", "s"),
        ("ms", "step ms", ".1f"),
        ("x_none", "x none", ".2f"),
        ("peak_gib", "peak GiB", ".2f"),
        ("peak_x", "peak/none", ".2f"),
        ("off_gib", "offloaded GiB", ".2f"),
    ]
    print(format_table(rows, cols))
    run_.finish(
        summary,
        name_key="benchmark",
        head_tokens=HEAD_TOKENS,
        models={k: MODELS[k]["cfg"] for k in res},
        link=link,
        model_links=model_links,
        weights_bytes=weights_bytes,
        results=res,
    )
    return 0
