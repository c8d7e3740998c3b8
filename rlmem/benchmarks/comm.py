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

``--variants`` repeats the suspend/resume part under NCCL settings that change what a communicator
allocates (``VARIANTS``: buffer size, channel count, P2P, lazy connection; none switches NVLink SHARP on),
each in fresh processes, with a 256 MiB all-reduce's bus bandwidth beside it (what the setting costs).
``--phase-gib G`` measures what a ``PhaseManager`` switch does not hide of the communicators: a train state of
G GiB per rank (fp32 parameters + Adam), a rollout/train cycle with ``comms="keep"`` and with
``comms="suspend"`` over the 8 groups, until the groups' first collective in train has run; the difference
is ``exposed_comm_s`` (target < 0.2 s).
``--libs NAME=PATH,...`` adds a variant per libnccl, loaded through ``LD_PRELOAD`` in the spawned ranks
(``NCCL_MEM_KEEP_BACKUP=1`` set for them, which only rlmem's patched NCCL reads), with the PhaseManager part
too: stock and patched builds of one NCCL tag side by side.
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
TARGETS = {
    "suspend_resume_s": ("<", 1.0),
    "freed_fraction": (">=", 0.9),
    "speedup_vs_recreate": (">=", 5.0),
    "exposed_comm_s": ("<", 0.2),
}
# NCCL settings that change how many buffers a communicator holds and how large they are (environment,
# read when each process first initialises NCCL).
VARIANTS: dict[str, dict[str, str]] = {
    "default": {},
    "buff1m": {"NCCL_BUFFSIZE": str(1 << 20)},
    "ctas4": {"NCCL_MIN_CTAS": "1", "NCCL_MAX_CTAS": "4"},
    "p2p0": {"NCCL_P2P_DISABLE": "1"},
    "connect0": {"NCCL_RUNTIME_CONNECT": "0"},
}
VARIANTS["lean"] = {**VARIANTS["buff1m"], **VARIANTS["ctas4"]}


def _groups(n: int, world: int) -> list[Any]:
    import torch.distributed as dist

    gs = [dist.new_group(list(range(world))) for _ in range(n)]
    for g in gs:
        t = torch.ones(1 << 20, device="cuda")
        dist.all_reduce(t, group=g)
    torch.cuda.synchronize()
    return gs


def _busbw(world: int, nbytes: int = 256 << 20) -> float:
    """All-reduce bus bandwidth over the world group, bytes/s (NCCL's definition: 2(n-1)/n of the size per
    second), best of 5 after one warm-up."""
    import torch.distributed as dist

    t = torch.ones(nbytes // 2, dtype=torch.bfloat16, device="cuda")
    dist.all_reduce(t)
    best = float("inf")
    for _ in range(5):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dist.all_reduce(t)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return nbytes * 2 * (world - 1) / world / best


def _phase(gib: float, gs: list[Any], rank: int, reps: int) -> dict[str, Any]:
    """One rank's rollout/train cycle with comms kept and with them suspended: seconds until the train phase's
    first collective on every group has run (the reload of the state included)."""
    import torch.distributed as dist

    from ..train.phases import OffloadConfig, PhaseManager

    n = max(1, round(gib * (1 << 30) / (3 * 4 * 4096 * 4096)))  # fp32 weight + 2 Adam moments per layer
    out: dict[str, Any] = {"state_bytes": 3 * 4 * 4096 * 4096 * n}
    for comms in ("keep", "suspend"):
        # A model of its own per mode: a PhaseManager adopts the state it is given.
        model = torch.nn.Sequential(*[torch.nn.Linear(4096, 4096, bias=False) for _ in range(n)]).cuda()
        opt = torch.optim.Adam(model.parameters(), lr=1e-4)
        model(torch.ones(8, 4096, device="cuda")).sum().backward()
        opt.step()
        pm = PhaseManager(model, opt, OffloadConfig(offload_during_rollout=True, comms=comms), comm_groups=gs)
        rows = []
        for _ in range(reps + 1):
            dist.barrier(device_ids=[rank])
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            with pm.rollout():
                pass
            t1 = time.perf_counter()
            with pm.train():
                for g in gs:
                    dist.all_reduce(torch.ones(1, device="cuda"), group=g)
                opt.step()  # waits for the optimizer states
                torch.cuda.synchronize()
            t2 = time.perf_counter()
            rows.append({"rollout_s": t1 - t0, "train_s": t2 - t1})
        rows = rows[1:]  # the first cycle adopts the state and allocates the backups
        out[comms] = {"runs": rows, **min(rows, key=lambda r: r["rollout_s"] + r["train_s"])}
        assert pm.state is not None
        pm.state.close()
        del pm, model, opt
        torch.cuda.empty_cache()
    keep, susp = out["keep"], out["suspend"]
    out["exposed_rollout_s"] = susp["rollout_s"] - keep["rollout_s"]
    out["exposed_train_s"] = susp["train_s"] - keep["train_s"]
    out["exposed_comm_s"] = out["exposed_rollout_s"] + out["exposed_train_s"]
    return out


def _worker(
    rank: int,
    world: int,
    counts: list[int],
    reps: int,
    port: int,
    out: str,
    env: dict[str, str],
    rebuild: bool,
    phase_gib: float,
) -> None:
    import torch.distributed as dist

    from .. import comm

    os.environ.update(env)  # before this process first initialises NCCL, which reads them once
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
    drv = comm.nccl_driver()
    can_suspend = drv.can_suspend
    res: dict[str, Any] = {"nccl": drv.describe, "can_suspend": can_suspend, "env": env, "points": {}}

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
            res["busbw_bytes_per_s"] = _busbw(world)
            for n in counts:
                gs = _groups(n, world)
                point: dict[str, Any] = {}
                if can_suspend:
                    stats = comm.memory_stats(gs)
                    point["suspendable_bytes"] = sum(v.suspendable_bytes or 0 for v in stats.values())
                    point["persistent_bytes"] = sum(v.persistent_bytes or 0 for v in stats.values())
                    rows = cycles(gs, "suspend")
                    point.update(runs=rows, **best(rows))
                if phase_gib and n == max(counts):
                    res["phase"] = _phase(phase_gib, gs, rank, reps)
                if not rebuild:
                    res["points"][str(n)] = point
                    for g in gs:
                        dist.destroy_process_group(g)
                    continue
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


def summarize(
    ranks: list[dict[str, Any]], variants: dict[str, list[dict[str, Any]]] | None = None
) -> dict[str, Any]:
    """At the largest count: rlmem's default path (NCCL's suspend where the loaded NCCL has it, else the
    rebuild fallback) against destroy + re-create; the fallback's own figures beside it; per variant of the
    NCCL settings, its suspend + resume, bytes and bandwidth; the PhaseManager's exposed comm time. Slowest
    rank throughout."""
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
    if all("phase" in r for r in ranks):
        out["exposed_comm_s"] = max(r["phase"]["exposed_comm_s"] for r in ranks)
        out["phase_state_bytes"] = ranks[0]["phase"]["state_bytes"]
    rows = {}
    for name, vr in (variants or {}).items():
        vp = [r["points"][n] for r in vr if n in r.get("points", {})]
        if len(vp) != len(vr) or not vp or "suspend_s" not in vp[0]:
            continue
        v_sr = max(q["suspend_s"] + q["resume_s"] + q["first_collective_s"] for q in vp)
        rows[name] = {
            "suspend_s": max(q["suspend_s"] for q in vp),
            "resume_s": max(q["resume_s"] + q["first_collective_s"] for q in vp),
            "suspend_resume_s": v_sr,
            "speedup_vs_recreate": recreate / v_sr,
            "suspendable_bytes_per_group": vp[0]["suspendable_bytes"] / int(n),
            "freed_fraction": min(q["freed_bytes"] / max(q["suspendable_bytes"], 1) for q in vp),
            "busbw_gb_per_s": min(r["busbw_bytes_per_s"] for r in vr) / 1e9,
        }
        if all("phase" in r for r in vr):
            rows[name]["exposed_comm_s"] = max(r["phase"]["exposed_comm_s"] for r in vr)
    if rows:
        out["variants"] = rows
    return out


def _spawn(
    world: int, counts: list[int], reps: int, env: dict[str, str], rebuild: bool, phase_gib: float
) -> list[dict[str, Any]]:
    """The ranks' results of one spawn of ``_worker`` per GPU, under ``env`` (an ``LD_PRELOAD`` in it set
    before the ranks start, which inherit this process's environment, and restored after)."""
    preload = env.get("LD_PRELOAD")
    saved = os.environ.get("LD_PRELOAD")
    if preload is not None:
        os.environ["LD_PRELOAD"] = preload
    try:
        return _spawn_ranks(world, counts, reps, env, rebuild, phase_gib)
    finally:
        if preload is not None:
            if saved is None:
                os.environ.pop("LD_PRELOAD", None)
            else:
                os.environ["LD_PRELOAD"] = saved


def _spawn_ranks(
    world: int, counts: list[int], reps: int, env: dict[str, str], rebuild: bool, phase_gib: float
) -> list[dict[str, Any]]:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "comm")
        for attempt in range(3):
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            try:
                args = (world, counts, reps, port, out, env, rebuild, phase_gib)
                mp.spawn(_worker, args=args, nprocs=world)
                break
            except mp.ProcessRaisedException as e:
                # The free port found above can be taken before rank 0 listens on it: try another.
                if "EADDRINUSE" not in str(e) or attempt == 2:
                    raise
        ranks = []
        for r in range(world):
            with open(f"{out}.rank{r}.json") as f:
                ranks.append(json.load(f))
    return ranks


def main(argv: list[str] | None = None) -> int:
    from ._common import format_table
    from ._harness import Run

    run_ = Run(NAME, __doc__.splitlines()[0], TARGETS)
    run_.parser.add_argument("--counts", default="1,4,8")
    run_.parser.add_argument("--reps", type=int, default=5)
    run_.parser.add_argument(
        "--variants",
        default="default",
        help="comma-separated names of NCCL settings to measure suspend/resume under, the first with the "
        f"rebuild and re-create comparison too: {', '.join(VARIANTS)}",
    )
    run_.parser.add_argument("--phase-gib", type=float, default=4.0, help="train state per rank; 0: skip")
    run_.parser.add_argument(
        "--libs", default="", help="NAME=PATH,...: a variant per libnccl (LD_PRELOAD in the ranks)"
    )
    args = run_.parse(argv)
    names = [v for v in args.variants.split(",") if v]
    bad = [v for v in names if v not in VARIANTS]
    if bad or not names:
        run_.error(f"--variants: unknown {bad}; choose from {', '.join(VARIANTS)}")
    libs: dict[str, dict[str, str]] = {}
    for item in (x for x in args.libs.split(",") if x):
        lib_name, sep, path = item.partition("=")
        if not sep or not lib_name or not os.path.isfile(path):
            run_.error(f"--libs: {item!r} is not NAME=PATH of an existing libnccl")
        libs[f"lib:{lib_name}"] = {"LD_PRELOAD": path, "NCCL_MEM_KEEP_BACKUP": "1"}
    if not run_.needs_cuda(2):
        return 2
    counts = [int(c) for c in args.counts.split(",")]
    world = torch.cuda.device_count()
    t0 = time.perf_counter()

    def spawn(name: str, *a: Any) -> list[dict[str, Any]]:
        # A line per spawn as it goes: a run cut short by its caller's time limit still says how far it got.
        print(f"{name}: {world} ranks, groups {a[0]} ...", flush=True)
        out = _spawn(world, *a)
        print(f"{name}: done at {time.perf_counter() - t0:.0f} s", flush=True)
        return out

    ranks = spawn(names[0], counts, args.reps, VARIANTS[names[0]], True, args.phase_gib)
    variants = {names[0]: ranks}
    for name in names[1:]:
        variants[name] = spawn(name, [max(counts)], max(2, args.reps // 2), VARIANTS[name], False, 0.0)
    for name, env in libs.items():
        variants[name] = spawn(name, [max(counts)], max(2, args.reps // 2), env, False, args.phase_gib)
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
    print(f"rank 0, {ranks[0]['nccl']}, variant {names[0]}")
    print(format_table(rows, cols))
    summary = summarize(ranks, variants)
    if summary.get("variants"):
        vrows = [
            {
                "v": name,
                "susp": f["suspend_s"] * 1e3,
                "res": f["resume_s"] * 1e3,
                "mib": f["suspendable_bytes_per_group"] / MiB,
                "bw": f["busbw_gb_per_s"],
            }
            for name, f in summary["variants"].items()
        ]
        vcols = [
            ("v", f"variant ({summary['groups']} groups)", "s"),
            ("susp", "suspend ms", ".1f"),
            ("res", "resume+1st coll ms", ".1f"),
            ("mib", "MiB per group", ".1f"),
            ("bw", "all-reduce busbw GB/s", ".1f"),
        ]
        print(format_table(vrows, vcols))
    if "exposed_comm_s" in summary:
        ph = ranks[0]["phase"]
        print(
            f"PhaseManager, {ph['state_bytes'] / (1 << 30):.1f} GiB state per rank: switch+reload keep "
            f"{(ph['keep']['rollout_s'] + ph['keep']['train_s']) * 1e3:.0f} ms, suspend "
            f"{(ph['suspend']['rollout_s'] + ph['suspend']['train_s']) * 1e3:.0f} ms; exposed "
            f"{summary['exposed_comm_s'] * 1e3:.0f} ms (slowest rank)"
        )
    envs = {**VARIANTS, **libs}
    extra = {name: {"env": envs[name], "ranks": vr} for name, vr in variants.items() if name != names[0]}
    run_.finish(
        summary, name_key="benchmark", nccl=ranks[0]["nccl"], variant=names[0], ranks=ranks, variants=extra
    )
    return 0
