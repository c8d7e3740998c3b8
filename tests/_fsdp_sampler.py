"""HFSampler over an FSDP2-sharded model with a rollout copy: each rank samples from the full bf16 weights
through the model's unsharded twin, with no collective while sampling and (on a GPU) no graph captured
again after a training step. Rank 0 writes what it saw.

Run as a script (tests call it in a fresh process): python tests/_fsdp_sampler.py BACKEND DEVICE OUT [WORLD]
"""

from __future__ import annotations

import copy
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))

from _helpers import rank_group, spawn_ranks
from _models import PROMPTS, tiny_qwen2

from rlmem.rollout import HFSampler


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, device: str) -> None:
    """The same batch on every rank: FSDP's averaged gradients are the unsharded model's own."""
    ids = torch.tensor([[1, 5, 6, 7, 3, 9, 4, 2]], device=device)
    model.train()
    model(input_ids=ids).logits.float().logsumexp(-1).mean().backward()
    opt.step()
    opt.zero_grad()
    model.eval()


def worker(rank: int, world: int, port: int, out: str, backend: str, device_kind: str) -> None:
    device = f"cuda:{rank}" if device_kind == "cuda" else "cpu"
    if device_kind == "cuda":
        torch.cuda.set_device(rank)
    with rank_group(backend, rank, world, port):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        model = tiny_qwen2(device)
        ref = copy.deepcopy(model)
        mesh = init_device_mesh(device_kind, (world,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
        kw = dict(max_len=24, batch_size=4, pad_token_id=0, eos_token_id=2, rollout_dtype=torch.bfloat16)
        s = HFSampler(model, **kw)
        r = HFSampler(ref, **kw)
        calls = []
        hook = model.register_forward_pre_hook(lambda m, a: calls.append(1))  # FSDP's root forward
        res: dict[str, object] = {"world": world, "same": [], "captures": [], "fsdp_forwards": []}
        for step in range(3):
            if step:
                train_step(model, opt, device)
                train_step(ref, ref_opt, device)
                s.sleep(level=2)  # as in the train phase: copy and cache discarded
                s.wake()
                s.sync_weights()
                r.sync_weights()
            calls.clear()
            got = s.generate(PROMPTS, max_new_tokens=10, temperature=0)
            got += s.generate(PROMPTS, max_new_tokens=10, temperature=1.0, top_p=0.9, seed=7)
            want = r.generate(PROMPTS, max_new_tokens=10, temperature=0)
            want += r.generate(PROMPTS, max_new_tokens=10, temperature=1.0, top_p=0.9, seed=7)
            res["same"].append(got == want)
            res["captures"].append(s.captures)
            res["fsdp_forwards"].append(len(calls))
        hook.remove()
        # The copy is each parameter cast to bf16, bit for bit, and the sync gathers the shards in bf16 (cast
        # before the gather): half the bytes of gathering the fp32 shards, many parameters in one all-gather.
        import torch.distributed as dist
        from torch.distributed.tensor import DTensor

        from rlmem._dtensor import ALL_GATHER as name

        gathered, plain, plain_ag = [], DTensor.full_tensor, getattr(dist, name)
        DTensor.full_tensor = lambda t, **kw: gathered.append(str(t.dtype)) or plain(t, **kw)
        setattr(dist, name, lambda o, i, **kw: gathered.append(str(i.dtype)) or plain_ag(o, i, **kw))
        try:
            s.sync_weights()
        finally:
            DTensor.full_tensor = plain
            setattr(dist, name, plain_ag)
        res["gathers"], res["params"] = len(gathered), len(list(model.parameters()))
        res["gathered_dtypes"] = sorted(set(gathered))
        want_bf16 = {n: p.detach().to(torch.bfloat16) for n, p in ref.named_parameters()}
        res["copy_bits_equal"] = all(
            torch.equal(s.weights[n].view(torch.int16), w.view(torch.int16)) for n, w in want_bf16.items()
        )
        full = {n: p.full_tensor() for n, p in model.named_parameters()}
        res["params_equal"] = all(torch.equal(full[n], p) for n, p in ref.named_parameters())
        res["copy_bytes"] = s.weights_region.nbytes
        res["full_bytes_bf16"] = sum(p.numel() * 2 for p in ref.parameters())
        res["copy_is_bf16"] = all(w.dtype == torch.bfloat16 for w in s.weights.values())
        if rank == 0:
            with open(out, "w") as f:
                json.dump(res, f)


if __name__ == "__main__":
    backend, device_kind, out = sys.argv[1:4]
    spawn_ranks(worker, int(sys.argv[4]) if len(sys.argv) > 4 else 2, out, backend, device_kind)
