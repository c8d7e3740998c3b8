"""copy_full against gathering each DTensor alone. Every rank fills copies of DTensors sharded on dim 0
(evenly, unevenly, fewer rows than ranks, no rows), replicated and sharded on dim 1, in two dtypes, with
bucket sizes from one parameter per bucket to all in one. Rank 0 writes whether every copy is bit for bit the
one-by-one gather's, and how many all-gathers each took.

Run as a script (tests call it in a fresh process): python tests/_copy_full.py BACKEND DEVICE OUT WORLD
"""

from __future__ import annotations

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))

from _helpers import rank_group, spawn_ranks

SHAPES = [(7, 5), (2, 3), (1,), (9,), (3, 4, 2), (6, 6), (0, 4), (10, 1), (4,), (5, 3), (12, 8)]


def worker(rank: int, world: int, port: int, out: str, backend: str, device_kind: str) -> None:
    device = f"cuda:{rank}" if device_kind == "cuda" else "cpu"
    if device_kind == "cuda":
        torch.cuda.set_device(rank)
    with rank_group(backend, rank, world, port):
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Replicate, Shard, distribute_tensor

        from rlmem._dtensor import ALL_GATHER, copy_full, full

        mesh = init_device_mesh(device_kind, (world,))
        gen = torch.Generator().manual_seed(0)
        srcs = []
        for i, shape in enumerate(SHAPES):
            t = torch.randn(*shape, generator=gen).to(device)
            placement = Replicate() if i == 5 else Shard(1) if i == 9 else Shard(0)
            srcs.append(distribute_tensor(t, mesh, [placement]))
        srcs.append(torch.randn(3, 3, generator=gen).to(device))  # a plain tensor among them
        # the gathers copy_full issues, by the name it calls
        name, gathers = ALL_GATHER, []
        plain = getattr(dist, name)
        setattr(dist, name, lambda o, i, **kw: gathers.append(str(i.dtype)) or plain(o, i, **kw))
        res: dict[str, object] = {"world": world, "cases": []}
        try:
            for dtype in (torch.bfloat16, torch.float32):
                want = [full(s, dtype).to(dtype) for s in srcs]
                for bucket_bytes in (1, 96, 1 << 20):
                    dsts = [torch.full(s.shape, float("nan"), dtype=dtype, device=device) for s in srcs]
                    gathers.clear()
                    copy_full(zip(srcs, dsts, strict=True), bucket_bytes=bucket_bytes)
                    same = all(
                        torch.equal(a.flatten().view(torch.uint8), b.flatten().contiguous().view(torch.uint8))
                        for a, b in zip(dsts, want, strict=True)
                    )
                    case = {"dtype": str(dtype), "bucket_bytes": bucket_bytes, "same": same}
                    res["cases"].append({**case, "gathers": len(gathers), "dtypes": sorted(set(gathers))})
        finally:
            setattr(dist, name, plain)
        if rank == 0:
            with open(out, "w") as f:
                json.dump(res, f)


if __name__ == "__main__":
    backend, device_kind, out, world = sys.argv[1:5]
    spawn_ranks(worker, int(world), out, backend, device_kind)
