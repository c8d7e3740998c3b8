"""Benchmark of rollout decoding: rlmem's ``HFSampler`` eager and with CUDA graphs against transformers'
``generate()`` (dynamic and static cache) and the memory-bandwidth bound of a decode step.

Greedy decoding, bf16, random models of ``--presets`` (default: the 2.47B Qwen2 shape with 16 query heads
over 2 KV heads, SmolLM2-135M's shape with 9 over 3, and the 2.7B shape with one KV head per query head),
``--prompt-len`` tokens of prompt and ``--new-tokens`` generated for every row (no EOS stops a row).
rlmem runs eager, with CUDA graphs (``rlmem_graphs_unfused``), and with CUDA graphs over fused norms, gates
and rotary embeddings (``rlmem_graphs``: ``HFSampler``'s default with graphs); on a grouped model also with
transformers' own grouped attention (``rlmem_graphs_gqa_off``: ``gqa="off"``).
Per preset, batch size and contender: milliseconds per decode step, ``(T(new) - T(1)) / (new - 1)`` from two
timed calls (so the prefill and the first token are not in it), the whole second call's tokens per second,
and the first call's time apart (capture or compilation). The bound of a step is the bytes it must read
once, the weights plus the mean KV cache over the decode, at the device bandwidth measured in the same run
(a large device-to-device copy).

A step of rlmem's attends over the cache-length bucket that holds its column (``HFSampler.kv_block``);
``generate()``'s static cache attends over the whole cache.

Variable lengths (``--varlen-prompts`` prompts x 8 samples, on the headline preset): completions end where a
rule forces EOS (from the 16th token on, at the ``k``-th with probability 1.5/k, decided by a hash of the
token and its position: lengths from 16 to ``--new-tokens``, long-tailed, the same rule in both runs),
sampled at temperature 1, more sequences than the ``--varlen-rows`` rows of the cache: kept full
(``refill``: a row whose sequence ended takes the next waiting one) against one batch at a time, at the
same KV budget. Tokens per second over the whole call. The sampled lengths differ between the two runs;
the same case decoded greedily (``varlen.greedy``) gives both runs the same tokens, the same work.

Summary: ``gqa_graph_vs_bound_b64`` (bound over the graph step at batch 64 of ``qwen2-2.5b``),
``gqa_speedup_vs_hf_static_b64`` (``generate()`` with its static cache over rlmem's graphs, whole second
call), ``varlen_speedup_vs_static``; for the MHA preset ``graph_vs_bound_b64`` and
``speedup_vs_hf_generate_b64`` (marginal steps, as before); ``capture_s`` (``HFSampler.capture()``: every
batch-size bucket over every cache-length bucket of the rollout's length, the fused kernels compiled from
an empty Inductor cache unless ``--warm-compile``), and ``recaptures_over_100_cycles`` (captures during 100
sleep/wake cycles with a short rollout in each).
"""

from __future__ import annotations

import gc
import os
import tempfile
import time
from typing import Any

import torch

from ..models.presets import PRESETS, build, vocab_size
from ..rollout.sampler import HFSampler, kv_bytes_per_token
from ..rollout.sampler._gqa import grouped
from ._common import format_table
from ._harness import Run

NAME = "rollout"
TARGETS = {
    "gqa_graph_vs_bound_b64": (">=", 0.6),
    "gqa_speedup_vs_hf_static_b64": (">=", 2.0),
    "varlen_speedup_vs_static": (">=", 1.5),
    "graph_vs_bound_b64": (">=", 0.5),
    "speedup_vs_hf_generate_b64": (">=", 3.0),
    "capture_s": ("<", 10.0),
    "recaptures_over_100_cycles": ("<=", 0),
}
MHA = "qwen2-2.7b-mha"
GQA = "qwen2-2.5b"  # the headline: the summary's gqa_* keys


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


def _sampler(model: Any, rows: int, max_len: int, graphs: str, vocab: int, **kw: Any) -> HFSampler:
    # eos -1: no row ever stops early, every call decodes the same number of steps
    return HFSampler(
        model,
        max_len=max_len,
        batch_size=rows,
        pad_token_id=vocab - 1,
        eos_token_id=-1,
        cuda_graphs=graphs,
        **kw,
    )


def measure(model: Any, rows: int, args: Any, vocab: int, device: torch.device) -> dict[str, Any]:
    g = torch.Generator().manual_seed(rows)
    prompts = torch.randint(0, vocab - 1, (rows, args.prompt_len), generator=g)
    max_len = args.prompt_len + args.new_tokens
    out: dict[str, Any] = {}
    contenders = [
        ("rlmem_eager", "off", {"fused": "off"}),
        ("rlmem_graphs_unfused", "on", {"fused": "off"}),
        ("rlmem_graphs", "on", {"fused": "on"}),
    ]
    if grouped(model):  # where gqa='off' differs from the default
        contenders.append(("rlmem_graphs_gqa_off", "on", {"fused": "on", "gqa": "off"}))
    for who, graphs, kw in contenders:
        s = _sampler(model, rows, max_len, graphs, vocab, **kw)
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


def _eos_rule(model: Any, prompt_len: int, eos: int, c: float = 1.5, first: int = 16) -> Any:
    """A forward hook forcing EOS as the next token where the long-tailed rule says (see the module
    docstring): the ``k``-th completion token (``k >= first``) is EOS when a hash of the token before it
    and its position, in [0, 1), is below ``c / k``. Tensor operations only: captured into graphs too."""

    def hook(module: Any, args: Any, kwargs: dict[str, Any], out: Any) -> Any:
        if kwargs.get("position_ids") is None:  # the sampler's probe at construction
            return out
        ids, pos = kwargs["input_ids"][:, -1], kwargs["position_ids"][:, -1]
        k = (pos + 2 - prompt_len).clamp(min=1)  # the index (1-based) of the token these logits choose
        u = ((ids * 2654435761 + pos * 40503) % 4294967296).double() / 4294967296.0
        force = (k >= first) & (u < c / k.double())
        logits = out.logits[:, -1]
        logits[:, eos] = torch.where(force, torch.full_like(logits[:, eos], 1e4), logits[:, eos])
        return out

    return model.register_forward_hook(hook, with_kwargs=True)


def varlen(model: Any, args: Any, vocab: int, device: torch.device) -> dict[str, Any]:
    """Kept-full batches against one batch at a time, same rows (KV budget), the EOS rule above: sampled
    (the summary's figure), and greedy (``greedy``: the same tokens, so the same work, in both runs)."""
    eos = vocab - 2
    n = args.varlen_prompts
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(0, vocab - 2, (n, args.prompt_len), generator=g).tolist()
    group = [p for p in prompts for _ in range(8)]
    handle = _eos_rule(model, args.prompt_len, eos)
    out: dict[str, Any] = {"sequences": len(group), "rows": args.varlen_rows}
    try:
        for mode, temperature in (("sampled", 1.0), ("greedy", 0.0)):
            got_by: dict[str, list[list[int]]] = {}
            part: dict[str, Any] = {}
            for who, refill in (("static", False), ("kept_full", True)):
                s = HFSampler(
                    model,
                    max_len=args.prompt_len + args.new_tokens,
                    batch_size=args.varlen_rows,
                    pad_token_id=vocab - 1,
                    eos_token_id=eos,
                    refill=refill,
                )

                def call(s: HFSampler = s, t: float = temperature) -> list[list[int]]:
                    return s.generate(group, max_new_tokens=args.new_tokens, temperature=t, seed=5)

                first = _timed(call, device)
                t0 = time.perf_counter()
                got = got_by[who] = call()
                torch.cuda.synchronize(device)
                secs = time.perf_counter() - t0
                lengths = sorted(len(x) for x in got)
                part[who] = {
                    "first_call_s": first,
                    "call_s": secs,
                    "tokens": sum(lengths),
                    "tokens_per_s": sum(lengths) / secs,
                    "length_p10_p50_p90_max": [lengths[len(lengths) * q // 10] for q in (1, 5, 9)]
                    + [lengths[-1]],
                    "mean_length": sum(lengths) / len(lengths),
                    "captures": s.captures,
                }
                s.region.close()
                del s
                gc.collect()
                torch.cuda.empty_cache()
            part["speedup"] = part["kept_full"]["tokens_per_s"] / part["static"]["tokens_per_s"]
            if mode == "greedy":
                part["same_tokens"] = got_by["static"] == got_by["kept_full"]
                out["greedy"] = part
            else:
                out.update(part)
    finally:
        handle.remove()
    return out


def main(argv: list[str] | None = None) -> int:
    run_ = Run(NAME, __doc__.splitlines()[0], TARGETS)
    p = run_.parser
    p.add_argument(
        "--presets",
        default=f"{GQA},smollm2-135m,{MHA}",
        help=f"{GQA} (else the first, unless --merge keeps them) also gets the capture, re-capture and "
        "variable-length measurements",
    )
    p.add_argument("--batches", default="1,16,64,256")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=512)
    p.add_argument("--varlen-prompts", type=int, default=64, help="prompts (x 8 samples) of the varlen case")
    p.add_argument("--varlen-rows", type=int, default=64, help="rows of the cache in the varlen case")
    p.add_argument("--no-varlen", action="store_true", help="skip the variable-length case")
    p.add_argument("--merge", action="store_true", help="keep presets of an existing JSON not run now")
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
    presets = [x for x in args.presets.split(",") if x]
    batches = [int(x) for x in args.batches.split(",") if x.strip()]
    if not presets or any(x not in PRESETS or x == "mlp-tiny" for x in presets):
        run_.error(f"--presets must name transformers presets of {', '.join(PRESETS)}")
    if not batches:
        run_.error("--batches is empty")
    if args.capture_batch is not None and args.capture_batch < 1:
        run_.error(f"--capture-batch must be >= 1, got {args.capture_batch}")
    if not run_.needs_cuda():
        return 2
    device = run_.device
    bw = _bandwidth(device)
    prev = run_.previous() if args.merge else {}
    res: dict[str, Any] = dict(prev.get("presets", {})) if isinstance(prev.get("presets"), dict) else {}
    extra = {k: v for k, v in prev.items() if k in ("varlen", "capture", "recapture")}
    rows = []
    max_len = args.prompt_len + args.new_tokens
    # Capture, re-capture and the variable-length case run on the headline preset, else on the first one
    # unless a merged file has them already (a call that adds rows keeps the headline's).
    extras_on = GQA if GQA in presets else presets[0]
    if GQA not in presets and "capture" in extra:
        extras_on = None
    for preset in presets:
        model = build(preset, device, torch.bfloat16).eval()
        vocab = vocab_size(preset)
        weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        kv_token = kv_bytes_per_token(model.config, torch.bfloat16)
        print(f"{preset}: bandwidth {bw / 1e12:.2f} TB/s; weights {weight_bytes / 2**30:.2f} GiB", flush=True)
        per: dict[str, Any] = {"weight_bytes": weight_bytes, "kv_bytes_per_token": kv_token, "batches": {}}
        if preset == extras_on:  # capture time and re-captures: that preset's sampler of the largest batch
            cap_batch = args.capture_batch or max(batches)
            cap = _sampler(model, cap_batch, max_len, "on", vocab)
            t_cap = cap.capture()
            extra["capture"] = {
                "preset": preset,
                "capture_s": t_cap,
                "capture_batch": cap_batch,
                "buckets_captured": cap.captures,
                "graph_pool_bytes": cap.graph_pool_bytes,
            }
            cap.region.close()
            del cap
            gc.collect()
            torch.cuda.empty_cache()
            extra["recapture"] = {"preset": preset, **recaptures(model, args, vocab)}
            if not args.no_varlen:
                extra["varlen"] = {"preset": preset, **varlen(model, args, vocab, device)}
                v = extra["varlen"]
                print(
                    f"varlen: kept full {v['kept_full']['tokens_per_s']:,.0f} vs static "
                    f"{v['static']['tokens_per_s']:,.0f} tokens/s ({v['speedup']:.2f}x)",
                    flush=True,
                )
        for b in batches:
            r = measure(model, b, args, vocab, device)
            mean_ctx = args.prompt_len + args.new_tokens / 2
            bound_s = (weight_bytes + b * mean_ctx * kv_token) / bw
            r["bound_ms"] = bound_s * 1e3
            per["batches"][str(b)] = r
            for who, v in r.items():
                if isinstance(v, dict) and "ms_per_step" in v:
                    v["call_tokens_per_s"] = b * args.new_tokens / v["call_s"]
                    rows.append(
                        {
                            "preset": preset,
                            "batch": b,
                            "who": who,
                            "ms": v["ms_per_step"],
                            "x_bound": bound_s * 1e3 / v["ms_per_step"],
                            "tok_s": b / v["ms_per_step"] * 1e3,
                            "call_tok_s": v["call_tokens_per_s"],
                            "first_s": v["first_call_s"],
                        }
                    )
        res[preset] = per
        del model
        gc.collect()
        torch.cuda.empty_cache()
    print(
        format_table(
            rows,
            [
                ("preset", "preset", "s"),
                ("batch", "batch", "d"),
                ("who", "contender", "s"),
                ("ms", "ms/step", ".2f"),
                ("x_bound", "of bound", ".2f"),
                ("tok_s", "step tokens/s", ".0f"),
                ("call_tok_s", "call tokens/s", ".0f"),
                ("first_s", "first call s", ".1f"),
            ],
        )
    )
    run_.finish(
        summarize(res, extra),
        config={
            "presets": ",".join(res),
            "headline": GQA,
            "batches": args.batches,
            "prompt_len": args.prompt_len,
            "new_tokens": args.new_tokens,
            "varlen_prompts": args.varlen_prompts,
            "varlen_rows": args.varlen_rows,
            "inductor_cache": "as found" if args.warm_compile else "empty (capture_s compiles from nothing)",
            "bandwidth_bytes_per_s": bw,
        },
        results={"presets": res, **extra},
    )
    return 0


def summarize(res: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    s: dict[str, Any] = {}
    cap, rec, var = extra.get("capture"), extra.get("recapture"), extra.get("varlen")
    if cap:
        s["capture_s"] = cap["capture_s"]
    if rec:
        s["recaptures_over_100_cycles"] = rec["recaptures"]
        s["same_tokens_over_100_cycles"] = rec["same_tokens"]
    if var:
        s["varlen_speedup_vs_static"] = var["speedup"]
        if "greedy" in var:
            s["varlen_greedy_speedup_vs_static"] = var["greedy"]["speedup"]
            s["varlen_greedy_same_tokens"] = var["greedy"]["same_tokens"]
    g = res.get(GQA, {}).get("batches", {}).get("64", {})
    if "ms_per_step" in g.get("rlmem_graphs", {}):
        graph = g["rlmem_graphs"]
        s["gqa_graph_vs_bound_b64"] = g["bound_ms"] / graph["ms_per_step"]
        if "call_s" in g.get("hf_static", {}):
            s["gqa_speedup_vs_hf_static_b64"] = g["hf_static"]["call_s"] / graph["call_s"]
        if "ms_per_step" in g.get("rlmem_graphs_gqa_off", {}):
            s["gqa_step_speedup_vs_transformers_attention_b64"] = (
                g["rlmem_graphs_gqa_off"]["ms_per_step"] / graph["ms_per_step"]
            )
    m = res.get(MHA, {}).get("batches", {}).get("64", {})
    if "ms_per_step" in m.get("rlmem_graphs", {}):
        graph_ms = m["rlmem_graphs"]["ms_per_step"]
        s["graph_vs_bound_b64"] = m["bound_ms"] / graph_ms
        if "ms_per_step" in m.get("hf_static", {}):
            s["speedup_vs_hf_generate_b64"] = m["hf_static"]["ms_per_step"] / graph_ms
        s["graph_vs_eager_b64"] = m["rlmem_eager"]["ms_per_step"] / graph_ms
    return s
