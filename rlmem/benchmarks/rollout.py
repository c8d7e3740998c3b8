"""Benchmark of rollout decoding: rlmem's ``HFSampler`` eager and with CUDA graphs against transformers'
``generate()`` (dynamic and static cache) and the memory-bandwidth bound of a decode step.

Greedy decoding, bf16, a random model of ``--preset`` (default the 2.7B Qwen2 shape with full multi-head
KV), ``--prompt-len`` tokens of prompt and ``--new-tokens`` generated for every row (no EOS stops a row).
rlmem runs eager, with CUDA graphs (``rlmem_graphs_unfused``), and with CUDA graphs over fused norms, gates
and rotary embeddings (``rlmem_graphs``: ``HFSampler``'s default with graphs, ``fused="auto"``).
Per batch size and contender: milliseconds per decode step, ``(T(new) - T(1)) / (new - 1)`` from two timed
calls (so the prefill and the first token are not in it), and the first call's time apart (capture or
compilation). The bound of a step is the bytes it must read once, the weights plus the mean KV cache over
the decode, at the device bandwidth measured in the same run (a large device-to-device copy).

A step of rlmem's attends over the cache-length bucket that holds its column (``HFSampler.kv_block``);
``generate()``'s static cache attends over the whole cache.

Summary: ``graph_vs_bound_b64`` (bound over the graph step at batch 64), ``speedup_vs_hf_generate_b64``
(``generate()`` with its static cache over the graph step), ``capture_s`` (``HFSampler.capture()``: every
batch-size bucket over every cache-length bucket of the rollout's length, the fused kernels compiled from
an empty Inductor cache unless ``--warm-compile``), and
``recaptures_over_100_cycles`` (captures during 100 sleep/wake cycles with a short rollout in each).
"""

from __future__ import annotations

import gc
import os
import tempfile
import time
from typing import Any

import torch

from ..integrations.hf import HFSampler, kv_bytes_per_token
from ..plan.presets import build, vocab_size
from ._common import format_table
from ._harness import Run

NAME = "rollout"
TARGETS = {
    "graph_vs_bound_b64": (">=", 0.5),
    "speedup_vs_hf_generate_b64": (">=", 3.0),
    "capture_s": ("<", 10.0),
    "recaptures_over_100_cycles": ("<=", 0),
}


def _bandwidth(device: torch.device, nbytes: int = 2 << 30) -> float:
    """Device memory bandwidth, bytes/s: a copy reads and writes ``nbytes`` (best of 5)."""
    a = torch.empty(nbytes, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    best = float("inf")
    for _ in range(5):
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        b.copy_(a)
        torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - t0)
    del a, b
    return 2 * nbytes / best


def _timed(fn: Any, device: torch.device) -> float:
    torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize(device)
    return time.perf_counter() - t0


def _per_step(call: Any, new: int, device: torch.device) -> dict[str, float]:
    first = _timed(lambda: call(new), device)
    full = _timed(lambda: call(new), device)
    one = _timed(lambda: call(1), device)
    return {"first_call_s": first, "call_s": full, "ms_per_step": (full - one) / (new - 1) * 1e3}


def _sampler(model: Any, rows: int, max_len: int, graphs: str, vocab: int, fused: str = "auto") -> HFSampler:
    # eos -1: no row ever stops early, every call decodes the same number of steps
    return HFSampler(
        model,
        max_len=max_len,
        batch_size=rows,
        pad_token_id=vocab - 1,
        eos_token_id=-1,
        cuda_graphs=graphs,
        fused=fused,
    )


def measure(model: Any, rows: int, args: Any, vocab: int, device: torch.device) -> dict[str, Any]:
    g = torch.Generator().manual_seed(rows)
    prompts = torch.randint(0, vocab - 1, (rows, args.prompt_len), generator=g)
    max_len = args.prompt_len + args.new_tokens
    out: dict[str, Any] = {}
    for who, graphs, fused in (
        ("rlmem_eager", "off", "off"),
        ("rlmem_graphs_unfused", "on", "off"),
        ("rlmem_graphs", "on", "on"),
    ):
        s = _sampler(model, rows, max_len, graphs, vocab, fused)
        lists = prompts.tolist()
        out[who] = _per_step(
            lambda n, s=s, lists=lists: s.generate(lists, max_new_tokens=n, temperature=0),
            args.new_tokens,
            device,
        )
        out[who]["captures"] = s.captures
        out[who]["graph_pool_bytes"] = s.graph_pool_bytes
        s.region.close()
        del s
        gc.collect()
        torch.cuda.empty_cache()
    ids = prompts.to(device)
    for who, impl in (("hf_dynamic", None), ("hf_static", "static")):
        kw: dict[str, Any] = {"cache_implementation": impl} if impl else {}

        def call(n: int, kw: dict[str, Any] = kw) -> Any:
            return model.generate(
                ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=vocab - 1, **kw
            )

        try:
            out[who] = _per_step(call, args.new_tokens, device)
        except Exception as e:  # a transformers release without this path: say so, keep the rest
            out[who] = {"error": f"{type(e).__name__}: {e}"[:300]}
        gc.collect()
        torch.cuda.empty_cache()
    return out


def recaptures(model: Any, args: Any, vocab: int, cycles: int = 100) -> dict[str, Any]:
    s = _sampler(model, 8, args.prompt_len + 8, "on", vocab)
    prompts = torch.randint(0, vocab - 1, (8, args.prompt_len), generator=torch.Generator().manual_seed(0))
    lists = prompts.tolist()
    first = s.generate(lists, max_new_tokens=4, temperature=0)
    before = s.captures
    same = True
    for _ in range(cycles):
        s.sleep()
        s.wake()
        same = same and s.generate(lists, max_new_tokens=4, temperature=0) == first
    out = {
        "cycles": cycles,
        "captures_before": before,
        "recaptures": s.captures - before,
        "same_tokens": same,
    }
    s.region.close()
    return out


def main(argv: list[str] | None = None) -> int:
    run_ = Run(NAME, __doc__.splitlines()[0], TARGETS)
    p = run_.parser
    p.add_argument("--preset", default="qwen2-2.7b-mha")
    p.add_argument("--batches", default="1,16,64,256")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=512)
    p.add_argument("--merge", action="store_true", help="keep batch sizes of an existing JSON not run now")
    p.add_argument(
        "--capture-batch",
        type=int,
        default=None,
        help="the batch whose buckets capture_s times (default: the largest of --batches)",
    )
    p.add_argument(
        "--warm-compile",
        action="store_true",
        help="capture_s with Inductor's on-disk cache as found (default: an empty one, as on a new machine)",
    )
    args = run_.parse(argv)
    if not args.warm_compile:  # before anything compiles: the fused kernels are compiled from nothing
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="rlmem-inductor-")
    batches = [int(x) for x in args.batches.split(",") if x.strip()]
    if not batches and not args.capture_batch:
        run_.error("--batches is empty: give --capture-batch to time the capture alone")
    if args.capture_batch is not None and args.capture_batch < 1:
        run_.error(f"--capture-batch must be >= 1, got {args.capture_batch}")
    if not run_.needs_cuda():
        return 2
    device = run_.device
    bw = _bandwidth(device)
    model = build(args.preset, device, torch.bfloat16).eval()
    vocab = vocab_size(args.preset)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    kv_token = kv_bytes_per_token(model.config, torch.bfloat16)
    print(f"bandwidth {bw / 1e12:.2f} TB/s; weights {weight_bytes / 2**30:.2f} GiB", flush=True)
    # batch sizes measured in an earlier call (one call of the GPU machine does not fit them all)
    res: dict[str, Any] = run_.previous() if args.merge else {}
    rows = []
    # capture time: one sampler of the largest batch and the rollout's length, every graph it can replay
    # (each batch-size bucket over each cache-length bucket)
    max_len = args.prompt_len + args.new_tokens
    cap_batch = args.capture_batch or max(batches)
    cap = _sampler(model, cap_batch, max_len, "on", vocab)
    t_cap = cap.capture()
    captures = cap.captures
    cap_pool = cap.graph_pool_bytes
    cap.region.close()
    del cap
    gc.collect()
    torch.cuda.empty_cache()
    for b in batches:
        r = measure(model, b, args, vocab, device)
        mean_ctx = args.prompt_len + args.new_tokens / 2
        bound_s = (weight_bytes + b * mean_ctx * kv_token) / bw
        r["bound_ms"] = bound_s * 1e3
        res[str(b)] = r
        for who, v in r.items():
            if isinstance(v, dict) and "ms_per_step" in v:
                rows.append(
                    {
                        "batch": b,
                        "who": who,
                        "ms": v["ms_per_step"],
                        "x_bound": bound_s * 1e3 / v["ms_per_step"],
                        "tok_s": b / v["ms_per_step"] * 1e3,
                        "first_s": v["first_call_s"],
                    }
                )
        print(
            f"batch {b}: bound {bound_s * 1e3:.2f} ms; "
            + ", ".join(
                f"{w} {v['ms_per_step']:.2f} ms"
                for w, v in r.items()
                if isinstance(v, dict) and "ms_per_step" in v
            ),
            flush=True,
        )
    rec = recaptures(model, args, vocab)
    print(
        format_table(
            rows,
            [
                ("batch", "batch", "d"),
                ("who", "contender", "s"),
                ("ms", "ms/step", ".2f"),
                ("x_bound", "of bound", ".2f"),
                ("tok_s", "tokens/s", ".0f"),
                ("first_s", "first call s", ".1f"),
            ],
        )
    )
    summary: dict[str, Any] = {
        "capture_s": t_cap,
        "capture_batch": cap_batch,
        "buckets_captured": captures,
        "graph_pool_bytes": cap_pool,
        "recaptures_over_100_cycles": rec["recaptures"],
        "same_tokens_over_100_cycles": rec["same_tokens"],
    }
    b64 = res.get("64")
    if b64 and "ms_per_step" in b64.get("rlmem_graphs", {}):
        graph = b64["rlmem_graphs"]["ms_per_step"]
        summary["graph_vs_bound_b64"] = b64["bound_ms"] / graph
        if "ms_per_step" in b64.get("hf_static", {}):
            summary["speedup_vs_hf_generate_b64"] = b64["hf_static"]["ms_per_step"] / graph
        summary["graph_vs_eager_b64"] = b64["rlmem_eager"]["ms_per_step"] / graph
    run_.finish(
        summary,
        config={
            "preset": args.preset,
            "batches": ",".join(sorted(res, key=int)),
            "prompt_len": args.prompt_len,
            "inductor_cache": "as found" if args.warm_compile else "empty (capture_s compiles from nothing)",
            "new_tokens": args.new_tokens,
            "bandwidth_bytes_per_s": bw,
            "weight_bytes": weight_bytes,
            "kv_bytes_per_token": kv_token,
        },
        results=res,
        recapture=rec,
    )
    return 0
