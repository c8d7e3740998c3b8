"""Profile rlmem train's train phase with offload on and off, side by side: where does offload's extra train
time go? Each run is a process of its own (`rlmem train` through its Python entry, deterministic algorithms
as `rlmem bench real_model` runs them); its train phase (scoring and updates) of every step after the first
two runs under cProfile, with the allocator's counters read around it.

Writes to OUT: `steps_on.json` / `steps_off.json` (each step's record from log.jsonl; each train phase's
seconds and the cudaMalloc / cudaFree calls the allocator made in it), `cprofile_on.txt` / `cprofile_off.txt`
(the host's time by function: cumulative and own), and prints the medians side by side.

Usage: python scripts/profile_train_phase.py OUT [--model DIR] [--steps 6] [--prompts 64] [--group 8]
       [--max-new-tokens 64]
Without --model: a random model of SmolLM2-135M's shape (49,152-token vocabulary, tied embeddings) with a
tokenizer trained in the run, on the built-in arithmetic task.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _one(args: argparse.Namespace, offload: bool) -> None:
    import torch

    from rlmem.benchmarks.assets import tokenizer_and_data
    from rlmem.recipes import grpo
    from rlmem.recipes.config import GRPOConfig

    torch.use_deterministic_algorithms(True)
    out, tag = Path(args.out), "on" if offload else "off"
    prof = cProfile.Profile()
    phases: list[dict] = []
    cuda = torch.cuda.is_available()

    def counters() -> dict:
        return torch.cuda.memory_stats() if cuda else {}

    def timed(fn, name):
        def inner(*a, **k):
            step = len([p for p in phases if p["name"] == name])
            if cuda:
                torch.cuda.synchronize()
            c0, t0 = counters(), time.perf_counter()
            if step >= 2:
                prof.enable()
            try:
                r = fn(*a, **k)
                if cuda:
                    torch.cuda.synchronize()
            finally:
                prof.disable()
            c1 = counters()
            phases.append(
                dict(
                    name=name,
                    step=step,
                    s=time.perf_counter() - t0,
                    mallocs=c1.get("num_device_alloc", 0) - c0.get("num_device_alloc", 0),
                    frees=c1.get("num_device_free", 0) - c0.get("num_device_free", 0),
                    reserved=c1.get("reserved_bytes.all.current", 0),
                )
            )
            return r

        return inner

    grpo._update = timed(grpo._update, "update")
    grpo._score = timed(grpo._score, "score")
    with tempfile.TemporaryDirectory() as d:
        model = args.model
        tok, _ = tokenizer_and_data(Path(d) / "assets", rows=64)
        if model is None:
            import transformers

            from rlmem.models.presets import LLAMA

            torch.manual_seed(0)
            model = str(Path(d) / "smollm2-shape")
            transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA["smollm2-135m"])).save_pretrained(
                model
            )
        cfg = GRPOConfig(
            model=model,
            tokenizer=None if args.model else str(tok),
            data="arithmetic",
            device="cuda" if cuda else "cpu",
            steps=args.steps,
            prompts_per_step=args.prompts,
            group_size=args.group,
            max_new_tokens=args.max_new_tokens,
            lr=5e-6,
            offload=offload,
            rollout_dtype="none",
            eval_before_train=False,
            save_every=0,
            out_dir=str(Path(d) / "run"),
            progress=False,
            plot=False,
        )
        grpo.run(cfg, echo=lambda *a, **k: None)
        rows = [json.loads(line) for line in (Path(d) / "run" / "log.jsonl").read_text().splitlines()]
    (out / f"steps_{tag}.json").write_text(json.dumps({"steps": rows, "phases": phases}, indent=1))
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_stats(40)
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(30)
    (out / f"cprofile_{tag}.txt").write_text(buf.getvalue())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--model", default=None)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--only", choices=("on", "off"), help=argparse.SUPPRESS)
    args = p.parse_args()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    if args.only:
        _one(args, args.only == "on")
        return
    env = {**os.environ, "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
    for tag in ("off", "on"):
        subprocess.run([sys.executable, __file__, *sys.argv[1:], "--only", tag], check=True, env=env)
    print(f"{'':24}{'offload off':>14}{'offload on':>14}")
    runs = {t: json.loads((Path(args.out) / f"steps_{t}.json").read_text()) for t in ("off", "on")}

    def med(tag: str, key: str, rows_key: str = "steps", name: str | None = None) -> float:
        """The median over the steps after the first two (graph capture, compilation, the allocator)."""
        rows = [r for r in runs[tag][rows_key] if name is None or r.get("name") == name][2:]
        return statistics.median(r[key] for r in rows) if rows else float("nan")

    for key in ("step_s", "rollout_s", "train_s", "switch_s"):
        print(f"{key:24}{med('off', key):14.3f}{med('on', key):14.3f}")
    for name in ("score", "update"):
        for key in ("s", "mallocs", "frees"):
            off, on = med("off", key, "phases", name), med("on", key, "phases", name)
            print(f"{name + ' ' + key:24}{off:14.3f}{on:14.3f}")


if __name__ == "__main__":
    main()
