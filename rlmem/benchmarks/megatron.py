"""Benchmark of rlmem on Megatron-Core trainers: the phase switch of a DDP + distributed-optimizer trainer,
activation offloading of a ``GPTModel`` against what Megatron offers without Transformer Engine, and
training bit-identical with and without rlmem. One process, one GPU (tensor, pipeline and data parallel
sizes 1), the local layer spec, bf16.

* ``switch`` (a ~1.3B ``GPTModel``, ``DistributedDataParallel(use_distributed_optimizer=True,
  grad_reduce_in_fp32=True)``, ``get_megatron_optimizer`` Adam with fp32 main parameters, two steps taken):
  ``PhaseManager(OffloadConfig(offload_during_rollout=True))`` with its defaults (gradients discarded,
  i.e. ``zero_grad_buffer()``). Bytes freed (``cudaMemGetInfo``) over everything the trainer holds
  (:func:`rlmem.integrations.megatron.state_bytes`: parameter and gradient buffers, main parameters,
  optimizer states); offload (entering rollout) and reload (entering train, until the state is back) in
  GB/s over the pinned copy rates measured in the same run. The first cycle (pinned backups still being
  made) is reported apart; the figures are the median of the steady cycles.
* ``activations`` (``GPTModel`` 16 layers, hidden 2048, bs x seq tokens): one forward + backward with the
  loss over every token. Rows: ``none``; Megatron's ``recompute_granularity="full"`` (uniform, 1 layer)
  and ``"selective"`` (core attention); ``torch.autograd.graph.save_on_cpu(pin_memory=True)``; rlmem
  without a hand-written map, per name, ``core_attn+attn_proj+mlp_norm``, every dense name, and
  ``budget="auto"``. Megatron's own fine-grained offloading needs Transformer Engine: a row only where
  it imports (the JSON says whether it did). Link floor of an offload: ``max(t_fwd, A / D2H) + max(t_bwd,
  A / H2D)`` with A the bytes it offloaded and the times of ``none``.
* ``bit_identical``: two trainers (as in ``switch``, smaller) from one seed, one with rlmem switching
  phases between steps: losses, parameters and main parameters compared bit for bit.
"""

from __future__ import annotations

import contextlib
import gc
import importlib.util
import os
import time
from typing import Any

import torch

from .. import OffloadConfig, PhaseManager, offload_activations
from .._units import GiB as _GiB
from ..activations.modmap import DENSE_NAMES
from ..integrations.megatron import main_params
from ._common import format_table, link_rates, median, warm_steps
from ._harness import Run

NAME = "megatron"
TARGETS = {
    "train_bit_identical": ("==", True),
    "act_grads_bit_equal": ("==", True),
    "freed_fraction": (">=", 0.99),
    "offload_vs_pinned": (">=", 0.9),
    "reload_vs_pinned": (">=", 0.9),
    "act_full_offload_vs_floor": ("<=", 1.2),
    "act_auto_overhead": ("<=", 0.05),
}
SHAPES = {
    "switch": {"layers": 24, "hidden": 2048, "heads": 16, "vocab": 50304},
    "bit_identical": {"layers": 4, "hidden": 1024, "heads": 8, "vocab": 32000},
    "activations": {"layers": 16, "hidden": 2048, "heads": 16, "vocab": 32000},
}


def _init(device: torch.device) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29561")
    torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl", rank=0, world_size=1)
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(1, 1)


def _gpt(shape: dict[str, int], seq: int, seed: int = 0, **cfg: Any) -> torch.nn.Module:
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig

    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    config = TransformerConfig(
        num_layers=shape["layers"],
        hidden_size=shape["hidden"],
        num_attention_heads=shape["heads"],
        bf16=True,
        params_dtype=torch.bfloat16,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        **cfg,
    )
    from megatron.core.transformer.module import Float16Module

    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=shape["vocab"],
        max_sequence_length=seq,
    )
    return Float16Module(config, model.cuda())  # bf16 as Megatron trainers run it


def _trainer(shape: dict[str, int], seq: int, seed: int = 0) -> tuple[Any, Any]:
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    model = _gpt(shape, seq, seed)
    ddp = DistributedDataParallel(
        model.config,
        DistributedDataParallelConfig(use_distributed_optimizer=True, grad_reduce_in_fp32=True),
        model,
    )
    opt = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-4, bf16=True, use_distributed_optimizer=True), [ddp]
    )
    return ddp, opt


def _batch(vocab: int, bs: int, seq: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    g = torch.Generator(device=device).manual_seed(1)
    tok = torch.randint(0, vocab, (bs, seq), device=device, generator=g)
    pos = torch.arange(seq, device=device).expand(bs, seq)
    return tok, pos


def _train_step(ddp: Any, opt: Any, batch: tuple[torch.Tensor, ...]) -> float:
    tok, pos = batch
    ddp.zero_grad_buffer()
    opt.zero_grad()
    loss = ddp(tok, pos, None, labels=tok).float().mean()
    loss.backward()
    ddp.finish_grad_sync()
    opt.step()
    return float(loss)


def _free(device: torch.device) -> int:
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info(device)[0]


def measure_switch(device: torch.device, cycles: int, seq: int, link: dict[str, float]) -> dict[str, Any]:
    from ..integrations.megatron import state_bytes

    shape = SHAPES["switch"]
    ddp, opt = _trainer(shape, seq)
    batch = _batch(shape["vocab"], 1, seq, device)
    for _ in range(2):
        _train_step(ddp, opt, batch)
    held = state_bytes(ddp, opt)
    pm = PhaseManager(ddp, opt, OffloadConfig(offload_during_rollout=True))
    rows = []
    for k in range(cycles + 1):
        with pm.train():
            _train_step(ddp, opt, batch)
        before = _free(device)
        t0 = time.perf_counter()
        with pm.rollout():
            t_off = time.perf_counter() - t0
            freed = _free(device) - before
            off_bytes = pm.stats().state.last.offload_bytes
        t0 = time.perf_counter()
        with pm.train():
            assert pm.state is not None
            pm.state.synchronize()
            torch.cuda.synchronize(device)
        t_re = time.perf_counter() - t0
        re_bytes = pm.stats().state.last.reload_bytes
        rows.append(
            {
                "cycle": k,
                "freed_bytes": freed,
                "offload_s": t_off,
                "offload_bytes": off_bytes,
                "offload_bytes_per_s": off_bytes / t_off,
                "reload_s": t_re,
                "reload_bytes": re_bytes,
                "reload_bytes_per_s": re_bytes / t_re,
            }
        )
        print(
            f"switch cycle {k}: freed {freed / _GiB:.2f} of {held.total / _GiB:.2f} GiB; offload "
            f"{off_bytes / _GiB:.2f} GiB in {t_off:.3f} s, reload {re_bytes / _GiB:.2f} GiB in {t_re:.3f} s",
            flush=True,
        )
    steady = rows[1:]
    out = {
        "shape": shape,
        "seq": seq,
        "held": held.as_dict(),
        "categories": {c: s.as_dict() for c, s in pm.stats().state.categories.items()},
        "cycles": rows,
        "freed_fraction": median([r["freed_bytes"] for r in steady]) / held.total,
        "offload_bytes_per_s": median([r["offload_bytes_per_s"] for r in steady]),
        "reload_bytes_per_s": median([r["reload_bytes_per_s"] for r in steady]),
    }
    out["offload_vs_pinned"] = out["offload_bytes_per_s"] / link["d2h_bytes_per_s"]
    out["reload_vs_pinned"] = out["reload_bytes_per_s"] / link["h2d_bytes_per_s"]
    assert pm.state is not None
    pm.state.close()
    del pm, ddp, opt
    gc.collect()
    torch.cuda.empty_cache()
    return out


def measure_bit_identical(device: torch.device, steps: int, seq: int) -> dict[str, Any]:
    shape = SHAPES["bit_identical"]
    batch = _batch(shape["vocab"], 2, seq, device)
    ref, ref_opt = _trainer(shape, seq)
    ref_losses = [_train_step(ref, ref_opt, batch) for _ in range(steps)]
    ddp, opt = _trainer(shape, seq)
    pm = PhaseManager(ddp, opt, OffloadConfig(offload_during_rollout=True))
    losses = []
    for k in range(steps):
        with pm.train():
            losses.append(_train_step(ddp, opt, batch))
        with pm.rollout():
            pass
        if k % 2:
            pm.prefetch()  # overlapped reload, waited for by the forward and the optimizer step
    with pm.train():
        pass

    def bits(ts: Any) -> list[torch.Tensor]:
        return [t.detach().reshape(-1).view(torch.uint8) for t in ts]

    def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
        return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))

    same_params = same(bits(ref.parameters()), bits(ddp.parameters()))
    same_main = same(bits(main_params(ref_opt)), bits(main_params(opt)))
    out = {
        "shape": shape,
        "steps": steps,
        "losses_ref": ref_losses,
        "losses_rlmem": losses,
        "same_losses": losses == ref_losses,
        "same_params": same_params,
        "same_main_params": same_main,
    }
    assert pm.state is not None
    pm.state.close()
    del pm, ddp, opt, ref, ref_opt
    gc.collect()
    torch.cuda.empty_cache()
    return out


_RECOMPUTE = {
    "megatron:recompute_full": {
        "recompute_granularity": "full",
        "recompute_method": "uniform",
        "recompute_num_layers": 1,
    },
    "megatron:recompute_selective": {"recompute_granularity": "selective"},
}


def _act_step(model: torch.nn.Module, batch: tuple[torch.Tensor, ...], ctx: Any) -> tuple[float, float]:
    tok, pos = batch
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with ctx:
        loss = model(tok, pos, None, labels=tok).float().mean()
        torch.cuda.synchronize()
        t_fwd = time.perf_counter() - t0
        loss.backward()
    torch.cuda.synchronize()
    return time.perf_counter() - t0, t_fwd


def _act_row(
    who: str, device: torch.device, bs: int, seq: int, steps: int, grads: list[torch.Tensor] | None
) -> tuple[dict[str, Any], list[torch.Tensor] | None]:
    shape = SHAPES["activations"]
    model = _gpt(shape, seq, **_RECOMPUTE.get(who, {}))
    batch = _batch(shape["vocab"], bs, seq, device)
    handle = None
    if who.startswith("rlmem:"):
        what = who.split(":", 1)[1]
        if what == "auto":
            handle = offload_activations(model, budget="auto")
        else:
            handle = offload_activations(model, list(DENSE_NAMES) if what == "all" else what.split("+"))
    times, fwds, peaks = [], [], []
    # budget="auto" measures a step, the step without offloading, then checks its plan until it settles.
    warm = 1
    try:
        for i in range(64):
            if i >= warm + steps:
                break
            warm = warm_steps(handle, i, warm)
            model.zero_grad(set_to_none=True)
            gc.collect()
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
            if who == "save_on_cpu":
                ctx: Any = torch.autograd.graph.save_on_cpu(pin_memory=True)
            else:
                ctx = handle if handle is not None else contextlib.nullcontext()
            dt, tf = _act_step(model, batch, ctx)
            if i >= warm:
                times.append(dt)
                fwds.append(tf)
                peaks.append(torch.cuda.max_memory_allocated(device) - base)
        row: dict[str, Any] = {"step_s": median(times), "forward_s": median(fwds), "peak_bytes": max(peaks)}
        if handle is not None:
            st = handle.stats()
            row["offloaded_bytes"] = st.offloaded_bytes
            row["by_name"] = dict(st.by_name)
            row["held_elsewhere_bytes"] = st.held_elsewhere_bytes
            row["copying_at_backward_bytes"] = st.copying_at_backward_bytes
            if getattr(handle, "plan", None) is not None:
                row["plan"] = handle.plan.selection()
                row["plan_report"] = str(handle.plan)
        out_grads = None
        if grads is None and who == "none":
            out_grads = [p.grad.detach().cpu() for p in model.parameters()]
        elif grads is not None and who == "rlmem:all":
            row["grads_bit_equal"] = all(
                torch.equal(a.view(torch.uint8), p.grad.detach().cpu().view(torch.uint8))
                for a, p in zip(grads, model.parameters(), strict=True)
            )
    except torch.OutOfMemoryError:
        row, out_grads = {"error": "out of memory"}, None
    finally:
        if handle is not None:
            handle.remove()
        del model
        gc.collect()
        torch.cuda.empty_cache()
        if who == "save_on_cpu":
            torch._C._host_emptyCache()
    return row, out_grads


def measure_activations(
    device: torch.device, bs: int, seq: int, steps: int, link: dict[str, float], only: list[str]
) -> dict:
    te = importlib.util.find_spec("transformer_engine") is not None
    who = ["none", *_RECOMPUTE, "save_on_cpu"]
    who += [f"rlmem:{n}" for n in DENSE_NAMES if n != "attn_proj"]
    who += ["rlmem:core_attn+attn_proj+mlp_norm", "rlmem:all", "rlmem:auto"]
    if only:
        who = ["none", *[w for w in who if w in only and w != "none"]]
    rows: dict[str, Any] = {}
    grads = None
    for w in who:
        r, g = _act_row(w, device, bs, seq, steps, grads)
        grads = g if g is not None else grads
        rows[w] = r
        msg = r.get("error") or f"{r['step_s'] * 1e3:.1f} ms, peak {r['peak_bytes'] / _GiB:.2f} GiB"
        if "held_elsewhere_bytes" in r:
            msg += (
                f", offloaded {r['offloaded_bytes'] / _GiB:.2f} GiB (held elsewhere "
                f"{r['held_elsewhere_bytes'] / _GiB:.2f}, copying at backward "
                f"{r['copying_at_backward_bytes'] / _GiB:.2f})"
            )
        print(f"activations {bs}x{seq} {w}: {msg}", flush=True)
        if "plan_report" in r:
            print(r["plan_report"], flush=True)
    none = rows["none"]
    t_fwd, t_bwd = none["forward_s"], none["step_s"] - none["forward_s"]
    for r in rows.values():
        if "offloaded_bytes" in r and "step_s" in r:
            a = r["offloaded_bytes"]
            floor = max(t_fwd, a / link["d2h_bytes_per_s"]) + max(t_bwd, a / link["h2d_bytes_per_s"])
            r["link_floor_s"] = floor
            r["vs_floor"] = r["step_s"] / floor
        if "step_s" in r:
            r["x_none"] = r["step_s"] / none["step_s"]
            r["peak_x"] = r["peak_bytes"] / none["peak_bytes"]
    return {
        "shape": SHAPES["activations"],
        "bs": bs,
        "seq": seq,
        "transformer_engine": te,
        "megatron_fine_grained_offloading": "needs Transformer Engine, which does not import here"
        if not te
        else "not measured",
        "rows": rows,
    }


def main(argv: list[str] | None = None) -> int:
    run_ = Run(NAME, __doc__.splitlines()[0], TARGETS)
    p = run_.parser
    p.add_argument("--parts", default="switch,bit_identical,activations")
    p.add_argument("--cycles", type=int, default=3, help="steady switch cycles (after the first)")
    p.add_argument("--switch-seq", type=int, default=1024)
    p.add_argument("--act-point", default="2x4096", help="bs x seq of the activation rows")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--only", default="", help="activation rows to run besides none (comma-separated)")
    args = run_.parse(argv)
    if not run_.needs_cuda():
        return 2
    if importlib.util.find_spec("megatron.core") is None:
        run_.error("megatron-core is not installed: pip install rlmem[megatron]")
    device = run_.device
    _init(device)
    d2h, h2d = link_rates(device)
    link = {"d2h_bytes_per_s": d2h, "h2d_bytes_per_s": h2d}
    print(f"link: D2H {d2h / 1e9:.1f} GB/s, H2D {h2d / 1e9:.1f} GB/s", flush=True)
    parts = [x for x in args.parts.split(",") if x]
    res: dict[str, Any] = run_.previous()
    if "switch" in parts:
        res["switch"] = measure_switch(device, args.cycles, args.switch_seq, link)
    if "bit_identical" in parts:
        res["bit_identical"] = measure_bit_identical(device, 4, 512)
    if "activations" in parts:
        bs, seq = (int(x) for x in args.act_point.split("x"))
        only = [x for x in args.only.split(",") if x]
        res["activations"] = measure_activations(device, bs, seq, args.steps, link, only)
    summary: dict[str, Any] = {}
    sw, bi, act = res.get("switch"), res.get("bit_identical"), res.get("activations")
    if sw:
        for k in ("freed_fraction", "offload_vs_pinned", "reload_vs_pinned"):
            summary[k] = sw[k]
        summary["offload_gbps"] = sw["offload_bytes_per_s"] / 1e9
        summary["reload_gbps"] = sw["reload_bytes_per_s"] / 1e9
    if bi:
        summary["train_bit_identical"] = bi["same_losses"] and bi["same_params"] and bi["same_main_params"]
    if act:
        rows = act["rows"]
        summary["act_grads_bit_equal"] = rows.get("rlmem:all", {}).get("grads_bit_equal", False)
        if "vs_floor" in rows.get("rlmem:all", {}):
            summary["act_full_offload_vs_floor"] = rows["rlmem:all"]["vs_floor"]
            summary["act_full_offload_peak_x"] = rows["rlmem:all"]["peak_x"]
        if "x_none" in rows.get("rlmem:auto", {}):
            summary["act_auto_overhead"] = rows["rlmem:auto"]["x_none"] - 1
            summary["act_auto_peak_x"] = rows["rlmem:auto"]["peak_x"]
        table = [
            {
                "who": w,
                "ms": r.get("step_s", 0) * 1e3 or None,
                "x_none": r.get("x_none"),
                "peak_gib": r.get("peak_bytes", 0) / _GiB or None,
                "peak_x": r.get("peak_x"),
                "off_gib": r.get("offloaded_bytes", 0) / _GiB or None,
                "vs_floor": r.get("vs_floor"),
            }
            for w, r in rows.items()
        ]
        print(
            format_table(
                table,
                [
                    ("who", "contender", "s"),
                    ("ms", "step ms", ".1f"),
                    ("x_none", "x none", ".2f"),
                    ("peak_gib", "peak GiB", ".2f"),
                    ("peak_x", "peak/none", ".2f"),
                    ("off_gib", "offloaded GiB", ".2f"),
                    ("vs_floor", "x floor", ".2f"),
                ],
            )
        )
    import megatron.core

    run_.finish(
        summary,
        config={"parts": parts, "megatron_core": getattr(megatron.core, "__version__", None), "link": link},
        results=res,
    )
    return 0
