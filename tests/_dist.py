"""Two-rank DDP or FSDP2 training with and without TrainState offload between steps; rank 0 writes the
losses and a parameter checksum.

Run as a script (tests call it in a fresh process): python tests/_dist.py ddp|fsdp BACKEND DEVICE OUT
"""

from __future__ import annotations

import json
import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))

from _models import make

from rlmem import TrainState


def wrap(kind: str, model: torch.nn.Module, rank: int, device: str) -> torch.nn.Module:
    if kind == "ddp":
        return torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[rank] if device.startswith("cuda") else None
        )
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model.mix = torch.nn.Parameter(model.mix.detach().contiguous())  # FSDP2 shards contiguous params only
    mesh = init_device_mesh(device.split(":")[0], (2,))
    for layer in (model.up, model.down, model.frozen):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def train(kind: str, rank: int, device: str, offload: bool, grads: str) -> list[float]:
    model = make(0, device, mixed=False)
    wrapped = wrap(kind, model, rank, device)
    opt = torch.optim.AdamW(wrapped.parameters(), lr=1e-2)
    st = TrainState(wrapped, opt) if offload else None
    g = torch.Generator().manual_seed(100 + rank)  # each rank its own data: the all-reduce matters
    losses = []
    for step in range(5):
        x = torch.randint(0, 61, (4, 9), generator=g).to(device)
        loss = wrapped(x).float().logsumexp(-1).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=grads == "discard")
        t = loss.detach().clone()
        dist.all_reduce(t)
        losses.append(t.item())
        if st is not None:
            st.offload(params="offload", grads=grads, optimizer="offload", blocking=step % 2 == 0)
            if step % 2 == 0:  # a blocking offload has released everything by now
                assert all(r.resident_bytes == 0 for c in ("params", "optimizer") for r in st.regions(c))
            st.reload(blocking=step % 2 == 1)
    if st is not None:
        st.synchronize()
        st.close()  # hands everything back; the model must still be whole
    params = torch.cat([_full(p).detach().float().reshape(-1).cpu() for p in model.parameters()])
    return [*losses, params.sum().item(), params.abs().sum().item()]


def _full(p: torch.Tensor) -> torch.Tensor:
    return p.full_tensor() if hasattr(p, "full_tensor") else p


def worker(rank: int, world: int, kind: str, backend: str, device_kind: str, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = f"cuda:{rank}" if device_kind == "cuda" else "cpu"
    if device_kind == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, rank=rank, world_size=world)
    try:
        res = {}
        for grads in ("discard", "offload"):
            res[grads] = {
                "ref": train(kind, rank, device, False, grads),
                "got": train(kind, rank, device, True, grads),
            }
        if rank == 0:
            with open(out, "w") as f:
                json.dump(res, f)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    kind, backend, device_kind, out = sys.argv[1:5]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(2, kind, backend, device_kind, port, out), nprocs=2, join=True)
    with open(out) as f:
        print(f.read())
