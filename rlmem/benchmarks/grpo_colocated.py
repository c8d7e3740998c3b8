"""Co-located GRPO with and without rlmem offload: what KV cache fits, and what it buys in rollout tokens/s.

Every part runs the GRPO recipe (``rlmem.recipes.grpo``) in its own process on the same workload:
``prompts x group`` sequences of ``max_new_tokens`` per step, ``steps`` steps (figures from the last). The
default model is ``qwen2-2.7b-mha``: docs/design.md's 2.47B Qwen2 shape with 16 KV heads instead of 2 (2.68B
parameters; fp32 weights, bf16 autocast, AdamW: 40 GiB of train state, 30 GiB of it resident during a rollout
without offload). With 2 KV heads a 52 GiB cache holds 1.9M tokens, and one GRPO step over them takes
minutes here; with 16 it holds 240k. Parts differ only in the KV-cache budget and the offload switch:

* ``big-nooffload``: the big budget without offload: expected to run out of memory (the optimizer states
  and the cache cannot be resident together);
* ``big-offload``: the same budget with offload: the cache holds the whole rollout at once;
* ``half-nooffload``: half the big budget without offload: the rollout fits, but the train phase (40 GiB of
  state, ~12 GiB of activations and logits, and the cache) runs out of memory on an 80 GB H100;
* ``fit-nooffload``: a budget that fits beside the resident train state in both phases (``--kv-fit-gib``):
  the rollout runs in several batches.

Summary: ``oom_without_offload``, ``rollout_tokens_per_s_offload`` (big-offload),
``rollout_tokens_per_s_no_offload`` (fit-nooffload), ``switch_share_of_step`` (big-offload's phase
switches over its step time), and ``step_s_*``, ``peak_*`` per phase.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from .. import __version__
from .._units import GiB as _GiB
from ._common import format_table, spawn_part
from ._harness import Run

NAME = "grpo_colocated"


def _gib(v: float | None) -> float | None:
    return None if v is None else v / _GiB


PARTS = ("big-nooffload", "big-offload", "big-overlap", "half-nooffload", "fit-nooffload")
TARGETS = {
    "switch_share_of_step": ("<", 0.05),
    "tokens_per_s_gain": (">", 1.0),
}


def _config(args: argparse.Namespace, part: str, out_dir: str) -> Any:
    from ..recipes.grpo import GRPOConfig

    budget = {"big": args.kv_big_gib, "half": args.kv_big_gib / 2, "fit": args.kv_fit_gib}[part.split("-")[0]]
    return GRPOConfig(
        model=args.model,
        # the recipe takes a kind of device, not the harness's "cuda:0"
        device=torch.device(args.device).type,
        steps=args.steps,
        prompts_per_step=args.prompts,
        group_size=args.group,
        max_new_tokens=args.max_new_tokens,
        micro_batch_size=args.micro_batch,
        rollout_dtype=args.rollout_dtype,
        updates_per_step=1,
        precision="bf16-mixed",
        offload=not part.endswith("-nooffload"),
        overlap_offload=part.endswith("-overlap"),
        kv_budget=f"{budget}GiB",
        out_dir=out_dir,
        progress=False,
        plot=False,
        save_every=0,  # the benchmark times steps; a 2.7B checkpoint at the end would only add minutes
    )


def run_part(args: argparse.Namespace, part: str) -> dict[str, Any]:
    from ..recipes.grpo import run

    with tempfile.TemporaryDirectory() as d:
        cfg = _config(args, part, d)
        try:
            s = run(cfg, echo=lambda *a, **k: print(*a, file=sys.stderr, **k))
        except torch.OutOfMemoryError as e:
            return {
                "oom": True,
                "oom_message": str(e).splitlines()[0][:400],
                "allocated_at_oom": torch.cuda.memory_allocated(),
            }
        rows = [json.loads(line) for line in (Path(d) / "log.jsonl").read_text().splitlines()]
    last = rows[-1]
    return {
        "oom": False,
        "kv_budget": cfg.kv_budget,
        "steps": rows,
        "last": last,
        "phases": s["phases"],
        "precision": s["precision"],
    }


def summarize(res: dict[str, Any]) -> dict[str, Any]:
    s: dict[str, Any] = {}
    if "oom" in res.get("big-nooffload", {}):
        s["oom_without_offload"] = bool(res["big-nooffload"].get("oom"))
    big, fit = res.get("big-offload", {}), res.get("fit-nooffload", {})
    if big.get("last"):
        b = big["last"]
        s["rollout_tokens_per_s_offload"] = b["tokens_per_s"]
        s["switch_share_of_step"] = b["switch_s"] / b["step_s"]
        s["step_s_offload"] = b["step_s"]
        s["kv_gib_offload"] = b["kv_bytes"] / _GiB
        s["peak_rollout_gib_offload"] = _gib(b["peak_rollout"])
        s["peak_train_gib_offload"] = _gib(b["peak_train"])
    if fit.get("last"):
        f = fit["last"]
        s["rollout_tokens_per_s_no_offload"] = f["tokens_per_s"]
        s["step_s_no_offload"] = f["step_s"]
        s["kv_gib_no_offload"] = f["kv_bytes"] / _GiB
        s["peak_rollout_gib_no_offload"] = _gib(f["peak_rollout"])
        s["peak_train_gib_no_offload"] = _gib(f["peak_train"])
    ov = res.get("big-overlap", {})
    if ov.get("last"):
        o = ov["last"]
        s["switch_share_of_step_overlap"] = o["switch_s"] / o["step_s"]
        s["step_s_overlap"] = o["step_s"]
        if big.get("last"):
            b = big["last"]
            # What the overlap leaves on the step: its own switches, plus what the rollout lost to the
            # copies running beside it.
            s["overlap_exposed_s"] = o["switch_s"] + max(0.0, o["rollout_s"] - b["rollout_s"])
            s["overlap_saved_s"] = (b["switch_s"] + b["rollout_s"]) - (o["switch_s"] + o["rollout_s"])
    if "rollout_tokens_per_s_offload" in s and "rollout_tokens_per_s_no_offload" in s:
        s["tokens_per_s_gain"] = s["rollout_tokens_per_s_offload"] / s["rollout_tokens_per_s_no_offload"]
    return s


def main(argv: list[str] | None = None) -> int:
    run_ = Run(NAME, __doc__.splitlines()[0], TARGETS)
    p = run_.parser
    p.add_argument(
        "--model", default="qwen2-2.7b-mha", help="'tiny', a preset of rlmem.presets, or a directory"
    )
    p.add_argument("--kv-big-gib", type=float, default=52.0, help="the big KV budget (GiB)")
    p.add_argument(
        "--kv-fit-gib", type=float, default=20.0, help="a KV budget that fits without offload (GiB)"
    )
    p.add_argument("--prompts", type=int, default=29, help="prompts per step (29 x 16 fill 52 GiB)")
    p.add_argument("--group", type=int, default=16, help="samples per prompt")
    p.add_argument("--max-new-tokens", type=int, default=512)
    p.add_argument("--micro-batch", type=int, default=2, help="sequences per forward/backward")
    p.add_argument("--rollout-dtype", default=None, help="the recipe's rollout_dtype (default: None)")
    p.add_argument("--steps", type=int, default=2, help="steps per part; figures from the last")
    p.add_argument("--parts", default=",".join(PARTS), help=f"which of {', '.join(PARTS)}")
    p.add_argument("--merge", action="store_true", help="keep the other parts of an existing JSON file")
    p.add_argument("--part", default=None, choices=PARTS, help=argparse.SUPPRESS)
    args = run_.parse(argv)
    args.device = str(run_.device)
    if args.part:
        print(json.dumps(run_part(args, args.part)), flush=True)
        return 0
    parts = [x for x in args.parts.split(",") if x]
    if not parts or any(x not in PARTS for x in parts):
        run_.error(f"--parts must be a comma-separated subset of {', '.join(PARTS)}")
    args.forward = [a for a in (argv if argv is not None else sys.argv[1:]) if a != "--merge"]
    res: dict[str, Any] = run_.previous() if args.merge else {}
    for part in parts:
        res[part] = spawn_part("rlmem.benchmarks.grpo_colocated", part, args.forward)
        # Parts merged from earlier calls keep their own stamp: a summary across parts of different dates
        # compares different versions of the rollout.
        res[part]["measured"] = {"date": time.strftime("%Y-%m-%d"), "rlmem": __version__}
    failed = {k: v["error"] for k, v in res.items() if "error" in v}
    for k, v in failed.items():
        print(f"{k} failed:\n{v}", file=sys.stderr)
    summary = summarize(res)
    rows = []
    for part in PARTS:
        r = res.get(part)
        if not r or "error" in r:
            continue
        if r["oom"]:
            rows.append({"part": part, "status": "out of memory"})
            continue
        last = r["last"]
        rows.append(
            {
                "part": part,
                "status": "ran",
                "kv": last["kv_bytes"] / _GiB,
                "batch": last["kv_batch"],
                "tps": last["tokens_per_s"],
                "roll": last["rollout_s"],
                "train": last["train_s"],
                "switch": last["switch_s"],
                "step": last["step_s"],
                "pr": _gib(last["peak_rollout"]),
                "pt": _gib(last["peak_train"]),
            }
        )
    print(
        format_table(
            rows,
            [
                ("part", "part", ""),
                ("status", "status", ""),
                ("kv", "KV GiB", ".1f"),
                ("batch", "KV seqs", "d"),
                ("tps", "rollout tok/s", ",.0f"),
                ("roll", "rollout s", ".1f"),
                ("train", "train s", ".1f"),
                ("switch", "switch s", ".3f"),
                ("step", "step s", ".1f"),
                ("pr", "peak rollout GiB", ".1f"),
                ("pt", "peak train GiB", ".1f"),
            ],
        )
    )
    skip = ("forward", "part", "json", "merge", "machine")
    run_.finish(summary, config={k: v for k, v in vars(args).items() if k not in skip}, results=res)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
