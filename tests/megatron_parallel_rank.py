"""One rank of a two-rank Megatron-Core trainer under rlmem.TrainState (run by tests/test_megatron_parallel.py
through torchrun): ``tp2`` (tensor parallel), ``pp2`` (two pipeline stages, the activations and their
gradients sent between the ranks) or ``dp2`` (data parallel, gradients all-reduced by Megatron's DDP), each
with a reference trainer built from the same seed. Every step, the trainer's state leaves the device (here the
host backend) and comes back; what it read while away and its losses and weights against the reference are
written as JSON by each rank to OUT/rank{r}.json.

On the CPU (Gloo), what Megatron assumes a GPU for is redirected: the device its DDP makes buffers on and
the CUDA RNG tracker's fork (dropout is 0). Megatron's optimizers and pipeline schedules hard-code CUDA, so
the optimizer is a stand-in with the same structure (fp32 main-parameter clones under AdamW) and the two
stages exchange their tensors with ``send`` / ``recv``; ``--device cuda`` runs Megatron's own.
"""

from __future__ import annotations

import argparse
import contextlib
import json
from pathlib import Path

import torch
import torch.distributed as dist

p = argparse.ArgumentParser()
p.add_argument("layout", choices=("tp2", "pp2", "dp2"))
p.add_argument("out")
p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
p.add_argument("--steps", type=int, default=3)
p.add_argument("--sp", action="store_true", help="sequence parallelism (tp2; needs reduce-scatter: CUDA)")
args = p.parse_args()
DEV = args.device
if DEV == "cpu":
    torch.cuda.current_device = lambda: "cpu"  # where Megatron's DDP makes its buffers
dist.init_process_group("gloo" if DEV == "cpu" else "nccl")
rank = dist.get_rank()
if DEV == "cuda":
    torch.cuda.set_device(rank)
TP, PP = {"tp2": (2, 1), "pp2": (1, 2), "dp2": (1, 1)}[args.layout]
SP = args.sp and TP > 1

from megatron.core import parallel_state as ps  # noqa: E402

ps.initialize_model_parallel(TP, PP)
from megatron.core.distributed import DistributedDataParallel as DDP  # noqa: E402
from megatron.core.distributed import DistributedDataParallelConfig  # noqa: E402
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.core.tensor_parallel.random import (  # noqa: E402
    get_cuda_rng_tracker,
    model_parallel_cuda_manual_seed,
)
from megatron.core.transformer import TransformerConfig  # noqa: E402

import rlmem  # noqa: E402

if DEV == "cpu":
    get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
FIRST, LAST = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()
SEQ, BATCH, HIDDEN = 16, 2, 64


def build(seed: int) -> tuple[DDP, object]:
    torch.manual_seed(seed)
    if DEV == "cuda":
        model_parallel_cuda_manual_seed(seed)
    cfg = TransformerConfig(
        num_layers=2,
        hidden_size=HIDDEN,
        num_attention_heads=4,
        use_cpu_initialization=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=TP,
        pipeline_model_parallel_size=PP,
        pipeline_dtype=torch.float32,
        sequence_parallel=SP,
    )
    spec = get_gpt_layer_local_spec()
    model = GPTModel(
        config=cfg,
        transformer_layer_spec=spec,
        vocab_size=128,
        max_sequence_length=32,
        pre_process=FIRST,
        post_process=LAST,
    ).to(DEV)
    ddp = DDP(cfg, DistributedDataParallelConfig(use_distributed_optimizer=DEV == "cuda"), model)
    return ddp, optimizer(ddp)


def optimizer(ddp: DDP) -> object:
    if DEV == "cuda":
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        return get_megatron_optimizer(
            OptimizerConfig(optimizer="adam", lr=1e-2, use_distributed_optimizer=True), [ddp]
        )
    return MixedPrecision(ddp)


class MixedPrecision:
    """Megatron's mixed-precision optimizer's structure: fp32 main parameters under AdamW."""

    def __init__(self, ddp: DDP) -> None:
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


g = torch.Generator().manual_seed(1 + (dist.get_rank() if args.layout == "dp2" else 0))  # dp: its own data
TOK = torch.randint(0, 128, (BATCH, SEQ), generator=g).to(DEV)
POS = torch.arange(SEQ, device=DEV).expand(BATCH, SEQ)
MASK = torch.triu(torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool, device=DEV), 1)
PEER = 1 - rank


def step(ddp: DDP, opt: object) -> float:
    """One step as a Megatron trainer takes it; in ``pp2`` the first stage sends its output to the last,
    which sends back its gradient. The loss (the last stage's) is shared with every rank."""
    ddp.zero_grad_buffer()
    opt.zero_grad()
    if PP == 1:
        loss = ddp(TOK, POS, MASK, labels=TOK).float().mean()
        loss.backward()
    elif FIRST:
        out = ddp(TOK, POS, MASK)
        dist.send(out.detach().contiguous(), PEER)
        grad = torch.empty_like(out)
        dist.recv(grad, PEER)
        out.backward(grad)
        loss = torch.zeros((), device=DEV)
    else:
        inp = torch.empty(SEQ, BATCH, HIDDEN, device=DEV)
        dist.recv(inp, PEER)
        inp.requires_grad_(True)
        ddp.module.set_input_tensor(inp)
        loss = ddp(None, POS, MASK, labels=TOK).float().mean()
        loss.backward()
        dist.send(inp.grad.contiguous(), PEER)
    ddp.finish_grad_sync()
    opt.step()
    loss = loss.detach().reshape(1)
    if PP > 1:
        dist.broadcast(loss, PP - 1)  # the last stage's
    elif args.layout == "dp2":
        dist.all_reduce(loss)  # each rank's own data: the mean
        loss /= dist.get_world_size()
    return float(loss)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.uint8).cpu()


def mains(opt: object) -> list[torch.Tensor]:
    if hasattr(opt, "main"):
        return list(opt.main)
    inner = [o.optimizer for o in getattr(opt, "chained_optimizers", [opt])]
    return [q for o in inner for g in o.param_groups for q in g["params"]]


def grads_with_offloaded_activations() -> tuple[bool, int]:
    """Whether one step's gradients with every Megatron name's activations offloaded equal those without,
    and the bytes offloaded."""
    from rlmem.activations.modmap import DENSE_NAMES

    grads, moved = [], 0
    for offload in (False, True):
        m, _ = build(0)
        m.zero_grad_buffer()
        ctx = rlmem.offload_activations(m.module, list(DENSE_NAMES), min_bytes=0) if offload else None
        with ctx or contextlib.nullcontext():
            m(TOK, POS, MASK, labels=TOK).float().mean().backward()
        grads.append([bits(q.main_grad) for q in m.parameters()])
        if ctx is not None:
            moved = ctx.stats().as_dict()["offloaded_bytes"]
            ctx.remove()
    return all(torch.equal(a, b) for a, b in zip(*grads, strict=True)), moved


act_same, act_bytes = grads_with_offloaded_activations() if args.layout == "tp2" else (None, 0)
ref, ref_opt = build(0)
ref_losses = [step(ref, ref_opt) for _ in range(args.steps)]
ddp, opt = build(0)
st = rlmem.TrainState(ddp, opt)
adopted = {c: s.bytes for c, s in st.stats().categories.items()}
losses, checks = [], []
for _ in range(args.steps):
    losses.append(step(ddp, opt))
    params = [q.detach().clone() for q in ddp.parameters()]
    main = [m.detach().clone() for m in mains(opt)]
    st.offload(params="offload", grads="discard", optimizer="offload", blocking=True)
    cats = st.stats().categories
    checks.append(
        {
            "resident": sum(c.resident_bytes for c in cats.values()),
            "bytes": sum(c.bytes for c in cats.values()),
            # read while away (a rollout logging a weight): the host copies, the same bits
            "params_read": all(torch.equal(a, b) for a, b in zip(ddp.parameters(), params, strict=True)),
            "main_read": all(torch.equal(a, b) for a, b in zip(mains(opt), main, strict=True)),
        }
    )
    st.reload(blocking=True)
same_params = all(
    torch.equal(bits(a), bits(b)) for a, b in zip(ref.parameters(), ddp.parameters(), strict=True)
)
same_main = all(torch.equal(bits(a), bits(b)) for a, b in zip(mains(ref_opt), mains(opt), strict=True))
Path(args.out, f"rank{rank}.json").write_text(
    json.dumps(
        {
            "rank": rank,
            "layout": args.layout,
            "tp": ps.get_tensor_model_parallel_world_size(),
            "pp": ps.get_pipeline_model_parallel_world_size(),
            "dp": ps.get_data_parallel_world_size(),
            "stage": "first" if FIRST and not LAST else "last" if LAST and not FIRST else "whole",
            "n_params": sum(q.numel() for q in ddp.parameters()),
            "ref": ref_losses,
            "losses": losses,
            "checks": checks,
            "adopted": adopted,
            "same_params": same_params,
            "same_main": same_main,
            "activations_offloaded_grads_equal": act_same,
            "activations_offloaded_bytes": act_bytes,
            "sequence_parallel": SP,
        }
    )
)
st.close()
dist.barrier()
dist.destroy_process_group()
