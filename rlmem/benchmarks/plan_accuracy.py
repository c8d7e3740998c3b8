"""Benchmark of ``rlmem plan``'s accuracy: predicted against measured peak memory of docs/design.md's 2.47B
Qwen2-shaped model (``qwen2-2.5b``, random init, bf16, torch's AdamW) on one GPU.

Configurations: training steps over ``batch x seq`` tokens with HF's causal-LM loss (no checkpointing;
``rlmem.checkpoint`` of every layer or one in two, with gradient accumulation; ``rlmem.offload_activations``
of every dense name; checkpointing plus offload), and rollouts with rlmem's HF sampler (static KV cache in
a Region, prompts prefilled in one pass) with and without rlmem's offload of the training state
(``PhaseManager``, optimizer states offloaded, weights kept for the sampler).

Measured peak, per configuration: one steady training step (the optimizer states exist; a first step ran
before and is not measured) or one rollout: PyTorch's ``max_memory_allocated`` during it, plus the bytes
resident in rlmem's Regions then (the KV cache, the adopted training state), i.e. the tensor bytes the
estimate predicts. Also recorded: ``max_memory_reserved`` plus the same Regions plus the CUDA context
measured before the model existed, against the estimate's phase peak plus its CUDA context figure (the
caching allocator's fragmentation is not modelled; the recommender keeps headroom for it).
Summary: ``max_abs_error_fraction`` = max over configurations of |predicted - measured| / measured
(tensor bytes; target <= 0.10), and ``max_abs_error_fraction_device`` for the device figure.
"""

from __future__ import annotations

import gc
import os
from typing import Any

import torch

from .._units import GiB as _GiB
from ..activations.modmap import DENSE_NAMES
from ..models import presets
from ..plan import PlanOptions, Workload, estimate_memory

NAME = "plan_accuracy"
TARGETS = {"max_abs_error_fraction": ("<=", 0.10)}

_ATTN = ("attn_norm", "qkv_linear", "core_attn", "attn_proj")
# kind, batch x seq, checkpoint one layer in ckpt, offload (True: every dense name), accum, states offload
CONFIGS: list[dict[str, Any]] = [
    {"name": "train bs1x2048", "kind": "train", "batch": 1, "seq": 2048},
    {"name": "train bs2x4096", "kind": "train", "batch": 2, "seq": 4096},
    {"name": "train bs4x4096 ckpt", "kind": "train", "batch": 4, "seq": 4096, "ckpt": 1},
    {
        "name": "train bs2x4096 ckpt1/2 accum2",
        "kind": "train",
        "batch": 2,
        "seq": 4096,
        "ckpt": 2,
        "accum": 2,
    },
    {"name": "train bs2x4096 act-offload", "kind": "train", "batch": 2, "seq": 4096, "offload": True},
    {
        "name": "train bs1x8192 ckpt+offload",
        "kind": "train",
        "batch": 1,
        "seq": 8192,
        "ckpt": 1,
        "offload": True,
    },
    {"name": "rollout b128x2048", "kind": "rollout", "batch": 128, "seq": 2048, "prompt": 512},
    {
        "name": "rollout b128x2048 offload",
        "kind": "rollout",
        "batch": 128,
        "seq": 2048,
        "prompt": 512,
        "states": True,
    },
    # Added after the estimator's rollout terms were corrected against the rows above: shapes it was not
    # adjusted to (many short sequences, part of the names offloaded, a long cache with a long prompt).
    {"name": "train bs8x1024", "kind": "train", "batch": 8, "seq": 1024},
    {"name": "train bs3x3072 act-offload attn", "kind": "train", "batch": 3, "seq": 3072, "offload": _ATTN},
    {
        "name": "rollout b48x4096 offload",
        "kind": "rollout",
        "batch": 48,
        "seq": 4096,
        "prompt": 2048,
        "states": True,
    },
]


def _names(cfg: dict[str, Any]) -> tuple[str, ...]:
    off = cfg.get("offload")
    return DENSE_NAMES if off is True else tuple(off or ())


def predict(cfg: dict[str, Any]) -> Any:
    o = PlanOptions(
        checkpoint_every=cfg.get("ckpt", 0),
        offload_modules=_names(cfg),
        offload_states=cfg.get("states", False),
    )
    if cfg["kind"] == "train":
        w = Workload(
            micro_batch_tokens=cfg["batch"] * cfg["seq"],
            seq_len=cfg["seq"],
            grad_accumulation=cfg.get("accum", 1),
        )
    else:
        w = Workload(
            micro_batch_tokens=2048,
            rollout_batch=cfg["batch"],
            rollout_len=cfg["seq"],
            prompt_len=cfg["prompt"],
        )
    return estimate_memory("qwen2-2.5b", w, o)


def _train_step(model: Any, opt: Any, ids: list[torch.Tensor], off: Any) -> None:
    model.zero_grad(set_to_none=True)
    for x in ids:
        with off:
            model(input_ids=x, labels=x, use_cache=False).loss.backward()
    opt.step()


def _measure_train(model: Any, cfg: dict[str, Any], device: torch.device) -> dict[str, Any]:
    import contextlib

    from .. import checkpoint, offload_activations

    vocab = model.config.vocab_size
    g = torch.Generator(device=device).manual_seed(0)
    ids = [
        torch.randint(0, vocab, (cfg["batch"], cfg["seq"]), device=device, generator=g)
        for _ in range(cfg.get("accum", 1))
    ]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    ck = checkpoint(model, every=cfg["ckpt"]) if cfg.get("ckpt") else None
    off = offload_activations(model, list(_names(cfg))) if cfg.get("offload") else contextlib.nullcontext()
    try:
        _train_step(model, opt, ids, off)  # creates the optimizer states, warms the offloader's pool
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        _train_step(model, opt, ids, off)
        torch.cuda.synchronize(device)
        out = {
            "peak_allocated_bytes": torch.cuda.max_memory_allocated(device),
            "peak_reserved_bytes": torch.cuda.max_memory_reserved(device),
            "region_bytes": 0,
        }
        if cfg.get("offload"):
            out["offloaded_bytes"] = off.stats().offloaded_bytes
        return out
    finally:
        if ck is not None:
            ck.remove()
        if cfg.get("offload"):
            off.remove()
        model.zero_grad(set_to_none=True)
        del opt
        gc.collect()
        torch.cuda.empty_cache()


def _measure_rollout(model: Any, cfg: dict[str, Any], device: torch.device) -> dict[str, Any]:
    from .. import OffloadConfig, PhaseManager
    from ..rollout.sampler import HFSampler

    vocab = model.config.vocab_size
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    x = torch.randint(0, vocab, (1, 256), device=device)
    model(input_ids=x, labels=x, use_cache=False).loss.backward()
    opt.step()  # optimizer states exist, as between RL steps
    model.zero_grad(set_to_none=True)
    pm = PhaseManager(
        model, opt, OffloadConfig(offload_during_rollout=bool(cfg.get("states")), params="keep")
    )
    sampler = HFSampler(model, max_len=cfg["seq"], batch_size=cfg["batch"], pad_token_id=0, eos_token_id=1)
    pm.add_engine(sampler)
    if pm.enabled:
        sampler.sleep()  # as between RL steps: the engine sleeps while the train phase runs
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(2, vocab, (cfg["batch"], cfg["prompt"]), generator=g).tolist()
    try:
        model.eval()
        with pm.rollout():
            torch.cuda.synchronize(device)
            gc.collect()
            torch.cuda.reset_peak_memory_stats(device)
            sampler.generate(prompts, max_new_tokens=16, temperature=1.0, seed=0)
            torch.cuda.synchronize(device)
            regions = sampler.region.resident_bytes
            if pm.state is not None:
                regions += sum(c.resident_bytes for c in pm.state.stats().categories.values())
            out = {
                "peak_allocated_bytes": torch.cuda.max_memory_allocated(device),
                "peak_reserved_bytes": torch.cuda.max_memory_reserved(device),
                "region_bytes": regions,
            }
        return out
    finally:
        model.train()
        if pm.state is not None:
            pm.state.close()
        sampler.region.close()
        del opt, pm, sampler
        gc.collect()
        torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> int:
    from ._common import check_targets, format_table, package_version
    from ._harness import Run

    run_ = Run(NAME, __doc__.splitlines()[0], TARGETS)
    run_.parser.add_argument(
        "--only", default=None, help="comma-separated configuration names (default: all)"
    )
    args = run_.parse(argv)
    if not run_.needs_cuda():
        return 2
    # Segments that grow in place: reserved memory then follows allocated memory (the estimate's figure).
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    device = run_.device
    torch.empty(1, device=device)
    free, total = torch.cuda.mem_get_info(device)
    context = total - free - torch.cuda.memory_reserved(device)
    model = presets.build("qwen2-2.5b", device, torch.bfloat16).train()
    configs = CONFIGS
    if args.only:
        wanted = set(args.only.split(","))
        configs = [c for c in CONFIGS if c["name"] in wanted]
    results, rows = {}, []
    for cfg in configs:
        est = predict(cfg)
        predicted = est.train_peak_bytes if cfg["kind"] == "train" else est.rollout_peak_bytes
        at = est.train_peak_at if cfg["kind"] == "train" else est.rollout_peak_at
        device_predicted = predicted + est.categories["CUDA context"] + est.categories["NCCL (rough)"]
        try:
            m = (_measure_train if cfg["kind"] == "train" else _measure_rollout)(model, cfg, device)
        except torch.OutOfMemoryError as e:
            results[cfg["name"]] = {"config": cfg, "oom": str(e)[:200], "predicted_bytes": predicted}
            print(f"{cfg['name']}: out of memory")
            continue
        measured = m["peak_allocated_bytes"] + m["region_bytes"]
        device_measured = m["peak_reserved_bytes"] + m["region_bytes"] + context
        r = {
            "config": cfg,
            **m,
            "measured_bytes": measured,
            "predicted_bytes": predicted,
            "predicted_at": at,
            "error_fraction": (predicted - measured) / measured,
            "device_measured_bytes": device_measured,
            "device_predicted_bytes": device_predicted,
            "device_error_fraction": (device_predicted - device_measured) / device_measured,
            "points": est.points,
        }
        results[cfg["name"]] = r
        rows.append(
            {
                "name": cfg["name"],
                "pred": predicted / _GiB,
                "meas": measured / _GiB,
                "err": 100 * r["error_fraction"],
                "at": at,
                "dpred": device_predicted / _GiB,
                "dmeas": device_measured / _GiB,
                "derr": 100 * r["device_error_fraction"],
            }
        )
        print(
            f"{cfg['name']}: predicted {predicted / _GiB:.2f} GiB ({at}), measured {measured / _GiB:.2f} GiB"
        )
    print(
        format_table(
            rows,
            [
                ("name", "configuration", "s"),
                ("pred", "predicted GiB", ".2f"),
                ("meas", "measured GiB", ".2f"),
                ("err", "error %", "+.1f"),
                ("at", "predicted peak at", "s"),
                ("dpred", "device pred", ".2f"),
                ("dmeas", "device meas", ".2f"),
                ("derr", "device err %", "+.1f"),
            ],
        )
    )
    measured_rows = [r for r in results.values() if "error_fraction" in r]
    summary = {
        "configurations": len(measured_rows),
        "out_of_memory": len(results) - len(measured_rows),
        "max_abs_error_fraction": max((abs(r["error_fraction"]) for r in measured_rows), default=None),
        "mean_abs_error_fraction": (
            sum(abs(r["error_fraction"]) for r in measured_rows) / len(measured_rows)
            if measured_rows
            else None
        ),
        "max_abs_error_fraction_device": max(
            (abs(r["device_error_fraction"]) for r in measured_rows), default=None
        ),
        "cuda_context_bytes": context,
    }
    met = check_targets({k: v for k, v in summary.items() if v is not None}, TARGETS)
    run_.finish(
        summary,
        met=met,
        name_key="benchmark",
        transformers=package_version("transformers"),
        model="qwen2-2.5b",
        allocator=os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
        results=results,
    )
    return 0
