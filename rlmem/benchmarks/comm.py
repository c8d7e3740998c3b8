"""Benchmark of NCCL communicator suspend/resume against destroying and re-creating the same groups.

One rank per GPU (all of the machine's, at least two) creates 1, 4 and 8 NCCL groups over all ranks, each with
a communicator set up by a warm-up all-reduce. For each count: ``rlmem.comm.suspend`` + ``resume`` of all of
them (seconds, device bytes freed, NCCL's suspendable bytes) where the loaded NCCL can suspend; the same with
``method="rebuild"`` (rlmem's fallback: communicators destroyed and rebuilt under the same group objects);
then the alternative: ``destroy_process_group`` of each and ``new_group`` + one all-reduce each to bring the
communicators back (seconds). The summary, at 8 groups (or the largest), for rlmem's default path
(``method``): ``suspend_resume_s`` (slowest rank; suspend + resume + the groups' first all-reduce, where a
rebuilt communicator connects), ``freed_fraction`` (device bytes freed over NCCL's suspendable bytes),
``speedup_vs_recreate``, and the fallback's figures beside them.
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
import time
import warnings
from typing import Any

import torch

from .._units import MiB

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
    can_suspend = comm._get_driver().can_suspend
    res: dict[str, Any] = {"nccl": comm._get_driver().describe, "can_suspend": can_suspend, "points": {}}

    def touch(gs: list[Any]) -> None:
        # One small all-reduce per group: connects communicators that NCCL sets up lazily, as the first
        # collective of a train phase would.
        for g in gs:
            dist.all_reduce(torch.ones(1, device="cuda"), group=g)
        torch.cuda.synchronize()

    def cycles(gs: list[Any], method: str) -> list[dict[str, float]]:
        rows = []
        for _ in range(reps):
            touch(gs)
            dist.barrier(device_ids=[rank])
            torch.cuda.synchronize()
            free0 = torch.cuda.mem_get_info()[0]
            t0 = time.perf_counter()
            comm.suspend(gs, method=method)
            t1 = time.perf_counter()
            free1 = torch.cuda.mem_get_info()[0]
            comm.resume(gs)
            t2 = time.perf_counter()
            touch(gs)
            t3 = time.perf_counter()
            rows.append(
                {
                    "suspend_s": t1 - t0,
                    "resume_s": t2 - t1,
                    "first_collective_s": t3 - t2,
                    "freed_bytes": free1 - free0,
                }
            )
        return rows

    def best(rows: list[dict[str, float]]) -> dict[str, float]:
        return min(rows, key=lambda r: r["suspend_s"] + r["resume_s"] + r["first_collective_s"])

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", comm.CommFallbackWarning)
            for n in counts:
                gs = _groups(n, world)
                point: dict[str, Any] = {}
                if can_suspend:
                    stats = comm.memory_stats(gs)
                    point["suspendable_bytes"] = sum(v.suspendable_bytes or 0 for v in stats.values())
                    rows = cycles(gs, "suspend")
                    point.update(runs=rows, **best(rows))
                # rlmem's fallback: the communicators destroyed and rebuilt under the same group objects.
                rows = cycles(gs, "rebuild")
                b = best(rows)
                point.update(
                    rebuild_runs=rows,
                    rebuild_suspend_s=b["suspend_s"],
                    rebuild_resume_s=b["resume_s"],
                    rebuild_first_collective_s=b["first_collective_s"],
                    rebuild_freed_bytes=b["freed_bytes"],
                )
                # The alternative: destroy the groups and build them again (communicators included).
                dist.barrier(device_ids=[rank])
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for g in gs:
                    dist.destroy_process_group(g)
                t1 = time.perf_counter()
                gs = _groups(n, world)
                t2 = time.perf_counter()
                point.update(destroy_s=t1 - t0, recreate_s=t2 - t1)
                res["points"][str(n)] = point
                for g in gs:
                    dist.destroy_process_group(g)
    finally:
        with open(f"{out}.rank{rank}.json", "w") as f:
            json.dump(res, f)
        dist.destroy_process_group()


def summarize(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """At the largest count: rlmem's default path (NCCL's suspend where the loaded NCCL has it, else the
    rebuild fallback) against destroy + re-create; the fallback's own figures beside it. Slowest rank."""
    pts = ranks[0].get("points", {})
    if not pts:
        return {}
    n = max(pts, key=int)
    p = [r["points"][n] for r in ranks]
    recreate = max(q["destroy_s"] + q["recreate_s"] for q in p)
    # Until the groups are usable again: suspend + resume + their first collective (where a rebuilt
    # communicator connects, as a re-created one does inside new_group + its first all-reduce).
    rebuild = max(q["rebuild_suspend_s"] + q["rebuild_resume_s"] + q["rebuild_first_collective_s"] for q in p)
    out: dict[str, Any] = {"groups": int(n), "recreate_s": recreate, "rebuild_suspend_resume_s": rebuild}
    out["rebuild_speedup_vs_recreate"] = recreate / rebuild
    if ranks[0].get("can_suspend"):
        sr = max(q["suspend_s"] + q["resume_s"] + q["first_collective_s"] for q in p)
        out["method"] = "suspend"
        out["suspend_resume_s"] = sr
        out["freed_fraction"] = min(q["freed_bytes"] / max(q["suspendable_bytes"], 1) for q in p)
        out["rebuild_freed_fraction"] = min(
            q["rebuild_freed_bytes"] / max(q["suspendable_bytes"], 1) for q in p
        )
        out["speedup_vs_recreate"] = recreate / sr
    else:
        # No NCCL figure of what is suspendable: freed_fraction cannot be formed.
        out["method"] = "rebuild"
        out["suspend_resume_s"] = rebuild
        out["speedup_vs_recreate"] = recreate / rebuild
    return out


def main(argv: list[str] | None = None) -> int:
    from ._common import format_table
    from ._harness import Run

    run_ = Run(NAME, __doc__.splitlines()[0], TARGETS)
    run_.parser.add_argument("--counts", default="1,4,8")
    run_.parser.add_argument("--reps", type=int, default=5)
    args = run_.parse(argv)
    if not run_.needs_cuda(2):
        return 2
    import torch.multiprocessing as mp

    counts = [int(c) for c in args.counts.split(",")]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "comm")
        world = torch.cuda.device_count()
        mp.spawn(_worker, args=(world, counts, args.reps, port, out), nprocs=world, join=True)
        ranks = []
        for r in range(world):
            with open(f"{out}.rank{r}.json") as f:
                ranks.append(json.load(f))
    rows = []
    nan = float("nan")
    for n, v in ranks[0]["points"].items():
        rows.append(
            {
                "n": n,
                "susp": v.get("suspend_s", nan) * 1e3,
                "res": (v.get("resume_s", nan) + v.get("first_collective_s", nan)) * 1e3,
                "mib": v.get("suspendable_bytes", nan) / MiB,
                "freed": v.get("freed_bytes", nan) / MiB,
                "rsusp": v["rebuild_suspend_s"] * 1e3,
                "rres": (v["rebuild_resume_s"] + v["rebuild_first_collective_s"]) * 1e3,
                "rfreed": v["rebuild_freed_bytes"] / MiB,
                "rec": (v["destroy_s"] + v["recreate_s"]) * 1e3,
            }
        )
    cols = [
        ("n", "groups", "s"),
        ("susp", "suspend ms", ".1f"),
        ("res", "resume+1st coll ms", ".1f"),
        ("mib", "suspendable MiB", ".1f"),
        ("freed", "freed MiB", ".1f"),
        ("rsusp", "rebuild: destroy ms", ".1f"),
        ("rres", "rebuild+1st coll ms", ".1f"),
        ("rfreed", "rebuild freed MiB", ".1f"),
        ("rec", "destroy+recreate ms", ".1f"),
    ]
    print(f"rank 0, {ranks[0]['nccl']}")
    print(format_table(rows, cols))
    run_.finish(summarize(ranks), name_key="benchmark", nccl=ranks[0]["nccl"], ranks=ranks)
    return 0
