"""Two-rank FSDP1 (FullyShardedDataParallel) training with and without TrainState offload between steps, for
use_orig_params False and True; rank 0 writes, per rank and case, whether the losses, sharded parameters,
gradients and optimizer states equalled the run without offload bit for bit, and the checks made along the
way (all in Regions after FSDP's own steps, released by a blocking offload, read the same while offloaded);
and the refusals of layouts TrainState does not adopt.

Run as a script (tests call it in a fresh process): python tests/_dist_fsdp1.py OUT [cpu|cuda] [WORLD]
(Gloo on the CPU, NCCL with a rank per GPU; FSDP1 runs a world of one unsharded, so WORLD is at least 2).
"""

from __future__ import annotations

import functools
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))

from _helpers import rank_group, same_tensors, spawn_ranks
from _models import make
from torch.distributed.fsdp import CPUOffload, MixedPrecision, ShardingStrategy
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

from rlmem import TrainState

DEVICE = torch.device("cpu")  # this rank's device (worker sets it)


def wrap(orig: bool, **kw: object) -> torch.nn.Module:
    model = make(0, str(DEVICE), mixed=False)
    unit = functools.partial(FSDP, use_orig_params=orig, device_id=DEVICE, **kw)
    for name in ("up", "down", "frozen"):
        setattr(model, name, unit(getattr(model, name)))
    return unit(model)


def wrap_mixed(orig: bool, **kw: object) -> torch.nn.Module:
    """FSDP1 with a bf16 ``param_dtype`` over fp32 shards, on a model whose activations stay bf16 inside."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Embedding(61, 24), torch.nn.Linear(24, 48), torch.nn.ReLU(), torch.nn.Linear(48, 61)
    ).to(DEVICE)
    mp = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=True)
    unit = functools.partial(FSDP, use_orig_params=orig, device_id=DEVICE, mixed_precision=mp, **kw)
    for i in (1, 3):
        model[i] = unit(model[i])
    return unit(model)


def local(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """This rank's sharded flat parameters, their gradients and the optimizer's state tensors, as copies."""
    flats = [m._handle.flat_param for m in model.modules() if isinstance(m, FSDP) and m._handle is not None]
    out = [fp.detach().clone() for fp in flats]
    out += [fp.grad.detach().clone() for fp in flats if fp.grad is not None]
    for st in opt.state.values():
        out += [v.detach().clone() for v in st.values() if isinstance(v, torch.Tensor)]
    return out


def _within(regions: list, t: torch.Tensor) -> bool:
    for r in regions:
        try:
            r.span(t)
            return True
        except ValueError:
            continue
    return False


def inside(st: TrainState, model: torch.nn.Module, opt: torch.optim.Optimizer) -> bool:
    """Whether every tensor FSDP and the optimizer read the state through lies in the TrainState's Regions:
    the flat parameters, FSDP's ``_local_shard`` (which it rebinds them to at each reshard), the original
    parameters' views (use_orig_params) and the optimizer states."""
    flats = [m._handle.flat_param for m in model.modules() if isinstance(m, FSDP) and m._handle is not None]
    ps = [*flats, *(fp._local_shard for fp in flats), *(p for p in model.parameters() if p.numel())]
    states = [
        v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.numel() > 1
    ]
    return (
        all(_within(st.regions("params"), t) for t in ps)
        and bool(states)
        and all(_within(st.regions("optimizer"), v) for v in states)
    )


def grads_inside(st: TrainState, model: torch.nn.Module) -> bool:
    """Whether the sharded gradients, and the original parameters' views of them, lie in the grads Regions."""
    flats = [m._handle.flat_param for m in model.modules() if isinstance(m, FSDP) and m._handle is not None]
    gs = [t.grad for t in (*flats, *model.parameters()) if t.grad is not None]
    return bool(gs) and all(_within(st.regions("grads"), g) for g in gs)


def train(
    orig: bool, adopt_at: int | None, grads: str, checks: list[bool], build=wrap, **kw: object
) -> list[torch.Tensor]:
    """Four steps of AdamW; with ``adopt_at``, a TrainState adopts the model before that step (0: before
    FSDP's lazy initialisation; 1: after a step, over FSDP's ``_local_shard``, the original parameters'
    views, gradients and optimizer states as they are then) and offloads and reloads after each step."""
    model = build(orig, **kw)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    st = None
    g = torch.Generator().manual_seed(100 + dist.get_rank())  # each rank its own data: reduce-scatter matters
    losses = []
    for step in range(4):
        if step == adopt_at:
            st = TrainState(model, opt)
        x = torch.randint(0, 61, (4, 9), generator=g).to(DEVICE)
        loss = model(x).float().logsumexp(-1).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=grads == "discard")
        losses.append(loss.detach().clone())
        if st is not None:
            checks.append(inside(st, model, opt))  # after FSDP's forward, backward and reshard
            want = local(model, opt)
            st.offload(params="offload", grads=grads, optimizer="offload", blocking=step % 2 == 0)
            if step % 2 == 0:  # a blocking offload has released everything by now
                released = all(r.resident_bytes == 0 for c in ("params", "optimizer") for r in st.regions(c))
                checks.append(released)
            if grads == "offload":  # discarded gradients are None now, as after zero_grad()
                checks.append(same_tensors(local(model, opt), want))
            st.reload(blocking=step % 2 == 1)
            if grads == "offload":
                st.synchronize()
                checks.append(grads_inside(st, model))
    if st is not None:
        st.synchronize()
        st.close()  # hands everything back; the model must still train after
    x = torch.randint(0, 61, (4, 9), generator=g).to(DEVICE)
    model(x).float().logsumexp(-1).mean().backward()
    opt.step()
    return [*losses, *local(model, opt)]


def refusal(**kw: object) -> str:
    """The error TrainState raises for a layout, and whether it left every flat parameter where it was."""
    model = wrap(False, **kw)
    where = [p.data_ptr() for p in model.parameters()]
    try:
        TrainState(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    except ValueError as e:
        return f"{e!s} untouched={[p.data_ptr() for p in model.parameters()] == where}"
    return ""


def worker(rank: int, world: int, port: int, out: str, device_kind: str) -> None:
    global DEVICE
    DEVICE = torch.device(f"cuda:{rank}" if device_kind == "cuda" else "cpu")
    if device_kind == "cuda":
        torch.cuda.set_device(rank)
    torch.manual_seed(0)
    with rank_group("nccl" if device_kind == "cuda" else "gloo", rank, world, port):
        res: dict[str, object] = {}
        for orig in (False, True):
            for grads in ("discard", "offload"):
                checks: list[bool] = []
                ref = train(orig, None, grads, checks)
                for adopt_at in (0, 1):
                    checks = []
                    got = train(orig, adopt_at, grads, checks)
                    res[f"orig={orig} grads={grads} adopt_at={adopt_at}"] = {
                        "equal": same_tensors(got, ref),
                        "n": len(ref),
                        "checks": checks,
                    }
        # SHARD_GRAD_OP keeps the unsharded parameters from forward to backward, resharding after it.
        zero2 = {"sharding_strategy": ShardingStrategy.SHARD_GRAD_OP}
        checks = []
        ref = train(True, None, "offload", checks, **zero2)
        got = train(True, 1, "offload", checks, **zero2)
        res["orig=True grads=offload adopt_at=1 SHARD_GRAD_OP"] = {
            "equal": same_tensors(got, ref),
            "checks": checks,
        }
        # Mixed precision: FSDP all-gathers a bf16 copy of the fp32 shard that it makes and frees in forward.
        for orig in (False, True):
            checks = []
            ref = train(orig, None, "offload", checks, build=wrap_mixed)
            got = train(orig, 1, "offload", checks, build=wrap_mixed)
            res[f"orig={orig} grads=offload adopt_at=1 param_dtype=bf16"] = {
                "equal": same_tensors(got, ref),
                "checks": checks,
            }
        model = wrap(True)
        try:
            TrainState(model, None).offload(params="discard")
            res["discard_refused"] = ""
        except ValueError as e:
            res["discard_refused"] = str(e)
        res["cpu_offload"] = refusal(cpu_offload=CPUOffload(offload_params=True))
        res["no_shard"] = refusal(sharding_strategy=ShardingStrategy.NO_SHARD)
        gathered: list[object] = [None] * world
        dist.all_gather_object(gathered, res)
        if rank == 0:
            import json

            with open(out, "w") as f:
                json.dump(gathered, f)


if __name__ == "__main__":
    out, device_kind = sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "cpu"
    spawn_ranks(worker, int(sys.argv[3]) if len(sys.argv) > 3 else 2, out, device_kind)
