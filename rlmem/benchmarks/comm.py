"""Benchmark of NCCL communicator suspend/resume against destroying and re-creating the same groups.

Two ranks (one per GPU) create 1, 4 and 8 NCCL groups over all ranks, each with a communicator set up by a
warm-up all-reduce. For each count: ``rlmem.comm.suspend`` + ``resume`` of all of them (seconds, device bytes
freed, NCCL's suspendable bytes), then the alternative: ``destroy_process_group`` of each and ``new_group`` +
one all-reduce each to bring the communicators back (seconds). The summary, at 8 groups (or the largest):
``suspend_resume_s`` (slowest rank), ``freed_fraction`` (device bytes freed over NCCL's suspendable bytes),
``speedup_vs_recreate``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
import time
from typing import Any

import torch

NAME = "comm"
TARGETS = {"suspend_resume_s": ("<", 1.0), "freed_fraction": (">=", 0.9), "speedup_vs_recreate": (">=", 5.0)}


def _groups(n: int, world: int) -> list[Any]:
    import torch.distributed as dist

    gs = [dist.new_group(list(range(world))) for _ in range(n)]
    for g in gs:
        t = torch.ones(1 << 20, device="cuda")
        dist.all_reduce(t, group=g)
    torch.cuda.synchronize()
    return gs


def _worker(rank: int, world: int, counts: list[int], reps: int, port: int, out: str) -> None:
    import torch.distributed as dist

    from .. import comm

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
    res: dict[str, Any] = {"nccl": comm._get_driver().describe, "points": {}}
    try:
        if not comm._get_driver().can_suspend:
            res["error"] = "the loaded NCCL has no ncclCommSuspend (needs 2.29.7 or later)"
            return
        for n in counts:
            gs = _groups(n, world)
            stats = comm.memory_stats(gs)
            suspendable = sum(v["suspendable_bytes"] for v in stats.values())
            rows = []
            for _ in range(reps):
                dist.barrier(device_ids=[rank])
                torch.cuda.synchronize()
                free0 = torch.cuda.mem_get_info()[0]
                t0 = time.perf_counter()
                comm.suspend(gs)
                t1 = time.perf_counter()
                free1 = torch.cuda.mem_get_info()[0]
                comm.resume(gs)
                t2 = time.perf_counter()
                rows.append({"suspend_s": t1 - t0, "resume_s": t2 - t1, "freed_bytes": free1 - free0})
            # The alternative: destroy the groups and build them again (communicators included).
            dist.barrier(device_ids=[rank])
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for g in gs:
                dist.destroy_process_group(g)
            t1 = time.perf_counter()
            gs = _groups(n, world)
            t2 = time.perf_counter()
            best = min(rows, key=lambda r: r["suspend_s"] + r["resume_s"])
            res["points"][str(n)] = {
                "suspendable_bytes": suspendable,
                "runs": rows,
                "suspend_s": best["suspend_s"],
                "resume_s": best["resume_s"],
                "freed_bytes": best["freed_bytes"],
                "destroy_s": t1 - t0,
                "recreate_s": t2 - t1,
            }
            for g in gs:
                dist.destroy_process_group(g)
    finally:
        with open(f"{out}.rank{rank}.json", "w") as f:
            json.dump(res, f)
        dist.destroy_process_group()


def summarize(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    pts = ranks[0].get("points", {})
    if not pts:
        return {}
    n = max(pts, key=int)
    sr = max(r["points"][n]["suspend_s"] + r["points"][n]["resume_s"] for r in ranks)
    recreate = max(r["points"][n]["destroy_s"] + r["points"][n]["recreate_s"] for r in ranks)
    freed = min(r["points"][n]["freed_bytes"] / max(r["points"][n]["suspendable_bytes"], 1) for r in ranks)
    return {
        "groups": int(n),
        "suspend_resume_s": sr,
        "freed_fraction": freed,
        "speedup_vs_recreate": recreate / sr,
    }


def main(argv: list[str] | None = None, *, default_json_dir: str | None = None) -> int:
    from ._common import (
        check_targets,
        environment,
        format_table,
        machine_name,
        summary_lines,
        targets_text,
        write_json,
    )

    p = argparse.ArgumentParser(prog="rlmem bench comm", description=__doc__.splitlines()[0])
    p.add_argument("--counts", default="1,4,8")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--machine", default=None)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if torch.cuda.device_count() < 2:
        print("the comm benchmark needs 2 CUDA devices", file=sys.stderr)
        return 2
    import torch.multiprocessing as mp

    device = torch.device("cuda", 0)
    machine = args.machine or machine_name(device)
    counts = [int(c) for c in args.counts.split(",")]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "comm")
        mp.spawn(_worker, args=(2, counts, args.reps, port, out), nprocs=2, join=True)
        ranks = []
        for r in (0, 1):
            with open(f"{out}.rank{r}.json") as f:
                ranks.append(json.load(f))
    if "error" in ranks[0]:
        print(f"{ranks[0]['nccl']}: {ranks[0]['error']}", file=sys.stderr)
        return 1
    rows = []
    for n, v in ranks[0]["points"].items():
        rows.append(
            {
                "n": n,
                "susp": v["suspend_s"] * 1e3,
                "res": v["resume_s"] * 1e3,
                "mib": v["suspendable_bytes"] / 2**20,
                "freed": v["freed_bytes"] / 2**20,
                "rec": (v["destroy_s"] + v["recreate_s"]) * 1e3,
            }
        )
    cols = [
        ("n", "groups", "s"),
        ("susp", "suspend ms", ".1f"),
        ("res", "resume ms", ".1f"),
        ("mib", "suspendable MiB", ".1f"),
        ("freed", "freed MiB", ".1f"),
        ("rec", "destroy+recreate ms", ".1f"),
    ]
    print(f"rank 0, {ranks[0]['nccl']}")
    print(format_table(rows, cols))
    summary = summarize(ranks)
    met = check_targets(summary, TARGETS)
    print(summary_lines(summary, met))
    path = args.json or (f"{default_json_dir}/{NAME}-{machine}.json" if default_json_dir else None)
    payload = {
        "benchmark": NAME,
        "machine": machine,
        **environment(device),
        "nccl": ranks[0]["nccl"],
        "ranks": ranks,
        "summary": summary,
        "targets": targets_text(TARGETS),
        "targets_met": met,
    }
    if path:
        print(f"wrote {write_json(path, payload)}")
    return 0
