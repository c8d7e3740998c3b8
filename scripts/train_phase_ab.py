"""Where offload's extra train time goes, measured in one process: rlmem train's train phase (scoring, then
an update over micro-batches, as ``rlmem.recipes.grpo`` runs them) on a random model of SmolLM2-135M's shape,
under four conditions taken in turn, round after round, so that drift between blocks of steps cannot pass
for a cost:

- ``plain``: the model without rlmem, PyTorch's cache kept from the step before;
- ``plain+empty``: the same, PyTorch's cache given back (``torch.cuda.empty_cache()``) before the step, as
  the switch to rollout does with offload on;
- ``state``: a twin under ``rlmem.TrainState``, its optimizer states offloaded and gradients discarded
  between steps (as during a rollout), the cache kept;
- ``state+empty``: the same with the cache given back before the step (``rlmem train``'s offload before).

Each step is timed after its reload, to the end of its optimizer step (synchronized). Prints the medians and
the differences; writes ``train_phase_ab.json`` to OUT.

Usage: python scripts/train_phase_ab.py OUT [--rounds 8] [--seqs 512] [--micro-batch 64] [--len 130]
       [--tiny]
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from pathlib import Path

import torch
import transformers

from rlmem import TrainState
from rlmem.recipes.grpo import token_logprobs

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # off a GPU: a smoke test of the script (--tiny)


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _model(tiny: bool) -> torch.nn.Module:
    cfg = transformers.LlamaConfig(
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=2 if tiny else 30,
        num_attention_heads=9,
        num_key_value_heads=3,
        vocab_size=49152,
        tie_word_embeddings=True,
        max_position_embeddings=2048,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).to(DEVICE)


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, ids: torch.Tensor, mbs: int) -> None:
    def autocast() -> torch.autocast:
        return torch.autocast(DEVICE, dtype=torch.bfloat16)

    attn = torch.ones_like(ids)
    starts = range(0, len(ids), mbs)
    with torch.no_grad():  # scoring: the old policy's log-probs
        old = [token_logprobs(model, ids[i : i + mbs], attn[i : i + mbs], autocast) for i in starts]
    for j, i in enumerate(starts):
        logp = token_logprobs(model, ids[i : i + mbs], attn[i : i + mbs], autocast)
        loss = -(torch.exp(logp - old[j]) * 0.1).mean()
        loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--seqs", type=int, default=512)
    p.add_argument("--micro-batch", type=int, default=64)
    p.add_argument("--len", type=int, default=130)
    p.add_argument("--tiny", action="store_true", help="two layers (a smoke test)")
    args = p.parse_args()
    plain = _model(args.tiny)
    twin = copy.deepcopy(plain)
    opt_p = torch.optim.AdamW(plain.parameters(), lr=1e-6)
    opt_t = torch.optim.AdamW(twin.parameters(), lr=1e-6)
    ids = torch.randint(0, 49152, (args.seqs, args.len), device=DEVICE)
    for m, o in ((plain, opt_p), (twin, opt_t)):  # optimizer states exist before adoption
        _step(m, o, ids, args.micro_batch)
    state = TrainState(twin, opt_t)
    times: dict[str, list[float]] = {k: [] for k in ("plain", "plain+empty", "state", "state+empty")}

    def run(name: str) -> float:
        under = name.startswith("state")
        if under:
            state.reload(blocking=True)
        if name.endswith("+empty") and DEVICE == "cuda":
            torch.cuda.empty_cache()
        _sync()
        t0 = time.perf_counter()
        _step(twin if under else plain, opt_t if under else opt_p, ids, args.micro_batch)
        _sync()
        dt = time.perf_counter() - t0
        if under:
            state.offload(params="keep", grads="discard", optimizer="offload", blocking=True)
        return dt

    names = list(times)
    for name in names:  # warm-up: one of each
        run(name)
    for r in range(args.rounds):
        for name in names[r % 4 :] + names[: r % 4]:
            times[name].append(run(name))
    med = {k: statistics.median(v) for k, v in times.items()}
    for k, v in med.items():
        print(f"{k:12s} {v * 1e3:8.1f} ms  ({', '.join(f'{x * 1e3:.0f}' for x in times[k])})")
    diff = {
        "empty_cache_cost_plain": med["plain+empty"] - med["plain"],
        "empty_cache_cost_state": med["state+empty"] - med["state"],
        "state_cost_kept_cache": med["state"] - med["plain"],
        "state_empty_vs_plain": med["state+empty"] - med["plain"],
    }
    for k, v in diff.items():
        print(f"{k:24s} {v * 1e3:+8.1f} ms  ({v / med['plain']:+.1%} of plain)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    data = {
        "config": vars(args),
        "device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu",
        "times_s": times,
        "median_s": med,
    }
    data["differences_s"] = diff
    (out / "train_phase_ab.json").write_text(json.dumps(data, indent=1))


if __name__ == "__main__":
    main()
