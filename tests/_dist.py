"""Two-rank DDP or FSDP2 training with and without TrainState offload between steps; rank 0 writes the
losses and a parameter checksum, and whether the state read while offloaded (sharded and full state dicts,
the optimizer's) equalled the state before.

Run as a script (tests call it in a fresh process): python tests/_dist.py ddp|fsdp BACKEND DEVICE OUT [WORLD]
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))

from _helpers import rank_group, spawn_ranks
from _models import make

from rlmem import TrainState


def wrap(kind: str, model: torch.nn.Module, rank: int, device: str) -> torch.nn.Module:
    world = torch.distributed.get_world_size()
    if kind == "ddp":
        return torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[rank] if device.startswith("cuda") else None
        )
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model.mix = torch.nn.Parameter(model.mix.detach().contiguous())  # FSDP2 shards contiguous params only
    mesh = init_device_mesh(device.split(":")[0], (world,))
    for layer in (model.up, model.down, model.frozen):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _local(v: object) -> object:
    if isinstance(v, torch.Tensor):
        return (v.to_local() if hasattr(v, "to_local") else v).detach().cpu().clone()
    return v


def _readable(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, object]:
    """What a user reads for a checkpoint: the sharded state dict, the full one (a collective for FSDP2) and
    the optimizer's, as CPU tensors."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    out: dict[str, object] = {f"sharded {k}": _local(v) for k, v in model.state_dict().items()}
    out.update({f"full {k}": _local(v) for k, v in full.items()})
    for i, st in opt.state_dict()["state"].items():
        out.update({f"opt {i}.{k}": _local(v) for k, v in st.items()})
    return out


def _same(a: dict[str, object], b: dict[str, object]) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(x, b[k]) if isinstance(x, torch.Tensor) else x == b[k] for k, x in a.items()
    )


def train(
    kind: str, rank: int, device: str, offload: bool, grads: str, touched: list[bool], adopt_at: int = 0
) -> list[float]:
    """Five steps, offloading and reloading after each from step ``adopt_at`` on (1: a TrainState made after
    FSDP's lazy initialisation, as one is that adopts at the first offload)."""
    model = make(0, device, mixed=False)
    wrapped = wrap(kind, model, rank, device)
    opt = torch.optim.AdamW(wrapped.parameters(), lr=1e-2)
    st = None
    g = torch.Generator().manual_seed(100 + rank)  # each rank its own data: the all-reduce matters
    losses = []
    for step in range(5):
        if offload and step == adopt_at:
            st = TrainState(wrapped, opt)
        x = torch.randint(0, 61, (4, 9), generator=g).to(device)
        loss = wrapped(x).float().logsumexp(-1).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=grads == "discard")
        t = loss.detach().clone()
        dist.all_reduce(t)
        losses.append(t.item())
        if st is not None:
            want = _readable(wrapped, opt)
            st.offload(params="offload", grads=grads, optimizer="offload", blocking=step % 2 == 0)
            if step % 2 == 0:  # a blocking offload has released everything by now
                assert all(r.resident_bytes == 0 for c in ("params", "optimizer") for r in st.regions(c))
            touched.append(_same(_readable(wrapped, opt), want))  # at once, a non-blocking release in flight
            st.reload(blocking=step % 2 == 1)
    if st is not None:
        st.synchronize()
        st.close()  # hands everything back; the model must still be whole
    params = torch.cat([_full(p).detach().float().reshape(-1).cpu() for p in model.parameters()])
    return [*losses, params.sum().item(), params.abs().sum().item()]


def _full(p: torch.Tensor) -> torch.Tensor:
    return p.full_tensor() if hasattr(p, "full_tensor") else p


def worker(rank: int, world: int, port: int, out: str, kind: str, backend: str, device_kind: str) -> None:
    device = f"cuda:{rank}" if device_kind == "cuda" else "cpu"
    if device_kind == "cuda":
        torch.cuda.set_device(rank)
    with rank_group(backend, rank, world, port):
        res: dict[str, object] = {}
        for grads in ("discard", "offload"):
            touched: list[bool] = []
            res[grads] = {
                "ref": train(kind, rank, device, False, grads, touched),
                "got": train(kind, rank, device, True, grads, touched),
                "touched": touched,
            }
        # adopted after a step: FSDP's lazy initialisation done, its parameters' own local tensors re-pointed
        touched = []
        res["adopted later"] = {
            "ref": res["offload"]["ref"],
            "got": train(kind, rank, device, True, "offload", touched, adopt_at=1),
            "touched": touched,
        }
        model = wrap(kind, make(0, device, mixed=False), rank, device)
        res["discard_refused"] = ""
        try:
            TrainState(model, None).offload(params="discard")
        except ValueError as e:
            res["discard_refused"] = str(e)
        if rank == 0:
            with open(out, "w") as f:
                json.dump(res, f)


if __name__ == "__main__":
    kind, backend, device_kind, out = sys.argv[1:5]
    spawn_ranks(worker, int(sys.argv[5]) if len(sys.argv) > 5 else 2, out, kind, backend, device_kind)
