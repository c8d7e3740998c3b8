"""Megatron-Core on two ranks under ``rlmem.TrainState``: tensor parallel (``tp2``, and ``tp2-sp`` with
sequence parallelism), two pipeline stages (``pp2``) and data parallel (``dp2``), each a part under
torchrun with a rank per device.

Each rank builds a ``GPTModel`` (local layer spec) in Megatron's ``DistributedDataParallel`` twice from one
seed: a reference trainer that never offloads, and one whose state (DDP parameter and gradient buffers,
main parameters, optimizer states) leaves the device after every step and comes back
(``params="offload", grads="discard", optimizer="offload"``). On a GPU: bf16 (``Float16Module``) with
Megatron's distributed optimizer; the stages of ``pp2`` exchange activations and their gradients with
``send`` / ``recv``. On the CPU (Gloo, the host backend; what CI runs, tiny): fp32, with a stand-in of the
mixed-precision optimizer's structure (fp32 main-parameter clones under AdamW, as Megatron's optimizers
hard-code CUDA), Megatron's device and CUDA RNG fork redirected to the host, and no sequence parallelism
(Gloo has no reduce-scatter).

Per rank and step: the bytes the offload freed (``cudaMemGetInfo``; on the CPU what stays resident) over
what the state holds, the offload's and the reload's rate over the pinned copy rates measured on that rank
in the same run, reads of the weights and main parameters while away, and, for ``tp2`` and ``tp2-sp``, one
step's gradients with every Megatron activation name offloaded against without. Summary:
``tp2_bit_identical``, ``pp2_bit_identical``, ``dp2_distopt_bit_identical`` (losses, weights and main
parameters equal the reference's bit for bit on every rank; ``dp2_bit_identical`` on the CPU, without the
distributed optimizer), ``tp2_sp_bit_identical``, ``freed_fraction_min``, ``offload_vs_pinned_min``,
``reload_vs_pinned_min`` (every rank, every step after the first), ``act_grads_bit_equal`` (over
``act_grads_layouts``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from typing import Any

import torch

from ..integrations.megatron import main_params
from ._common import format_table, link_rates, spawn_part
from ._harness import Run

NAME = "megatron_parallel"
LAYOUTS = {"tp2": (2, 1, False), "tp2-sp": (2, 1, True), "pp2": (1, 2, False), "dp2": (1, 1, False)}
TARGETS = {
    "tp2_bit_identical": ("==", True),
    "pp2_bit_identical": ("==", True),
    "dp2_distopt_bit_identical": ("==", True),
    "tp2_sp_bit_identical": ("==", True),
    "freed_fraction_min": (">=", 0.99),
    "offload_vs_pinned_min": (">=", 0.9),
    "reload_vs_pinned_min": (">=", 0.9),
    "act_grads_bit_equal": ("==", True),
}
GPU_SHAPE = {"layers": 8, "hidden": 2048, "heads": 16, "vocab": 32000, "seq": 512, "batch": 2}
CPU_SHAPE = {"layers": 2, "hidden": 64, "heads": 4, "vocab": 128, "seq": 16, "batch": 2}


class _MixedPrecision:
    """Megatron's mixed-precision optimizer's structure (fp32 main parameters under AdamW), for the CPU."""

    def __init__(self, ddp: Any) -> None:
        self.model_params = list(ddp.parameters())
        self.main = [q.detach().clone().float() for q in self.model_params]
        self.optimizer = torch.optim.AdamW(self.main, lr=1e-2)

    def zero_grad(self) -> None:
        pass

    def step(self) -> None:
        for q, m in zip(self.model_params, self.main, strict=True):
            m.grad = q.main_grad.float().clone()
        self.optimizer.step()
        with torch.no_grad():
            for q, m in zip(self.model_params, self.main, strict=True):
                q.copy_(m)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.uint8).cpu()


def _layer_spec(cfg: Any) -> Any:
    """Megatron's local layer spec; under sequence parallel with torch's norms (Megatron's own refuses it
    without Transformer Engine or Apex), whose weights are marked so that ``finalize_model_grads`` sums their
    gradients over the tensor-parallel ranks (each saw its part of the sequence)."""
    import dataclasses

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    spec = get_gpt_layer_local_spec()
    if not cfg.sequence_parallel:
        return spec
    assert cfg.pipeline_model_parallel_size == 1  # the block's layers below are all of the model's
    norms = dict(input_layernorm=_SequenceParallelNorm, pre_mlp_layernorm=_SequenceParallelNorm)
    layer = dataclasses.replace(spec, submodules=dataclasses.replace(spec.submodules, **norms))
    return TransformerBlockSubmodules(layer_specs=[layer] * cfg.num_layers, layer_norm=_SequenceParallelNorm)


class _SequenceParallelNorm(torch.nn.LayerNorm):
    """``torch.nn.LayerNorm`` as a Megatron norm module, its weights marked ``sequence_parallel``."""

    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-5, **_: Any) -> None:
        assert config.normalization == "LayerNorm"
        super().__init__(hidden_size, eps=eps)
        for w in self.parameters():
            w.sequence_parallel = config.sequence_parallel


class _Trainer:
    """One rank's model and data for ``layout``: :meth:`build` makes a trainer, :meth:`step` steps it."""

    def __init__(self, layout: str, shape: dict[str, int], device: torch.device) -> None:
        import torch.distributed as dist
        from megatron.core import parallel_state as ps
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

        self.tp, self.pp, self.sp = LAYOUTS[layout]
        self.layout, self.shape, self.device = layout, shape, device
        self.cuda = device.type == "cuda"
        ps.initialize_model_parallel(self.tp, self.pp)
        if not self.cuda:
            get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
        self.first, self.last = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        b, s = shape["batch"], shape["seq"]
        g = torch.Generator().manual_seed(1 + (self.rank if layout == "dp2" else 0))  # dp: its own data
        self.tok = torch.randint(0, shape["vocab"], (b, s), generator=g).to(device)
        self.pos = torch.arange(s, device=device).expand(b, s)
        self.mask = torch.triu(torch.ones(1, 1, s, s, dtype=torch.bool, device=device), 1)
        self.dtype = torch.bfloat16 if self.cuda else torch.float32

    def build(self, seed: int) -> tuple[Any, Any]:
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.models.gpt import GPTModel
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
        from megatron.core.transformer import TransformerConfig

        sh = self.shape
        torch.manual_seed(seed)
        if self.cuda:
            model_parallel_cuda_manual_seed(seed)
        precision = dict(bf16=True, params_dtype=torch.bfloat16) if self.cuda else {}
        cfg = TransformerConfig(
            num_layers=sh["layers"],
            hidden_size=sh["hidden"],
            num_attention_heads=sh["heads"],
            use_cpu_initialization=True,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            tensor_model_parallel_size=self.tp,
            pipeline_model_parallel_size=self.pp,
            pipeline_dtype=self.dtype,
            sequence_parallel=self.sp,
            **precision,
        )
        model = GPTModel(
            config=cfg,
            transformer_layer_spec=_layer_spec(cfg),
            vocab_size=sh["vocab"],
            max_sequence_length=sh["seq"],
            pre_process=self.first,
            post_process=self.last,
        ).to(self.device)
        if self.cuda:
            from megatron.core.transformer.module import Float16Module

            model = Float16Module(cfg, model)
        ddp_cfg = DistributedDataParallelConfig(use_distributed_optimizer=self.cuda, grad_reduce_in_fp32=True)
        ddp = DistributedDataParallel(cfg, ddp_cfg, model)
        if not self.cuda:
            return ddp, _MixedPrecision(ddp)
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        ocfg = OptimizerConfig(optimizer="adam", lr=1e-3, bf16=True, use_distributed_optimizer=True)
        return ddp, get_megatron_optimizer(ocfg, [ddp])

    def step(self, ddp: Any, opt: Any) -> float:
        """One step as a Megatron trainer takes it (in ``pp2`` the first stage sends its output to the last,
        which sends back its gradient); the loss, the same on every rank."""
        import torch.distributed as dist
        from megatron.core.distributed import finalize_model_grads

        ddp.zero_grad_buffer()
        opt.zero_grad()
        peer = 1 - self.rank
        if self.pp == 1:
            loss = ddp(self.tok, self.pos, self.mask, labels=self.tok).float().mean()
            loss.backward()
        elif self.first:
            out = ddp(self.tok, self.pos, self.mask)
            dist.send(out.detach().contiguous(), peer)
            grad = torch.empty_like(out)
            dist.recv(grad, peer)
            out.backward(grad)
            loss = torch.zeros((), device=self.device)
        else:
            sh = self.shape
            inp = torch.empty(sh["seq"], sh["batch"], sh["hidden"], device=self.device, dtype=self.dtype)
            dist.recv(inp, peer)
            inp.requires_grad_(True)
            ddp.module.set_input_tensor(inp)
            loss = ddp(None, self.pos, self.mask, labels=self.tok).float().mean()
            loss.backward()
            dist.send(inp.grad.contiguous(), peer)
        # the data-parallel reduction, and with sequence parallel the sum of the norms' gradients over TP
        finalize_model_grads([ddp])
        opt.step()
        loss = loss.detach().reshape(1).to(self.device)
        if self.pp > 1:
            dist.broadcast(loss, self.pp - 1)  # the last stage's
        elif self.layout == "dp2":
            dist.all_reduce(loss)  # each rank its own data: the mean
            loss /= self.world
        return float(loss)

    def activations(self) -> tuple[bool, int]:
        """One step's gradients with every Megatron activation name offloaded equal those without; the
        bytes offloaded."""
        from .. import offload_activations
        from ..activations.modmap import DENSE_NAMES

        grads, moved = [], 0
        for offload in (False, True):
            ddp, _ = self.build(0)
            ddp.zero_grad_buffer()
            inner = ddp.module.module if self.cuda else ddp.module
            h = offload_activations(inner, list(DENSE_NAMES), min_bytes=0) if offload else None
            with h or contextlib.nullcontext():
                ddp(self.tok, self.pos, self.mask, labels=self.tok).float().mean().backward()
            grads.append([_bits(q.main_grad) for q in ddp.parameters()])
            if h is not None:
                moved = h.stats().as_dict()["offloaded_bytes"]
                h.remove()
            del ddp
        return all(torch.equal(a, b) for a, b in zip(*grads, strict=True)), moved


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_part(layout: str, shape: dict[str, int], steps: int, device: torch.device) -> dict[str, Any] | None:
    """One layout on this rank (under torchrun); every rank's figures on the lead, None elsewhere."""
    import torch.distributed as dist

    from .. import TrainState

    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    else:
        # Megatron's DDP makes its buffers on torch.cuda.current_device(): here, the host (this part is a
        # process of its own).
        torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    tr = _Trainer(layout, shape, device)
    link = link_rates(device, 256 << 20) if device.type == "cuda" else None
    act = tr.activations() if layout in ("tp2", "tp2-sp") else None  # tensor parallel, with SP and without
    ref, ref_opt = tr.build(0)
    ref_losses = [tr.step(ref, ref_opt) for _ in range(steps)]
    ddp, opt = tr.build(0)
    st = TrainState(ddp, opt)
    losses, cycles = [], []
    for _ in range(steps):
        losses.append(tr.step(ddp, opt))
        # what the state holds now (the optimizer's states exist from its first step on)
        held = sum(c.bytes for c in st.stats().categories.values())
        params = [q.detach().clone() for q in ddp.parameters()]
        main = [m.detach().clone() for m in main_params(opt)]
        _sync(device)
        free0 = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else 0
        t0 = time.perf_counter()
        st.offload(params="offload", grads="discard", optimizer="offload", blocking=True)
        _sync(device)
        t_off = time.perf_counter() - t0
        cats = st.stats().categories
        moved = sum(cats[c].bytes for c in ("params", "optimizer") if c in cats)
        if device.type == "cuda":
            freed = (torch.cuda.mem_get_info(device)[0] - free0) / held
        else:
            freed = 1 - sum(c.resident_bytes for c in cats.values()) / held
        cyc = {
            "freed_fraction": freed,
            "moved_bytes": moved,
            "offload_s": t_off,
            "params_read": all(torch.equal(a, b) for a, b in zip(ddp.parameters(), params, strict=True)),
            "main_read": all(torch.equal(a, b) for a, b in zip(main_params(opt), main, strict=True)),
        }
        t0 = time.perf_counter()
        st.reload(blocking=True)
        st.synchronize()
        _sync(device)
        cyc["reload_s"] = time.perf_counter() - t0
        if link is not None:
            cyc["offload_vs_pinned"] = moved / t_off / link[0]
            cyc["reload_vs_pinned"] = moved / cyc["reload_s"] / link[1]
        cycles.append(cyc)
    pairs = zip(ref.parameters(), ddp.parameters(), strict=True)
    main_pairs = zip(main_params(ref_opt), main_params(opt), strict=True)
    mine = {
        "rank": tr.rank,
        "stage": "whole" if tr.pp == 1 else "first" if tr.first else "last",
        "n_params": sum(q.numel() for q in ddp.parameters()),
        "held_bytes": held,
        "ref": ref_losses,
        "losses": losses,
        "same_params": all(torch.equal(_bits(a), _bits(b)) for a, b in pairs),
        "same_main": all(torch.equal(_bits(a), _bits(b)) for a, b in main_pairs),
        "cycles": cycles,
        "link_bytes_per_s": link,
        "act_grads_equal": None if act is None else act[0],
        "act_offloaded_bytes": None if act is None else act[1],
    }
    st.close()
    every: list[Any] = [None] * tr.world
    dist.all_gather_object(every, mine)
    dist.barrier()
    dist.destroy_process_group()
    return {"layout": layout, "distopt": tr.cuda, "ranks": every} if tr.rank == 0 else None


def summarize(res: dict[str, Any]) -> dict[str, Any]:
    s: dict[str, Any] = {}
    keys = {"tp2": "tp2_bit_identical", "tp2-sp": "tp2_sp_bit_identical", "pp2": "pp2_bit_identical"}
    # Megatron's distributed optimizer on a GPU; on the CPU the stand-in (not distributed)
    keys["dp2"] = "dp2_distopt_bit_identical" if res.get("dp2", {}).get("distopt") else "dp2_bit_identical"
    steady: list[dict[str, Any]] = []
    for layout, r in res.items():
        ranks = r.get("ranks")
        if not ranks:
            continue
        ok = all(x["losses"] == x["ref"] and x["same_params"] and x["same_main"] for x in ranks)
        ok = ok and all(c["params_read"] and c["main_read"] for x in ranks for c in x["cycles"])
        s[keys[layout]] = ok
        steady += [c for x in ranks for c in x["cycles"][1:]]  # the first cycle makes the pinned backups
        act = [x["act_grads_equal"] for x in ranks if x["act_grads_equal"] is not None]
        if act:  # over every layout that measured it
            ok = all(act) and all(x["act_offloaded_bytes"] > 0 for x in ranks)
            s["act_grads_bit_equal"] = s.get("act_grads_bit_equal", True) and ok
            s.setdefault("act_grads_layouts", []).append(layout)
    if steady:
        s["freed_fraction_min"] = min(c["freed_fraction"] for c in steady)
        for k in ("offload_vs_pinned", "reload_vs_pinned"):
            if all(k in c for c in steady):
                s[f"{k}_min"] = min(c[k] for c in steady)
    return s


def main(argv: list[str] | None = None) -> int:
    run_ = Run(NAME, __doc__.splitlines()[0], TARGETS)
    p = run_.parser
    p.add_argument("--layouts", default=None, help=f"of {', '.join(LAYOUTS)} (default: all; CPU: no tp2-sp)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--shape", default=None, help="layers,hidden,heads,vocab,seq,batch (default by device)")
    p.add_argument("--part", default=None, choices=tuple(LAYOUTS), help=argparse.SUPPRESS)
    p.add_argument("--timeout", type=float, default=900.0, help="a layout's longest run (s)")
    args = run_.parse(argv)
    cuda = run_.device.type == "cuda"
    shape = dict(GPU_SHAPE if cuda else CPU_SHAPE)
    if args.shape:
        vals = [int(v) for v in args.shape.split(",")]
        if len(vals) != len(shape):
            run_.error(f"--shape takes {len(shape)} ints: {','.join(shape)}")
        shape = dict(zip(shape, vals, strict=True))
    if args.part:
        out = run_part(args.part, shape, args.steps, run_.device)
        if out is not None:
            print(json.dumps(out), flush=True)
        return 0
    if cuda and not run_.needs_cuda(2):
        return 2
    default = [x for x in LAYOUTS if cuda or x != "tp2-sp"]
    layouts = [x for x in (args.layouts or ",".join(default)).split(",") if x]
    bad = [x for x in layouts if x not in LAYOUTS or (x == "tp2-sp" and not cuda)]
    if bad:
        run_.error(f"--layouts: {bad[0]!r} is not one of {', '.join(default)}")
    forward = ["--device", run_.device.type, "--steps", str(args.steps)]
    forward += ["--shape", ",".join(str(v) for v in shape.values())]
    res = {}
    for layout in layouts:
        res[layout] = spawn_part(
            "rlmem.benchmarks.megatron_parallel", layout, forward, nproc=2, timeout_s=args.timeout
        )
    rows = []
    for layout, r in res.items():
        for x in r.get("ranks", []):
            cyc = x["cycles"][1:] or x["cycles"]
            rows.append(
                {
                    "layout": layout,
                    "rank": x["rank"],
                    "stage": x["stage"],
                    "state": x["held_bytes"] / 2**20,
                    "same": x["losses"] == x["ref"] and x["same_params"] and x["same_main"],
                    "freed": min(c["freed_fraction"] for c in cyc),
                    "off": min((c.get("offload_vs_pinned") for c in cyc), default=None, key=_num),
                    "rel": min((c.get("reload_vs_pinned") for c in cyc), default=None, key=_num),
                }
            )
    cols = [("layout", "layout", "s"), ("rank", "rank", "d"), ("stage", "stage", "s")]
    cols += [("state", "state MiB", ".1f"), ("same", "bit-identical", "")]
    cols += [("freed", "freed", ".3f"), ("off", "offload/pinned", ".2f"), ("rel", "reload/pinned", ".2f")]
    print(format_table(rows, cols))
    failed = {k: v["error"] for k, v in res.items() if "error" in v}
    for k, v in failed.items():
        print(f"{k} failed:\n{v}", file=sys.stderr)
    run_.finish(summarize(res), config={"shape": shape, "steps": args.steps, "layouts": layouts}, results=res)
    return 1 if failed else 0


def _num(v: float | None) -> float:
    return float("inf") if v is None else v


if __name__ == "__main__":
    raise SystemExit(main())
