"""The two processes of a handoff, for ``rlmem bench colocate --parts handoff`` and the tests: a train-like
process (a train state backed up to host memory at each handoff, a small policy's rollout weights shared)
and a rollout-like one (a KV-cache-like Region discarded at each handoff, running on the shared weights).

``python -m rlmem.benchmarks.colocate_roles train|rollout --path SOCK --device D ...``. The trainer drives
the rollout process through :class:`~rlmem.rollout.PeerEngine` in ``PhaseManager``'s order (weights, sync,
offload, fenced release, the peer's admitted acquire of its cache; and back) for ``--handoffs`` handoffs,
checks every byte of its state against the pattern it wrote, and prints one JSON line: per handoff, the
time and the fences; the copy times of the same state measured alone in the same run before the first.
``--hang`` makes a side stop at a point of the switch (for the tests that kill it there).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import torch
from torch import nn

from ..colocate import Member, SharedWeights
from ..memory.region import Region
from ..rollout.remote.peer import PeerEngine, serve_engine

_PRIME = 65521
_CHUNK = 1 << 28  # elements per chunk when writing and checking the pattern


def _pattern(x: torch.Tensor, seed: int) -> None:
    for s in range(0, x.numel(), _CHUNK):
        n = min(_CHUNK, x.numel() - s)
        x[s : s + n] = (torch.arange(s, s + n, device=x.device) * seed % _PRIME).to(x.dtype)


def _intact(x: torch.Tensor, seed: int) -> bool:
    for s in range(0, x.numel(), _CHUNK):
        n = min(_CHUNK, x.numel() - s)
        want = (torch.arange(s, s + n, device=x.device) * seed % _PRIME).to(x.dtype)
        if not torch.equal(x[s : s + n], want):
            return False
    return True


def _hang(where: str, at: str) -> None:
    if where == at:
        print(json.dumps({"hanging": at}), flush=True)
        time.sleep(3600)


class KVEngine:
    """A rollout engine's memory, by the protocol: a KV-cache-like Region, discarded when asleep, and the
    trainer's weights mapped (``attach_weights``)."""

    def __init__(self, nbytes: int, device: torch.device, hang: str) -> None:
        self.kv = Region(nbytes, device, shareable=device.type == "cpu", name="kv_cache")
        self.cache = self.kv.empty(self.kv.nbytes // 4, torch.float32)
        self.kv.pause(keep=False)  # asleep until the trainer hands the device over
        self.weights: Any = None
        self.hang = hang

    def attach_weights(self, weights: Any) -> None:
        self.weights = weights

    def sleep(self, level: int = 1) -> None:
        _hang(self.hang, "sleep")
        self.kv.pause(keep=False)

    def wake(self, tags: list[str] | None = None) -> None:
        if tags is None or "kv_cache" in tags:
            _hang(self.hang, "wake")
            self.kv.resume()

    def generate(self, step: int) -> dict[str, Any]:
        """Fill the cache (a rollout touching its memory) and read the weights as synced."""
        w = self.weights.tensors["weight"]
        self.cache.fill_(float(step))
        if self.cache.is_cuda:
            torch.cuda.synchronize()
        return {"w00": float(w[0, 0]), "cache_ok": float(self.cache[-1]) == float(step)}


def rollout(args: argparse.Namespace) -> int:
    dev = torch.device(args.device)
    member = Member("rollout", path=args.path, device=dev, timeout=args.timeout)
    member.acquire(args.kv_bytes)  # making memory is taking it: with the grant, then given back, fenced
    engine = KVEngine(args.kv_bytes, dev, args.hang)
    member.track("kv_cache", engine.kv)
    member.release()
    served = serve_engine(member, engine, methods=("generate",), idle_timeout=args.timeout)
    print(json.dumps({"served": served}), flush=True)
    member.close()
    return 0


def _copy_times(state: Region, repeat: int) -> tuple[float, float]:
    """Median seconds of the state's backed-up pause and of its resume, alone (no peer, no fence)."""
    outs, ins = [], []
    for _ in range(repeat):
        t0 = time.perf_counter()
        state.pause(keep=True)
        t1 = time.perf_counter()
        state.resume()
        if state.device.type == "cuda":
            torch.cuda.synchronize()
        t2 = time.perf_counter()
        outs.append(t1 - t0)
        ins.append(t2 - t1)
    return sorted(outs)[len(outs) // 2], sorted(ins)[len(ins) // 2]


def train(args: argparse.Namespace) -> int:
    dev = torch.device(args.device)
    member = Member("train", path=args.path, device=dev, timeout=args.timeout)
    member.wait_for("rollout")  # it makes its memory first, under the grant, and gives the device back
    member.acquire(args.state_bytes)
    state = Region(args.state_bytes, dev, shareable=dev.type == "cpu", name="train_state")
    x = state.empty(state.nbytes // 4, torch.float32)
    _pattern(x, 7)
    if dev.type == "cuda":
        torch.cuda.empty_cache()  # the pattern's temporaries are not the train state
    member.track("optimizer", state)
    policy = nn.Linear(64, 64, device=dev)
    with torch.no_grad():
        policy.weight.zero_()
    shared = SharedWeights(policy, torch.bfloat16)
    member.track("weights", shared.region)
    copy_out, copy_in = _copy_times(state, args.copy_repeat)
    peer = PeerEngine(member, weights=shared, timeout=args.timeout)
    rows, weights_seen = [], True
    for i in range(args.handoffs // 2):
        level = 2 if args.level2_every and i % args.level2_every == args.level2_every - 1 else 1
        t0 = time.perf_counter()
        peer.wake(tags=["weights"])
        with torch.no_grad():
            policy.weight.fill_(float(i + 1))
        shared.sync()
        state.pause(keep=True)
        _hang(args.hang, "offload")
        peer.wake(tags=["kv_cache"])
        t1 = time.perf_counter()
        got = peer.call("generate", step=i + 1)
        weights_seen &= got["w00"] == float(i + 1) and got["cache_ok"]
        t2 = time.perf_counter()
        peer.sleep(level)
        state.resume()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t3 = time.perf_counter()
        rows.append(
            {
                "to_rollout_s": t1 - t0,
                "to_train_s": t3 - t2,
                "level": level,
                "fence": peer.last_fence.as_dict(),
                "peer_fence": peer.last_peer_fence,
                "grant_wait_s": peer.last_grant.waited_s,
            }
        )
    intact = _intact(x, 7)
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    peer.stop()
    out = {
        "state_bytes": state.nbytes,
        "copy_out_s": copy_out,
        "copy_in_s": copy_in,
        "handoffs": rows,
        "intact": intact,
        "weights_seen": weights_seen,
    }
    print(json.dumps(out), flush=True)
    member.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m rlmem.benchmarks.colocate_roles")
    p.add_argument("role", choices=("train", "rollout"))
    p.add_argument("--path", required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--state-bytes", type=int, default=64 << 20)
    p.add_argument("--kv-bytes", type=int, default=64 << 20)
    p.add_argument("--frac", type=float, default=0.0, help="if > 0: each side holds this share of the device")
    p.add_argument("--handoffs", type=int, default=4, help="one-way handoffs (a round trip is two)")
    p.add_argument("--level2-every", type=int, default=0, help="every Nth round trip sleeps at level 2")
    p.add_argument("--copy-repeat", type=int, default=3)
    p.add_argument("--timeout", type=float, default=60.0)
    p.add_argument("--hang", default="", help="stop for good at: offload (train), wake or sleep (rollout)")
    args = p.parse_args(argv)
    if args.frac > 0:
        from ..colocate.device import mem_info

        size = int(mem_info(torch.device(args.device))[1] * args.frac) >> 21 << 21
        args.state_bytes = args.kv_bytes = size
    return train(args) if args.role == "train" else rollout(args)


if __name__ == "__main__":
    sys.exit(main())
