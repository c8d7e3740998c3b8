"""Megatron-Core on two and four ranks under ``rlmem.TrainState``, with and without offloading every step.

Layouts: tensor parallel (``tp2``, ``tp2-sp`` with sequence parallelism, ``tp4``), two pipeline stages
(``pp2``), data parallel (``dp2``), tensor x pipeline parallel (``tp2pp2``, and ``tp2pp2-vpp`` with two model
chunks per stage under Megatron's interleaved schedule), each a part under torchrun with ``tp * pp * dp``
ranks, one per device.

Each rank builds a ``GPTModel`` (local layer spec) in Megatron's ``DistributedDataParallel`` twice from one
seed: a reference trainer that never offloads, and one whose state (DDP parameter and gradient buffers,
main parameters, optimizer states) leaves the device after every step and comes back
(``params="offload", grads="discard", optimizer="offload"``). On a GPU: bf16 (``Float16Module``) with
Megatron's distributed optimizer; the layouts that fit the GPUs run (two-rank ones on two, all on four).
On the CPU (Gloo, the host backend; what CI runs, tiny): fp32, with a stand-in of the mixed-precision
optimizer's structure (fp32 main-parameter clones under AdamW, as Megatron's optimizers hard-code CUDA),
Megatron's device and CUDA RNG fork redirected to the host (sequence parallelism through Gloo's
reduce-scatter); the two-rank layouts by default, the four-rank ones as four processes when named, the
layouts of one world size in one launch.

Per rank and step: the bytes the offload freed (``cudaMemGetInfo``; on the CPU what stays resident) over
what the state holds, the offload's and the reload's rate over the pinned copy rates measured on that rank
in the same run, reads of the weights and main parameters while away, and, for ``tp2`` and ``tp2-sp``, one
step's gradients with every Megatron activation name offloaded against without. The pinned copy rates are
measured twice: on each rank alone (the reference of the targets) and with every rank copying at once after
a barrier (``link_together_bytes_per_s``: the rate each rank gets while the others use the host's memory and
PCIe too, as they do when every rank offloads after the same step). With ``--comms suspend`` (GPUs, an NCCL
with ``ncclCommSuspend``) every NCCL group of the process (Megatron's tensor, pipeline and data parallel
groups, created eagerly) is suspended after each offload, as ``PhaseManager(comms="suspend")`` does, and
resumed before the reload; the next step runs on them, so the bit-identity covers it. Summary:
``<layout>_bit_identical`` (losses, weights and main parameters equal the reference's bit for bit on every
rank; ``tp2_bit_identical``, ``tp2_sp_bit_identical``, ``pp2_bit_identical``, ``tp2pp2_bit_identical``,
``tp2pp2_vpp_bit_identical``, ``tp4_bit_identical``; for ``dp2`` ``dp2_distopt_bit_identical``, or
``dp2_bit_identical`` on the CPU, without the distributed optimizer), ``freed_fraction_min``,
``offload_vs_pinned_min``, ``reload_vs_pinned_min`` (every rank of every layout, every step after the
first), ``act_grads_bit_equal`` (over ``act_grads_layouts``), ``offload_vs_together_min`` and
``reload_vs_together_min`` (over the rates with every rank copying at once; no target), and with
``--comms suspend`` ``comm_freed_bytes_min`` (the least any rank's groups freed at a suspend) and
``comm_groups`` (how many groups a rank suspended).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

import torch

from ..integrations.megatron import main_params
from ._common import format_table, link_rates, spawn_part
from ._harness import Run
from ._megatron_layouts import LAYOUTS, Trainer, bits, parameters, shape_error

NAME = "megatron_parallel"
TARGETS = {
    "tp2_bit_identical": ("==", True),
    "pp2_bit_identical": ("==", True),
    "dp2_distopt_bit_identical": ("==", True),
    "tp2_sp_bit_identical": ("==", True),
    "tp2pp2_bit_identical": ("==", True),
    "tp2pp2_vpp_bit_identical": ("==", True),
    "tp4_bit_identical": ("==", True),
    "freed_fraction_min": (">=", 0.99),
    "offload_vs_pinned_min": (">=", 0.9),
    "reload_vs_pinned_min": (">=", 0.9),
    "act_grads_bit_equal": ("==", True),
}
GPU_SHAPE = {"layers": 8, "hidden": 2048, "heads": 16, "vocab": 32000, "seq": 512, "batch": 2}
CPU_SHAPE = {"layers": 2, "hidden": 64, "heads": 4, "vocab": 128, "seq": 16, "batch": 2}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_part(
    layouts: list[str], shape: dict[str, int], steps: int, device: torch.device, comms: str = "keep"
) -> dict[str, Any] | None:
    """``layouts`` on this rank (under torchrun), one after another in one process group; every rank's
    figures on the lead (``{layout: result}``), None elsewhere."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    else:
        # Megatron's DDP makes its buffers on torch.cuda.current_device(): here, the host (this part is a
        # process of its own).
        torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    if comms == "suspend":
        # Every group gets its communicators now (split from the world's), as NCCL's suspend needs one to
        # exist: Megatron makes groups it may never use in a layout.
        dist.init_process_group("nccl", device_id=device)
    else:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    out = {}
    for layout in layouts:
        out[layout] = _run_layout(layout, shape, steps, device, comms)
        ps.destroy_model_parallel()
    dist.barrier()
    lead = dist.get_rank() == 0
    dist.destroy_process_group()
    return out if lead else None


def _run_layout(
    layout: str, shape: dict[str, int], steps: int, device: torch.device, comms: str = "keep"
) -> dict[str, Any]:
    """One layout on this rank: its figures and every other rank's."""
    import torch.distributed as dist

    from .. import TrainState, comm

    tr = Trainer(layout, shape, device)
    link = link_rates(device, 256 << 20) if device.type == "cuda" else None
    # the same, every rank starting each copy together: what each gets while the others copy too
    together = link_rates(device, 256 << 20, dist.barrier) if device.type == "cuda" else None
    act = tr.activations() if layout in ("tp2", "tp2-sp") else None  # tensor parallel, with SP and without
    ref, ref_opt = tr.build(0)
    ref_losses = [tr.step(ref, ref_opt) for _ in range(steps)]
    ddp, opt = tr.build(0)
    st = TrainState(ddp, opt)
    losses, cycles = [], []
    for _ in range(steps):
        losses.append(tr.step(ddp, opt))
        # what the state holds now (the optimizer's states exist from its first step on)
        held = sum(c.bytes for c in st.stats().categories.values())
        params = [q.detach().clone() for q in parameters(ddp)]
        main = [m.detach().clone() for m in main_params(opt)]
        _sync(device)
        free0 = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else 0
        t0 = time.perf_counter()
        st.offload(params="offload", grads="discard", optimizer="offload", blocking=True)
        _sync(device)
        t_off = time.perf_counter() - t0
        cats = st.stats().categories
        moved = sum(cats[c].bytes for c in ("params", "optimizer") if c in cats)
        if device.type == "cuda":
            freed = (torch.cuda.mem_get_info(device)[0] - free0) / held
        else:
            freed = 1 - sum(c.resident_bytes for c in cats.values()) / held
        cyc = {
            "freed_fraction": freed,
            "moved_bytes": moved,
            "offload_s": t_off,
            "params_read": all(torch.equal(a, b) for a, b in zip(parameters(ddp), params, strict=True)),
            "main_read": all(torch.equal(a, b) for a, b in zip(main_params(opt), main, strict=True)),
        }
        if comms == "suspend":  # after the offload and before the reload, as PhaseManager's switches do
            r = comm.suspend(None, method="suspend")
            cyc.update(comm_groups=len(r.groups), comm_freed_bytes=r.freed_bytes, comm_suspend_s=r.seconds)
            back = comm.resume(None)
            cyc.update(comm_taken_bytes=back.taken_bytes, comm_resume_s=back.seconds)
        t0 = time.perf_counter()
        st.reload(blocking=True)
        st.synchronize()
        _sync(device)
        cyc["reload_s"] = time.perf_counter() - t0
        if link is not None:
            cyc["offload_vs_pinned"] = moved / t_off / link[0]
            cyc["reload_vs_pinned"] = moved / cyc["reload_s"] / link[1]
        if together is not None:
            cyc["offload_vs_together"] = moved / t_off / together[0]
            cyc["reload_vs_together"] = moved / cyc["reload_s"] / together[1]
        cycles.append(cyc)
    pairs = zip(parameters(ref), parameters(ddp), strict=True)
    main_pairs = zip(main_params(ref_opt), main_params(opt), strict=True)
    mine = {
        "rank": tr.rank,
        "stage": tr.stage,
        "n_params": sum(q.numel() for q in parameters(ddp)),
        "held_bytes": held,
        "ref": ref_losses,
        "losses": losses,
        "same_params": all(torch.equal(bits(a), bits(b)) for a, b in pairs),
        "same_main": all(torch.equal(bits(a), bits(b)) for a, b in main_pairs),
        "cycles": cycles,
        "link_bytes_per_s": link,
        "link_together_bytes_per_s": together,
        "act_grads_equal": None if act is None else act[0],
        "act_offloaded_bytes": None if act is None else act[1],
    }
    st.close()
    every: list[Any] = [None] * tr.world
    dist.all_gather_object(every, mine)
    return {"layout": layout, "distopt": tr.cuda, "ranks": every}


def summarize(res: dict[str, Any]) -> dict[str, Any]:
    """Each layout's bit-identity (``<layout>_bit_identical``) and the least freed fraction and rates over
    every rank of every layout (the keys of a layout that failed are left out)."""
    s: dict[str, Any] = {}
    keys = {x: f"{x.replace('-', '_')}_bit_identical" for x in LAYOUTS}
    # Megatron's distributed optimizer on a GPU; on the CPU the stand-in (not distributed)
    keys["dp2"] = "dp2_distopt_bit_identical" if res.get("dp2", {}).get("distopt") else "dp2_bit_identical"
    steady: list[dict[str, Any]] = []
    for layout, r in res.items():
        ranks = r.get("ranks")
        if not ranks:
            continue
        ok = all(x["losses"] == x["ref"] and x["same_params"] and x["same_main"] for x in ranks)
        ok = ok and all(c["params_read"] and c["main_read"] for x in ranks for c in x["cycles"])
        s[keys[layout]] = ok
        steady += [c for x in ranks for c in x["cycles"][1:]]  # the first cycle makes the pinned backups
        act = [x["act_grads_equal"] for x in ranks if x["act_grads_equal"] is not None]
        if act:  # over every layout that measured it
            ok = all(act) and all(x["act_offloaded_bytes"] > 0 for x in ranks)
            s["act_grads_bit_equal"] = s.get("act_grads_bit_equal", True) and ok
            s.setdefault("act_grads_layouts", []).append(layout)
    if steady:
        s["freed_fraction_min"] = min(c["freed_fraction"] for c in steady)
        for k in ("offload_vs_pinned", "reload_vs_pinned", "offload_vs_together", "reload_vs_together"):
            if all(k in c for c in steady):
                s[f"{k}_min"] = min(c[k] for c in steady)
        if all("comm_freed_bytes" in c for c in steady):
            s["comm_freed_bytes_min"] = min(c["comm_freed_bytes"] for c in steady)
            s["comm_groups"] = max(c["comm_groups"] for c in steady)
    return s


def main(argv: list[str] | None = None) -> int:
    run_ = Run(NAME, __doc__.splitlines()[0], TARGETS)
    p = run_.parser
    p.add_argument(
        "--layouts",
        default=None,
        help=f"of {', '.join(LAYOUTS)} (default: those that fit the GPUs; CPU: the two-rank ones)",
    )
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--shape", default=None, help="layers,hidden,heads,vocab,seq,batch (default by device)")
    p.add_argument(
        "--part", default=None, help=argparse.SUPPRESS
    )  # layouts of one world size, comma-separated
    p.add_argument("--timeout", type=float, default=900.0, help="a layout's longest run (s)")
    p.add_argument(
        "--comms",
        default="keep",
        choices=("keep", "suspend"),
        help="suspend: every NCCL group suspended while the state is away (GPUs, NCCL >= 2.29.7)",
    )
    args = run_.parse(argv)
    cuda = run_.device.type == "cuda"
    shape = dict(GPU_SHAPE if cuda else CPU_SHAPE)
    if args.shape:
        vals = [int(v) for v in args.shape.split(",")]
        if len(vals) != len(shape):
            run_.error(f"--shape takes {len(shape)} ints: {','.join(shape)}")
        shape = dict(zip(shape, vals, strict=True))
    if args.part:
        out = run_part(args.part.split(","), shape, args.steps, run_.device, args.comms)
        if out is not None:
            print(json.dumps(out), flush=True)
        return 0
    # a rank per GPU: the layouts that fit this machine's; on the CPU (a process per rank) the two-rank ones
    have = torch.cuda.device_count() if cuda else 2
    default = [x for x, lay in LAYOUTS.items() if lay.world <= have and (cuda or lay.world == 2)]
    layouts = [x for x in (args.layouts or ",".join(default)).split(",") if x]
    bad = [x for x in layouts if x not in LAYOUTS]
    if bad:
        run_.error(f"--layouts: {bad[0]!r} is not one of {', '.join(LAYOUTS)}")
    if cuda and not run_.needs_cuda(max([2] + [LAYOUTS[x].world for x in layouts])):
        return 2
    for x in layouts:
        if err := shape_error(x, shape):
            run_.error(f"--shape: {err}")
    if args.comms == "suspend":
        if not cuda:
            run_.error("--comms suspend: NCCL's communicators exist on GPUs only (Gloo has none to suspend)")
        from ..comm import nccl_driver

        drv = nccl_driver()
        if not drv.can_suspend:
            run_.error(
                f"--comms suspend needs an NCCL with ncclCommSuspend (>= 2.29.7); torch loaded "
                f"{drv.describe} (load a newer libnccl with LD_PRELOAD, scripts/nccl_parts.sh)"
            )
    forward = ["--device", run_.device.type, "--steps", str(args.steps), "--comms", args.comms]
    forward += ["--shape", ",".join(str(v) for v in shape.values())]
    # a launch per layout on GPUs (its own CUDA context and communicators); on the CPU one per world size,
    # as importing Megatron in every process is most of a small part's time
    launches: list[list[str]] = []
    for x in layouts:
        if not cuda and launches and LAYOUTS[launches[-1][0]].world == LAYOUTS[x].world:
            launches[-1].append(x)
        else:
            launches.append([x])
    res = {}
    for group in launches:
        out = spawn_part(
            "rlmem.benchmarks.megatron_parallel",
            ",".join(group),
            forward,
            nproc=LAYOUTS[group[0]].world,
            timeout_s=args.timeout * len(group),
        )
        res.update({x: out.get(x, out) for x in group})  # an error: each layout of the launch
    rows = []
    for layout, r in res.items():
        for x in r.get("ranks", []):
            cyc = x["cycles"][1:] or x["cycles"]
            rows.append(
                {
                    "layout": layout,
                    "rank": x["rank"],
                    "stage": x["stage"],
                    "state": x["held_bytes"] / 2**20,
                    "same": x["losses"] == x["ref"] and x["same_params"] and x["same_main"],
                    "freed": min(c["freed_fraction"] for c in cyc),
                    "off": min((c.get("offload_vs_pinned") for c in cyc), default=None, key=_num),
                    "rel": min((c.get("reload_vs_pinned") for c in cyc), default=None, key=_num),
                }
            )
    cols = [("layout", "layout", "s"), ("rank", "rank", "d"), ("stage", "stage", "s")]
    cols += [("state", "state MiB", ".1f"), ("same", "bit-identical", "")]
    cols += [("freed", "freed", ".3f"), ("off", "offload/pinned", ".2f"), ("rel", "reload/pinned", ".2f")]
    print(format_table(rows, cols))
    failed = {k: v["error"] for k, v in res.items() if "error" in v}
    for k, v in failed.items():
        print(f"{k} failed:\n{v}", file=sys.stderr)
    config = {"shape": shape, "steps": args.steps, "layouts": layouts, "comms": args.comms}
    run_.finish(summarize(res), config=config, results=res)
    return 1 if failed else 0


def _num(v: float | None) -> float:
    return float("inf") if v is None else v


if __name__ == "__main__":
    raise SystemExit(main())
