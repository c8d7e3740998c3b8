"""TRL's ``GRPOTrainer`` alone, with rlmem's callback, and with rlmem's sampler too: device memory in use at
its peak while TRL generates and while it trains, the step time, and generation tokens per second.

The parts: ``trl`` (TRL alone), ``callback`` (:class:`~rlmem.integrations.trl.RLMemCallback`), ``sampler``
(:func:`~rlmem.integrations.trl.sampler_rollout` and its callback), ``trl-again`` (TRL alone a second time:
whether TRL repeats itself bit for bit on this device, without which ``bit_identical`` cannot hold).

Each part is a process of its own (a fresh CUDA context) running ``--steps`` GRPO steps of a random model of
``--model``'s shape (a preset; the tokenizer trained here, the built-in arithmetic questions as prompts) with
the same seed. The device's memory in use (``cudaMemGetInfo``: total less free, so rlmem's Regions count as
PyTorch's allocations do) is sampled every millisecond by a thread; generation is ``GRPOTrainer._generate``,
timed and its completion tokens counted; the rest of a step is training. Figures are medians over the steps
after the first (its generation compiles and captures); peaks are maxima over those steps.

Summary: ``generation_peak_vs_trl`` (the callback's generation peak over TRL's), ``generation_peak_drop_gib``
and ``optimizer_gib`` (what the callback keeps away: the optimizer states), ``step_vs_trl`` (the callback's
step over TRL's), ``generation_speedup_vs_trl`` (tokens per second with the sampler over TRL's),
``bit_identical`` (losses, gradient norms and final weights of TRL alone and with the callback), and
``trl_reproducible`` (the same of TRL alone twice).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from typing import Any

import torch

from ._common import format_table, package_version, spawn_part
from ._harness import Run

NAME = "trl"
PARTS = ("trl", "callback", "sampler", "trl-again")
TARGETS = {
    "bit_identical": ("==", True),
    "step_vs_trl": ("<=", 1.05),
    "generation_peak_drop_vs_optimizer": (">=", 1.0),
    "generation_speedup_vs_trl": (">=", 2.0),
}


class _Used:
    """The device's memory in use, sampled by a thread: :meth:`mark` starts a window, :meth:`peak` ends it.

    A reading the thread began before :meth:`mark` belongs to the window before and is dropped: the
    thread's read can wait for a device synchronize the mark itself waited out, and then returns what was
    in use before it (the last phase's peak, credited to the next one)."""

    def __init__(self, device: torch.device, read: Any = None) -> None:
        self.device, self.top, self._stop = device, 0, False
        self._read = read or self._used
        self._lock = threading.Lock()
        self._window = 0
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _used(self) -> int:
        if self.device.type != "cuda":
            return 0
        free, total = torch.cuda.mem_get_info(self.device)
        return int(total - free)

    def _run(self) -> None:
        while not self._stop:
            window = self._window
            v = self._read()
            with self._lock:
                if window == self._window:
                    self.top = max(self.top, v)
            time.sleep(0.001)

    def mark(self) -> None:
        v = self._read()
        with self._lock:
            self._window += 1
            self.top = v

    def peak(self) -> int:
        v = self._read()
        with self._lock:
            self.top = max(self.top, v)
            return self.top

    def stop(self) -> None:
        self._stop = True
        self._thread.join(timeout=5)


def run_part(args: argparse.Namespace, part: str) -> dict[str, Any]:
    import datasets
    import trl
    from transformers import AutoTokenizer, TrainerCallback

    from ..integrations.trl import RLMemCallback, sampler_rollout
    from ..models.presets import build
    from .assets import tokenizer_and_data

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    with tempfile.TemporaryDirectory() as d:
        tok_dir, data = tokenizer_and_data(d, rows=max(64, args.prompts * args.steps))
        tok = AutoTokenizer.from_pretrained(str(tok_dir))
        prompts = [json.loads(x)["prompt"] for x in data.read_text().splitlines() if x.strip()]
        model = build(args.model, device, torch.float32, seed=0)
        model.config.pad_token_id, model.config.eos_token_id = tok.pad_token_id, tok.eos_token_id
        cfg = trl.GRPOConfig(
            output_dir=d,
            per_device_train_batch_size=args.prompts * args.group,
            num_generations=args.group,
            max_completion_length=args.max_new_tokens,
            max_steps=args.steps,
            learning_rate=1e-6,
            logging_steps=1,
            save_strategy="no",
            report_to=[],
            use_cpu=not cuda,
            bf16=cuda,
            seed=0,
        )
        used = _Used(device)
        rows: list[dict[str, Any]] = []

        class Probe(TrainerCallback):
            def on_step_begin(self, *a: Any, **k: Any) -> None:
                if cuda:
                    torch.cuda.synchronize(device)
                rows.append({"t0": time.perf_counter()})

            def on_step_end(self, *a: Any, **k: Any) -> None:
                if cuda:
                    torch.cuda.synchronize(device)
                r = rows[-1]
                r["step_s"] = time.perf_counter() - r["t0"]
                r["train_peak"] = used.peak()

        callbacks: list[Any] = []
        rollout = None
        if part == "callback":
            callbacks.append(RLMemCallback())
        elif part == "sampler":
            rollout = sampler_rollout()
            callbacks.append(rollout.callback)
        callbacks.append(Probe())
        trainer = trl.GRPOTrainer(
            model=model,
            reward_funcs=[lambda completions, **_: [float(len(c) % 7) for c in completions]],
            args=cfg,
            train_dataset=datasets.Dataset.from_list([{"prompt": p} for p in prompts]),
            processing_class=tok,
            callbacks=callbacks,
            rollout_func=rollout,
        )
        generate = trainer._generate

        def timed_generate(batch: list) -> Any:
            if cuda:
                torch.cuda.synchronize(device)
            used.mark()
            t0 = time.perf_counter()
            out = generate(batch)
            if cuda:
                torch.cuda.synchronize(device)
            r = rows[-1]
            r["gen_s"] = time.perf_counter() - t0
            r["gen_peak"] = used.peak()
            r["gen_tokens"] = int(sum(len(c) for c in out[1])) if isinstance(out, tuple) else None
            used.mark()  # the training window starts here
            return out

        trainer._generate = timed_generate
        trainer.train()
        used.stop()
        logs = [{k: r[k] for k in ("loss", "grad_norm") if k in r} for r in trainer.state.log_history]
        h = hashlib.sha256()
        for n, p in trainer.model.named_parameters():
            h.update(n.encode())
            h.update(p.detach().float().cpu().numpy().tobytes())
        opt = trainer.optimizer.optimizer if hasattr(trainer.optimizer, "optimizer") else trainer.optimizer
        states = [v for st in opt.state.values() for v in st.values() if torch.is_tensor(v)]
        opt_bytes = sum(v.numel() * v.element_size() for v in states)
    logs = [x for x in logs if x]
    return {"steps": rows, "logs": logs, "weights_sha256": h.hexdigest(), "optimizer_bytes": opt_bytes}


def summarize(res: dict[str, Any]) -> dict[str, Any]:
    def med(part: str, key: str) -> float | None:
        xs = [r[key] for r in res.get(part, {}).get("steps", [])[1:] if r.get(key) is not None]
        return statistics.median(xs) if xs else None

    def top(part: str, key: str) -> int | None:
        xs = [r[key] for r in res.get(part, {}).get("steps", [])[1:] if r.get(key) is not None]
        return max(xs) if xs else None

    s: dict[str, Any] = {}
    for part in PARTS:
        if "steps" not in res.get(part, {}):
            continue
        gen_s, toks = med(part, "gen_s"), med(part, "gen_tokens")
        key = part.replace("-", "_")
        s[f"step_s_{key}"] = med(part, "step_s")
        s[f"generation_peak_gib_{key}"] = (top(part, "gen_peak") or 0) / 2**30
        s[f"train_peak_gib_{key}"] = (top(part, "train_peak") or 0) / 2**30
        if gen_s and toks:
            s[f"generation_tokens_per_s_{key}"] = toks / gen_s
    base, cb, smp = res.get("trl", {}), res.get("callback", {}), res.get("sampler", {})

    def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
        return a["logs"] == b["logs"] and a["weights_sha256"] == b["weights_sha256"]

    if "steps" in base and "steps" in cb:
        s["bit_identical"] = same(base, cb)
        s["step_vs_trl"] = s["step_s_callback"] / s["step_s_trl"]
        peak_trl, peak_cb = s["generation_peak_gib_trl"], s["generation_peak_gib_callback"]
        if peak_trl:
            s["generation_peak_vs_trl"] = peak_cb / peak_trl
        s["generation_peak_drop_gib"] = peak_trl - peak_cb
        s["optimizer_gib"] = base["optimizer_bytes"] / 2**30
        if s["optimizer_gib"]:
            s["generation_peak_drop_vs_optimizer"] = s["generation_peak_drop_gib"] / s["optimizer_gib"]
    again = res.get("trl-again", {})
    if "steps" in base and "steps" in again:
        s["trl_reproducible"] = same(base, again)
    if "steps" in base and "steps" in smp:
        a, b = s.get("generation_tokens_per_s_sampler"), s.get("generation_tokens_per_s_trl")
        if a and b:
            s["generation_speedup_vs_trl"] = a / b
    return s


def main(argv: list[str] | None = None) -> int:
    run_ = Run(NAME, __doc__.splitlines()[0], TARGETS)
    p = run_.parser
    p.add_argument("--model", default=None, help="a preset (default: qwen2-1.5b GPU, qwen2-tiny CPU)")
    p.add_argument("--prompts", type=int, default=None, help="prompts per step (default: 16 GPU, 2 CPU)")
    p.add_argument("--group", type=int, default=8, help="samples per prompt")
    p.add_argument("--max-new-tokens", type=int, default=None, help="default: 256 GPU, 8 CPU")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--parts", default=",".join(PARTS), help=f"which of {', '.join(PARTS)}")
    p.add_argument("--part", default=None, choices=PARTS, help=argparse.SUPPRESS)
    args = run_.parse(argv)
    gpu = run_.device.type == "cuda"
    args.device = str(run_.device)
    args.model = args.model or ("qwen2-1.5b" if gpu else "qwen2-tiny")
    args.prompts = args.prompts or (16 if gpu else 2)
    args.max_new_tokens = args.max_new_tokens or (256 if gpu else 8)
    if args.part:
        print(json.dumps(run_part(args, args.part)), flush=True)
        return 0
    parts = [x for x in args.parts.split(",") if x]
    if not parts or any(x not in PARTS for x in parts):
        run_.error(f"--parts must be a comma-separated subset of {', '.join(PARTS)}")
    for k in ("group", "steps", "prompts", "max_new_tokens"):
        if getattr(args, k) < 1:
            run_.error(f"--{k.replace('_', '-')} must be a positive int")
    forward = ["--device", args.device, "--model", args.model, "--prompts", str(args.prompts)]
    forward += ["--group", str(args.group), "--max-new-tokens", str(args.max_new_tokens)]
    forward += ["--steps", str(args.steps)]
    res = {part: spawn_part("rlmem.benchmarks.trl", part, forward) for part in parts}
    failed = {k: v["error"] for k, v in res.items() if "error" in v}
    for k, v in failed.items():
        print(f"{k} failed:\n{v}", file=sys.stderr)
    summary = summarize(res)
    keys = {part: part.replace("-", "_") for part in parts}
    rows = [
        {
            "part": part,
            "step": summary.get(f"step_s_{k}"),
            "gen": summary.get(f"generation_peak_gib_{k}"),
            "train": summary.get(f"train_peak_gib_{k}"),
            "tps": summary.get(f"generation_tokens_per_s_{k}"),
        }
        for part, k in keys.items()
        if f"step_s_{k}" in summary
    ]
    cols = [("part", "part", "s"), ("step", "step s", ".3f"), ("gen", "generation peak GiB", ".2f")]
    cols += [("train", "train peak GiB", ".2f"), ("tps", "generation tok/s", ".0f")]
    print(format_table(rows, cols))
    config = {k: v for k, v in vars(args).items() if k not in ("part", "json", "machine")}
    config["trl"] = package_version("trl")
    run_.finish(summary, config=config, results=res)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
