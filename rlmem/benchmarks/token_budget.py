"""Benchmark of token-budget micro-batches against fixed-size ones on a long-tailed length distribution.

A Qwen2-shaped model (``qwen2-1.5b`` by default, random init, bf16) runs forward + backward over one batch of
sequences whose lengths follow a Pareto tail (most short, a few near the longest), right-padded per
micro-batch with an attention mask. Contenders, each under the same token budget (sequences x longest
length of a micro-batch):

- ``fixed``: the largest fixed micro-batch size that can never exceed the budget (budget // longest length),
  in arrival order: what one picks to be safe from out-of-memory errors;
- ``fixed_mean``: a fixed size tuned to the mean length (budget // mean length), which exceeds the budget
  whenever long sequences meet (recorded: how many micro-batches did, and the peak memory);
- ``token_budget``: :func:`rlmem.token_budget_batches` with ``padded=True``.

Figures: real (unpadded) tokens per second, padding fraction, micro-batches, peak allocated memory. Summary:
``speedup_vs_fixed`` (token_budget tokens/s over fixed tokens/s) and the same against ``fixed_mean``.
"""

from __future__ import annotations

import random
import time
from typing import Any

import torch

from .._units import GiB
from ..data.batching import token_budget_batches
from ..models import presets

NAME = "token_budget"
TARGETS: dict[str, tuple[str, float]] = {}


def lengths_long_tail(n: int, longest: int, seed: int, alpha: float = 1.2, scale: int = 256) -> list[int]:
    """Pareto(``alpha``) x ``scale`` tokens (at least 16), capped at ``longest``; the last is ``longest``."""
    rng = random.Random(seed)
    out = [max(16, min(longest, int(rng.paretovariate(alpha) * scale))) for _ in range(n - 1)]
    return [*out, longest]


def plans(lengths: list[int], budget: int) -> dict[str, list[list[int]]]:
    n = len(lengths)
    fixed = max(1, budget // max(lengths))
    mean = max(1, int(budget // (sum(lengths) / n)))
    return {
        "fixed": [list(range(i, min(n, i + fixed))) for i in range(0, n, fixed)],
        "fixed_mean": [list(range(i, min(n, i + mean))) for i in range(0, n, mean)],
        "token_budget": token_budget_batches(lengths, budget, padded=True)[0],
    }


def _run(model: Any, seqs: torch.Tensor, lengths: list[int], mbs: list[list[int]], device: Any) -> None:
    for mb in mbs:
        w = max(lengths[i] for i in mb)
        ids = seqs[mb, :w].to(device, non_blocking=True)
        attn = (torch.arange(w)[None, :] < torch.tensor([lengths[i] for i in mb])[:, None]).to(device)
        labels = ids.masked_fill(attn == 0, -100)
        model(input_ids=ids, attention_mask=attn.long(), labels=labels, use_cache=False).loss.backward()
    model.zero_grad(set_to_none=True)


def main(argv: list[str] | None = None) -> int:
    from ._common import format_table, sync
    from ._harness import Run

    run_ = Run(NAME, __doc__.splitlines()[0])
    p = run_.parser
    p.add_argument("--model", default="qwen2-1.5b", choices=list(presets.QWEN2))
    p.add_argument("--sequences", type=int, default=256)
    p.add_argument("--longest", type=int, default=4096)
    p.add_argument("--budget", type=int, default=8192, help="tokens per micro-batch (padded)")
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    args = run_.parse(argv)
    if not run_.needs_cuda():
        return 2
    device = run_.device
    model = presets.build(args.model, device, torch.bfloat16).train()
    vocab = presets.vocab_size(args.model)
    lengths = lengths_long_tail(args.sequences, args.longest, args.seed)
    g = torch.Generator().manual_seed(args.seed)
    seqs = torch.randint(0, vocab, (len(lengths), max(lengths)), generator=g).pin_memory()
    real = sum(lengths)
    rows, results = [], {}
    for name, mbs in plans(lengths, args.budget).items():
        padded = [len(mb) * max(lengths[i] for i in mb) for mb in mbs]
        base = {
            "micro_batches": len(mbs),
            "over_budget": sum(t > args.budget for t in padded),
            "padded_tokens": sum(padded),
            "padding_fraction": 1 - real / sum(padded),
        }
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        times = []
        try:
            _run(model, seqs, lengths, mbs[:2], device)  # warm-up
            for _ in range(args.reps):
                sync(device)
                t0 = time.perf_counter()
                _run(model, seqs, lengths, mbs, device)
                sync(device)
                times.append(time.perf_counter() - t0)
        except torch.OutOfMemoryError:
            model.zero_grad(set_to_none=True)
            results[name] = {**base, "oom": True, "seconds": times, "tokens_per_s": None}
            results[name]["peak_allocated_bytes"] = torch.cuda.max_memory_allocated(device)
        else:
            results[name] = {
                **base,
                "oom": False,
                "seconds": times,
                "tokens_per_s": real / min(times),
                "peak_allocated_bytes": torch.cuda.max_memory_allocated(device),
            }
        r = results[name]
        rows.append(
            {
                "name": name,
                "mbs": r["micro_batches"],
                "over": r["over_budget"],
                "pad": 100 * r["padding_fraction"],
                "s": min(r["seconds"]) if r["seconds"] and not r["oom"] else float("nan"),
                "tps": r["tokens_per_s"] or float("nan"),
                "peak": r["peak_allocated_bytes"] / GiB,
            }
        )
    print(f"{args.model}, {len(lengths)} sequences, {real} tokens, budget {args.budget} padded tokens")
    print(
        format_table(
            rows,
            [
                ("name", "micro-batches", "s"),
                ("mbs", "count", "d"),
                ("over", "over budget", "d"),
                ("pad", "padding %", ".1f"),
                ("s", "seconds", ".2f"),
                ("tps", "tokens/s", ".0f"),
                ("peak", "peak GiB", ".1f"),
            ],
        )
    )
    tb = results["token_budget"]["tokens_per_s"]
    fm = results["fixed_mean"]["tokens_per_s"]
    summary = {
        "speedup_vs_fixed": tb / results["fixed"]["tokens_per_s"],
        "speedup_vs_fixed_mean": tb / fm if fm else None,
        "fixed_mean_oom": results["fixed_mean"]["oom"],
        "token_budget_over_budget": results["token_budget"]["over_budget"],
        "fixed_mean_over_budget": results["fixed_mean"]["over_budget"],
    }
    run_.finish(summary, name_key="benchmark", config=vars(args), lengths=lengths, results=results)
    return 0
