"""Two-rank DDP training with and without TrainState offload between steps; rank 0 prints the losses.

Run as a script (tests call it in a fresh process): python tests/_ddp.py BACKEND DEVICE
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


def train(rank: int, device: str, offload: bool) -> list[float]:
    model = make(0, device, mixed=False)
    ddp = torch.nn.parallel.DistributedDataParallel(
        model, device_ids=[rank] if device.startswith("cuda") else None
    )
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    st = TrainState(ddp, opt) if offload else None
    g = torch.Generator().manual_seed(100 + rank)  # each rank its own data: the all-reduce matters
    losses = []
    for step in range(5):
        x = torch.randint(0, 61, (4, 9), generator=g).to(device)
        loss = ddp(x).float().logsumexp(-1).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        t = loss.detach().clone()
        dist.all_reduce(t)
        losses.append(t.item())
        if st is not None:
            st.offload(params="offload", grads="discard", optimizer="offload", blocking=step % 2 == 0)
            st.reload(blocking=step % 2 == 1)
    if st is not None:
        st.synchronize()
    params = torch.cat([p.detach().float().reshape(-1).cpu() for p in model.parameters()])
    return [*losses, params.sum().item(), params.abs().sum().item()]


def worker(rank: int, world: int, backend: str, device_kind: str, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = f"cuda:{rank}" if device_kind == "cuda" else "cpu"
    if device_kind == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, rank=rank, world_size=world)
    try:
        ref = train(rank, device, offload=False)
        got = train(rank, device, offload=True)
        if rank == 0:
            with open(out, "w") as f:
                json.dump({"ref": ref, "got": got}, f)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    backend, device_kind, out = sys.argv[1], sys.argv[2], sys.argv[3]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(2, backend, device_kind, port, out), nprocs=2, join=True)
    with open(out) as f:
        print(f.read())
