"""``rlmem plan``: the command line of the memory planner."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from typing import Any

from .._units import parse_bytes, parse_count
from ..activations.modmap import DENSE_NAMES
from ..models.presets import QWEN2
from .estimate import estimate_memory
from .recommend import format_recommendations, recommend
from .shapes import ENGINES, OPTIMIZERS, PRECISIONS, Hardware, ModelShape, PlanOptions, Workload

__all__ = ["main"]


def _count(flag: str) -> Any:
    """An argparse type for token and sequence counts (``8192``, ``8k``, ``8K``, ``1.5e9``)."""

    def parse(text: str) -> int:
        try:
            return parse_count(text, flag, zero=True)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from e

    parse.__name__ = "count"
    return parse


def main(argv: list[str] | None = None) -> int:
    """``rlmem plan``: the estimate for the given options, and the recommender's table."""
    p = argparse.ArgumentParser(
        prog="rlmem plan",
        description="Estimate a training step's and a rollout's GPU memory, and which rlmem options fit.",
    )
    p.add_argument(
        "model", help=f"a preset ({', '.join(QWEN2)}) or a Hugging Face config.json (or its folder)"
    )
    p.add_argument(
        "--micro-batch-tokens",
        type=_count("--micro-batch-tokens"),
        required=True,
        help="tokens per training micro-batch",
    )
    p.add_argument(
        "--seq-len", type=_count("--seq-len"), default=0, help="longest sequence (default: the micro-batch)"
    )
    p.add_argument(
        "--train-tokens", type=_count("--train-tokens"), default=0, help="tokens trained per step on this GPU"
    )
    p.add_argument("--grad-accumulation", type=int, default=1)
    p.add_argument(
        "--logits-tokens",
        type=_count("--logits-tokens"),
        default=0,
        help="tokens the LM head runs on (default: all)",
    )
    p.add_argument(
        "--precision",
        default="mixed",
        choices=PRECISIONS,
        help="mixed: fp32 weights, bf16 compute (rlmem train's default on a GPU)",
    )
    p.add_argument("--optimizer", default="adamw", choices=OPTIMIZERS)
    p.add_argument("--dp-shards", type=int, default=1, help="FSDP2 ranks sharding the state")
    p.add_argument("--rollout-batch", type=_count("--rollout-batch"), default=0)
    p.add_argument(
        "--rollout-len", type=_count("--rollout-len"), default=0, help="prompt + completion tokens"
    )
    p.add_argument("--prompt-len", type=_count("--prompt-len"), default=0)
    p.add_argument(
        "--group-size",
        type=_count("--group-size"),
        default=1,
        help="completions per prompt whose prompt the KV cache holds once (share_prompts; with --prompt-len)",
    )
    p.add_argument("--kv-budget", default=None, help="fixed KV cache size, e.g. 20GiB")
    p.add_argument(
        "--engine", default="shared", choices=ENGINES, help="rollout on the training weights or not"
    )
    p.add_argument(
        "--cuda-graphs", action="store_true", help="the rollout decodes with CUDA graphs (their memory pool)"
    )
    p.add_argument("--checkpoint-every", type=int, default=0)
    p.add_argument(
        "--offload-modules", default="", help=f"comma-separated of {', '.join(DENSE_NAMES)}, or 'all'"
    )
    p.add_argument("--offload-states", action="store_true", help="rlmem offload during rollout")
    p.add_argument(
        "--gpu-memory",
        default=None,
        help="e.g. 80GiB or 80G (a unit is required; default: this machine's GPU)",
    )
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
            group_size=args.group_size,
            kv_budget_bytes=parse_bytes(args.kv_budget, "--kv-budget") if args.kv_budget else 0,
            rollout_engine=args.engine,
            cuda_graphs=args.cuda_graphs,
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
        out = {"estimate": est.as_dict(), "recommendations": [r.as_dict() for r in rows]}
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
