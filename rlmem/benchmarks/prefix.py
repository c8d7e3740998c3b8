"""``rlmem bench prefix``: a GRPO group's prompt held once, in the rollout's KV cache and in the train phase,
against every sample carrying its own copy, side by side in one run.

Rollout, per cell of prompt length P x group size G x new tokens R on one model (the 2.5B GQA preset by
default), both layouts over the same KV budget (the cache that holds ``--rows`` unshared rows of P + R):

- ``kv_bytes_per_completion``: the Region's measured bytes (``HFSampler.memory()["kv_cache"]``) over the rows
  each layout decodes at once in it; ``kv_bytes_ratio`` = shared / unshared (the floor is
  (P + G x R) / (G x (P + R)));
- ``rows``: the completions each layout decodes at once in that budget (``HFSampler.rows_for``);
- the same work for both, the shared layout's rows (``rows // G`` prompts, G completions each, every one
  exactly R tokens: no end-of-sequence token): the whole ``generate`` call's time, decode tokens/s, and the
  prefill (the same call for one new token); ``rollout_speedup`` = unshared call time / shared call time.

Train phase, at the headline cell: one GRPO step's scoring (the policy's log-probs, no gradient) and update
(forward and backward per micro-batch of ``--train-rows`` rows, then AdamW), fp32 weights under bf16
autocast with activation checkpointing as ``rlmem train`` runs them, row by row against packed groups
(:mod:`rlmem.recipes.shared_prompts`): time, and the peak allocated above what the state holds before the
step. Each cell is printed as it finishes and the JSON is written after each.
"""

from __future__ import annotations

import gc
import time
from typing import Any

import torch

from ..models.presets import PRESETS, build, vocab_size
from ..rollout.sampler import HFSampler, kv_bytes_per_token
from ._common import format_table, sync, timed
from ._harness import Run

NAME = "prefix"
HEADLINE = (2048, 16, 256)  # (P, G, R) of the summary
TARGETS = {
    "kv_bytes_ratio": ("<=", 0.18),
    "rollout_speedup": (">=", 2.0),
    "train_phase_speedup": (">=", 2.0),
    "train_peak_ratio": ("<=", 0.5),
}


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _prompts(n_groups: int, group: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    heads = torch.randint(0, vocab - 1, (n_groups, length), generator=g).tolist()
    return [h for h in heads for _ in range(group)]


def _timed_call(
    sampler: HFSampler, prompts: list[list[int]], new: int, device: torch.device
) -> tuple[float, Any]:
    got: list[Any] = []
    seconds = timed(lambda: got.append(sampler.generate(prompts, max_new_tokens=new, temperature=0)), device)
    return seconds, got[0]


@torch.no_grad()
def _greedy_gap(model: Any, prompts: list[list[int]], outs: list[list[int]], device: torch.device) -> dict:
    """How far each greedy token taken is from the top of the model's own full forward over the same
    sequence: the largest gap (logit of the top token less that of the one taken) and the share of steps
    within 0.1 of it (bf16's rounding of logits of these magnitudes). Two layouts as faithful as each other
    to the model take different tokens only where the top two are that close."""
    gaps = []
    for p, o in zip(prompts, outs, strict=True):
        ids = torch.tensor([p + o[:-1]], device=device)
        logits = model(input_ids=ids).logits[0, len(p) - 1 :].float()
        taken = logits.gather(-1, torch.tensor(o, device=device)[:, None])[:, 0]
        gaps.append(logits.max(-1).values - taken)
    gap = torch.cat(gaps)
    return {"max": float(gap.max()), "within_0.1": float((gap <= 0.1).float().mean()), "steps": gap.numel()}


def rollout_cell(model: Any, p: int, g: int, r: int, rows: int, vocab: int, device: torch.device) -> dict:
    """Both layouts of one cell over the budget of ``rows`` unshared rows (module docstring)."""
    out: dict[str, Any] = {"prompt_len": p, "group_size": g, "new_tokens": r, "budget_rows": rows}
    samplers = {}
    for layout in ("unshared", "shared"):
        samplers[layout] = HFSampler(
            model,
            max_len=p + r,
            batch_size=rows,
            pad_token_id=vocab - 1,
            eos_token_id=-1,  # every completion exactly r tokens: the same work in both layouts
            cuda_graphs="on" if device.type == "cuda" else "off",
            share_prompts=layout == "shared",
        )
    shared_rows = samplers["shared"].rows_for(g, r)
    n_groups = max(1, shared_rows // g)
    prompts = _prompts(n_groups, g, p, vocab, seed=p * 131 + g * 7 + r)
    outs = {}
    for layout, s in samplers.items():
        kv = s.memory()["kv_cache"]
        at_once = s.rows_for(g, r)
        _timed_call(s, prompts[: 2 * g], 2, device)  # capture and compile outside the timed calls
        prefill_s, _ = _timed_call(s, prompts, 1, device)
        call_s, outs[layout] = _timed_call(s, prompts, r, device)
        out[layout] = {
            "kv_cache_bytes": kv,
            "rows": at_once,
            "kv_bytes_per_completion": kv / at_once,
            "completions": len(prompts),
            "call_s": call_s,
            "prefill_s": prefill_s,
            "decode_tokens_per_s": len(prompts) * r / call_s,
            "captures": s.captures,
        }
        s.region.close()
    for layout in samplers:
        out[layout]["greedy_gap"] = _greedy_gap(model, prompts[::g][:4], outs[layout][::g][:4], device)
    a, b = outs["unshared"], outs["shared"]
    same = sum(x == y for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True))
    out["same_greedy_tokens"] = same / max(1, sum(len(x) for x in a))
    out["kv_bytes_ratio"] = (
        out["shared"]["kv_bytes_per_completion"] / out["unshared"]["kv_bytes_per_completion"]
    )
    out["kv_bytes_floor"] = (p + g * r) / (g * (p + r))
    out["rollout_speedup"] = out["unshared"]["call_s"] / out["shared"]["call_s"]
    del samplers, outs
    gc.collect()
    torch.cuda.empty_cache()
    return out


def train_phase(preset: str, p: int, g: int, r: int, groups: int, rows: int, device: torch.device) -> dict:
    """One GRPO step's scoring and update, row by row against packed groups (module docstring)."""
    from ..recipes.grpo import make_batch, token_logprobs
    from ..recipes.shared_prompts import Groups, micro_batches, packed_attention, packed_logprobs

    model = build(preset, device, torch.float32).train()
    vocab = vocab_size(preset)
    model.gradient_checkpointing_enable()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    autocast = lambda: torch.autocast(device.type, dtype=torch.bfloat16)  # noqa: E731
    prompts = _prompts(groups, g, p, vocab, seed=1)
    gen = torch.Generator().manual_seed(2)
    comps = torch.randint(0, vocab - 1, (groups * g, r), generator=gen).tolist()
    adv = torch.randn(groups * g, generator=gen, device="cpu").to(device)
    b = make_batch([q + c for q, c in zip(prompts, comps, strict=True)], [len(q) for q in prompts], vocab - 1)
    b = {k: v.to(device) for k, v in b.items()}
    width = b["ids"].shape[1]
    packs = Groups.from_rows(prompts, comps, g, vocab - 1)
    chunks = micro_batches(packs, range(groups), rows)
    denom = float(b["resp"].sum())
    out: dict[str, Any] = {"prompt_len": p, "group_size": g, "new_tokens": r, "groups": groups, "rows": rows}

    def unshared(grad: bool) -> None:
        for i in range(0, groups * g, rows):
            sl = slice(i, i + rows)
            with torch.set_grad_enabled(grad):
                logp = token_logprobs(model, b["ids"][sl], b["attn"][sl], autocast)
                if grad:
                    (-(logp * b["resp"][sl]).sum(-1) * adv[sl]).sum().div(denom).backward()

    def shared(grad: bool) -> None:
        for mb in chunks:
            packed = packs.pack(mb, width).to(device)
            with packed_attention(model, packed), torch.set_grad_enabled(grad):
                logp = packed_logprobs(model, packed, autocast)
                if grad:
                    rws = packed.rows.to(device)
                    (-(logp * b["resp"][rws]).sum(-1) * adv[rws]).sum().div(denom).backward()

    for name, fn in (("unshared", unshared), ("shared", shared)):
        try:
            fn(False)  # warm both passes: kernels loaded and chosen, the optimizer's states made
            fn(True)
            opt.step()
            opt.zero_grad(set_to_none=True)
            sync(device)
            cuda = device.type == "cuda"
            base = torch.cuda.memory_allocated(device) if cuda else 0
            if cuda:
                torch.cuda.reset_peak_memory_stats(device)
            score_s = timed(lambda fn=fn: fn(False), device)
            update_s = timed(lambda fn=fn: (fn(True), opt.step()), device)
            opt.zero_grad(set_to_none=True)
            out[name] = {
                "score_s": score_s,
                "update_s": update_s,
                "train_phase_s": score_s + update_s,
                "peak_above_state_bytes": torch.cuda.max_memory_allocated(device) - base if cuda else None,
            }
        except torch.OutOfMemoryError as e:
            out[name] = {"error": f"out of memory: {str(e)[:200]}"}
            opt.zero_grad(set_to_none=True)
        gc.collect()
        torch.cuda.empty_cache()
        print(f"train phase {name}: {out[name]}", flush=True)
    if "train_phase_s" in out["unshared"] and "train_phase_s" in out["shared"]:
        out["train_phase_speedup"] = out["unshared"]["train_phase_s"] / out["shared"]["train_phase_s"]
        if out["shared"]["peak_above_state_bytes"] is not None:
            out["train_peak_ratio"] = (
                out["shared"]["peak_above_state_bytes"] / out["unshared"]["peak_above_state_bytes"]
            )
    return out


def summarize(cells: list[dict[str, Any]], train: dict[str, Any] | None) -> dict[str, Any]:
    s: dict[str, Any] = {}
    head = [c for c in cells if (c["prompt_len"], c["group_size"], c["new_tokens"]) == HEADLINE]
    if head:
        s["kv_bytes_ratio"] = head[0]["kv_bytes_ratio"]
        s["rollout_speedup"] = head[0]["rollout_speedup"]
        s["same_greedy_tokens"] = head[0]["same_greedy_tokens"]
        for layout in ("shared", "unshared"):
            if "greedy_gap" in head[0][layout]:
                s[f"greedy_gap_max_{layout}"] = head[0][layout]["greedy_gap"]["max"]
    if train:
        for k in ("train_phase_speedup", "train_peak_ratio"):
            if k in train:
                s[k] = train[k]
    return s


def main(argv: list[str] | None = None) -> int:
    run_ = Run(NAME, __doc__.splitlines()[0], TARGETS)
    p = run_.parser
    p.add_argument("--preset", default="qwen2-2.5b", help="a transformers preset (default: qwen2-2.5b)")
    p.add_argument("--prompt-lens", default="2048,512,8192", help="prompt lengths P, comma-separated")
    p.add_argument("--groups", default="16,8,64", help="group sizes G, comma-separated")
    p.add_argument("--new", default="256,1024", help="new tokens R, comma-separated")
    p.add_argument("--rows", type=int, default=32, help="the KV budget: this many unshared rows of P + R")
    p.add_argument("--train-groups", type=int, default=2, help="groups in the train phase's step")
    p.add_argument("--train-rows", type=int, default=16, help="rows per train micro-batch")
    p.add_argument("--no-train", action="store_true", help="the rollout cells only")
    p.add_argument("--time-budget", type=float, default=480.0, help="seconds: no cell starts past it")
    p.add_argument("--merge", action="store_true", help="keep the cells of the file this run would write")
    p.add_argument(
        "--redo", default="", help="with --merge: measure these cells again (P:G:R, comma-separated)"
    )
    p.add_argument("--redo-train", action="store_true", help="with --merge: measure the train phase again")
    args = run_.parse(argv)
    if args.preset not in PRESETS or args.preset == "mlp-tiny":
        run_.error(f"--preset must name a transformers preset of {', '.join(PRESETS)}")
    if min(args.rows, args.train_groups, args.train_rows) < 1:
        run_.error("--rows, --train-groups and --train-rows must be >= 1")
    if not run_.needs_cuda():
        return 2
    device = run_.device
    t_start = time.perf_counter()
    prev = run_.previous() if args.merge else {}
    cells: list[dict[str, Any]] = list(prev.get("cells", []))
    train: dict[str, Any] | None = None if args.redo_train else prev.get("train")
    redo = {tuple(int(x) for x in c.split(":")) for c in args.redo.split(",") if c.strip()}
    cells = [c for c in cells if (c["prompt_len"], c["group_size"], c["new_tokens"]) not in redo]
    done = {(c["prompt_len"], c["group_size"], c["new_tokens"]) for c in cells}
    order = [(P, G, R) for P in _ints(args.prompt_lens) for G in _ints(args.groups) for R in _ints(args.new)]
    order.sort(key=lambda c: c != HEADLINE)  # the headline first: the summary needs it
    config = {
        "preset": args.preset,
        "rows_budget": args.rows,
        "train_groups": args.train_groups,
        "train_rows": args.train_rows,
        "dtype": "bf16 (rollout); fp32 weights under bf16 autocast with activation checkpointing (train)",
    }

    def write() -> None:
        run_.finish(summarize(cells, train), config=config, results={"cells": cells, "train": train})

    if not args.no_train and train is None:
        P, G, R = HEADLINE
        train = train_phase(args.preset, P, G, R, args.train_groups, args.train_rows, device)
        write()
    model = build(args.preset, device, torch.bfloat16).eval()
    vocab = vocab_size(args.preset)
    config["kv_bytes_per_token"] = kv_bytes_per_token(model.config, torch.bfloat16)
    for cell in order:
        if cell in done:
            continue
        if time.perf_counter() - t_start > args.time_budget:
            print(f"time budget spent: {cell} and the cells after it not measured", flush=True)
            break
        try:
            res = rollout_cell(model, *cell, args.rows, vocab, device)
        except torch.OutOfMemoryError as e:
            res = {"prompt_len": cell[0], "group_size": cell[1], "new_tokens": cell[2], "error": str(e)[:200]}
            gc.collect()
            torch.cuda.empty_cache()
        cells.append(res)
        if "error" not in res:
            print(
                f"P={cell[0]} G={cell[1]} R={cell[2]}: kv ratio {res['kv_bytes_ratio']:.3f} (floor "
                f"{res['kv_bytes_floor']:.3f}), rows {res['unshared']['rows']} -> {res['shared']['rows']}, "
                f"speedup {res['rollout_speedup']:.2f}x, same greedy tokens {res['same_greedy_tokens']:.3f}",
                flush=True,
            )
        else:
            print(f"P={cell[0]} G={cell[1]} R={cell[2]}: {res['error']}", flush=True)
        write()
    ok = [c for c in cells if "error" not in c]
    print(
        format_table(
            [
                {
                    "P": c["prompt_len"],
                    "G": c["group_size"],
                    "R": c["new_tokens"],
                    "kv": c["kv_bytes_ratio"],
                    "rows_u": c["unshared"]["rows"],
                    "rows_s": c["shared"]["rows"],
                    "tok_u": c["unshared"]["decode_tokens_per_s"],
                    "tok_s": c["shared"]["decode_tokens_per_s"],
                    "pre_u": c["unshared"]["prefill_s"],
                    "pre_s": c["shared"]["prefill_s"],
                    "x": c["rollout_speedup"],
                }
                for c in ok
            ],
            [
                ("P", "P", "d"),
                ("G", "G", "d"),
                ("R", "R", "d"),
                ("kv", "KV bytes ratio", ".3f"),
                ("rows_u", "rows today", "d"),
                ("rows_s", "rows shared", "d"),
                ("tok_u", "tok/s today", ".0f"),
                ("tok_s", "tok/s shared", ".0f"),
                ("pre_u", "prefill s today", ".2f"),
                ("pre_s", "prefill s shared", ".2f"),
                ("x", "speedup", ".2f"),
            ],
        )
    )
    write()
    return 0
