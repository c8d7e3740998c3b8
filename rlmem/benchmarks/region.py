"""Benchmark of Region pause/resume against the link's ceiling and against naive copies.

For each size, in one run: a raw pinned ``copy_`` of the same bytes each way (the link's ceiling), a naive
``.to("cpu")`` / ``.to(device)``, then a Region holding random bytes: its first kept pause (which allocates
the pinned backup), steady kept pause/resume cycles (contents checked bit for bit), and discard
pause+resume cycles (back to back, and a resume after the memory sat released for 0.5 s). On CPU the same
runs with the host backend; the "pinned" ceiling is then a plain memory copy into a pre-allocated buffer.
"""

from __future__ import annotations

import gc
import resource
import sys
import time
from functools import partial
from typing import Any

import torch

from .._units import GiB as _GiB
from ..memory.region import Region
from ._common import (
    check_targets,
    format_table,
    median,
    sync,
    targets_text,
    timed,
)
from ._harness import Run

NAME = "region"
TARGETS = {
    "pause_vs_pinned": (">=", 0.90),
    "resume_vs_pinned": (">=", 0.90),
    "discard_cycle_ms_16GiB": ("<", 20.0),
}


def _in_use(device: torch.device, region: Region) -> int:
    """Memory in use where the Region lives: device memory on CUDA; on the host, the process RSS less the
    Region's backup (which a kept pause populates as it releases the Region's pages)."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return total - free
    with open("/proc/self/statm") as f:
        rss = int(f.read().split()[1]) * resource.getpagesize()
    return rss - region.backup_bytes


def _random_bytes(n: int, device: torch.device) -> torch.Tensor:
    g = torch.Generator(device=device).manual_seed(n)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, device=device, generator=g)


def _ceiling(src: torch.Tensor, device: torch.device, reps: int) -> dict[str, float]:
    n = src.numel()
    host = torch.empty(n, dtype=torch.uint8, pin_memory=device.type == "cuda")
    out, back = [], []
    for _ in range(reps):
        out.append(timed(partial(host.copy_, src, non_blocking=True), device))
        back.append(timed(partial(src.copy_, host, non_blocking=True), device))
    return {"pinned_d2h_gbps": n / median(out) / 1e9, "pinned_h2d_gbps": n / median(back) / 1e9}


def _naive(src: torch.Tensor, device: torch.device) -> dict[str, float]:
    n = src.numel()
    holder: dict[str, torch.Tensor] = {}
    if device.type == "cuda":
        t_out = timed(lambda: holder.__setitem__("cpu", src.to("cpu")), device)
        t_in = timed(lambda: holder.__setitem__("dev", holder["cpu"].to(device)), device)
    else:
        t_out = timed(lambda: holder.__setitem__("cpu", src.clone()), device)
        t_in = timed(lambda: holder.__setitem__("dev", holder["cpu"].clone()), device)
    holder.clear()
    return {"naive_out_gbps": n / t_out / 1e9, "naive_in_gbps": n / t_in / 1e9}


def _region_cycles(
    src: torch.Tensor,
    device: torch.device,
    cycles: int,
    discard_cycles: int,
    chunk_bytes: int | None,
    gap_s: float = 0.5,
) -> dict[str, Any]:
    n = src.numel()
    region = Region(n, device, chunk_bytes=chunk_bytes, name=f"bench-{n}")
    try:
        x = region.empty(n, torch.uint8)
        x.copy_(src)
        sync(device)
        ptr = x.data_ptr()
        in_use = _in_use(device, region)
        first_pause = timed(region.pause, device)
        freed = in_use - _in_use(device, region)
        first_resume = timed(region.resume, device)
        intact = bool(torch.equal(x, src))
        pauses, resumes = [], []
        for _ in range(cycles):
            pauses.append(timed(region.pause, device))
            resumes.append(timed(region.resume, device))
        intact = intact and bool(torch.equal(x, src)) and x.data_ptr() == ptr
        stats = region.stats()
        discards, d_pause, d_resume = [], [], []
        for _ in range(discard_cycles):
            sync(device)
            a = timed(lambda: region.pause(keep=False), device)
            b = timed(region.resume, device)
            d_pause.append(a)
            d_resume.append(b)
            discards.append(a + b)
        # As in real use, where rollout runs between the two: the driver's physical allocation is slower
        # once released memory has gone back to it (bench/results/vmm_calls-*.json).
        region.pause(keep=False)
        time.sleep(gap_s)
        gap_resume = timed(region.resume, device)
        return {
            "chunk_bytes": region.chunk_bytes,
            "first_pause_s": first_pause,
            "first_resume_s": first_resume,
            "pause_s": median(pauses),
            "resume_s": median(resumes),
            "pause_gbps": n / median(pauses) / 1e9,
            "resume_gbps": n / median(resumes) / 1e9,
            "stats_pause_gbps": stats.last_pause_gbps,
            "stats_resume_gbps": stats.last_resume_gbps,
            "freed_fraction": freed / region.nbytes,
            "discard_pause_ms": median(d_pause) * 1e3,
            "discard_resume_ms": median(d_resume) * 1e3,
            "discard_cycle_ms": median(discards) * 1e3,
            "discard_resume_after_gap_ms": gap_resume * 1e3,
            "intact": intact,
        }
    finally:
        region.close()


def run(
    sizes_gib: list[float],
    device: torch.device,
    *,
    cycles: int = 3,
    discard_cycles: int = 5,
    chunk_bytes: int | None = None,
    chunk_sweep: list[int] | None = None,
) -> dict[str, Any]:
    """Measure every figure for each size; returns the JSON payload (without writing it)."""
    rows: list[dict[str, Any]] = []
    # Warm-up: one throwaway cycle first, so that one-time costs of the process (PyTorch's copy threads,
    # ~1 MiB of host RSS the first time a large copy runs) are not counted against the first Region measured.
    _region_cycles(
        _random_bytes(1 << 20, device), device, cycles=1, discard_cycles=1, chunk_bytes=None, gap_s=0
    )
    for size in sizes_gib:
        n = int(size * _GiB)
        src = _random_bytes(n, device)
        row: dict[str, Any] = {"size_gib": size, "bytes": n}
        row.update(_ceiling(src, device, reps=3))
        row.update(_naive(src, device))
        gc.collect()
        if device.type == "cuda":
            # The naive baseline leaves its result in PyTorch's cache; it is this benchmark's leftover, not
            # load the Region should be measured under.
            torch.cuda.empty_cache()
            free, total = torch.cuda.mem_get_info(device)
            row["device_in_use_gib"] = (total - free) / _GiB  # before the Region: src and the context
        row.update(_region_cycles(src, device, cycles, discard_cycles, chunk_bytes))
        row["pause_vs_pinned"] = row["pause_gbps"] / row["pinned_d2h_gbps"]
        row["resume_vs_pinned"] = row["resume_gbps"] / row["pinned_h2d_gbps"]
        row["pause_vs_naive"] = row["pause_gbps"] / row["naive_out_gbps"]
        row["resume_vs_naive"] = row["resume_gbps"] / row["naive_in_gbps"]
        rows.append(row)
        del src
        gc.collect()
        print(f"  {size:g} GiB done", file=sys.stderr, flush=True)
    sweep: list[dict[str, Any]] = []
    if chunk_sweep:
        n = int(sizes_gib[-1] * _GiB)
        src = _random_bytes(n, device)
        for cb in chunk_sweep:
            r = _region_cycles(src, device, cycles=2, discard_cycles=3, chunk_bytes=cb)
            r["size_gib"] = sizes_gib[-1]
            sweep.append(r)
        del src
    largest = rows[-1]
    summary: dict[str, Any] = {
        "size_gib": largest["size_gib"],
        "pause_vs_pinned": largest["pause_vs_pinned"],
        "resume_vs_pinned": largest["resume_vs_pinned"],
        "pause_gbps": largest["pause_gbps"],
        "resume_gbps": largest["resume_gbps"],
        "pinned_d2h_gbps": largest["pinned_d2h_gbps"],
        "pinned_h2d_gbps": largest["pinned_h2d_gbps"],
        "first_pause_s": largest["first_pause_s"],
        "freed_fraction": largest["freed_fraction"],
        "all_intact": all(r["intact"] for r in rows + sweep),
    }
    if any(r["size_gib"] == 16 for r in rows):
        summary["discard_cycle_ms_16GiB"] = next(r for r in rows if r["size_gib"] == 16)["discard_cycle_ms"]
    met = check_targets(summary, TARGETS)
    return {
        "name": NAME,
        "config": {
            "sizes_gib": sizes_gib,
            "cycles": cycles,
            "discard_cycles": discard_cycles,
            "chunk_bytes": chunk_bytes,
            "backend": device.type,
        },
        "rows": rows,
        "chunk_sweep": sweep,
        "summary": summary,
        "targets": targets_text(TARGETS),
        "targets_met": met,
    }


_COLUMNS = [
    ("size_gib", "GiB", "g"),
    ("pinned_d2h_gbps", "pinned D2H GB/s", ".1f"),
    ("pause_gbps", "pause GB/s", ".1f"),
    ("pause_vs_pinned", "pause/pinned", ".3f"),
    ("pinned_h2d_gbps", "pinned H2D GB/s", ".1f"),
    ("resume_gbps", "resume GB/s", ".1f"),
    ("resume_vs_pinned", "resume/pinned", ".3f"),
    ("naive_out_gbps", "naive out GB/s", ".2f"),
    ("naive_in_gbps", "naive in GB/s", ".2f"),
    ("first_pause_s", "1st pause s", ".3f"),
    ("discard_cycle_ms", "discard cycle ms", ".2f"),
    ("discard_resume_after_gap_ms", "resume after 0.5 s ms", ".2f"),
    ("freed_fraction", "freed", ".4f"),
    ("intact", "intact", ""),
]


def main(argv: list[str] | None = None) -> int:
    run_ = Run(NAME, __doc__.splitlines()[0], TARGETS)
    p = run_.parser
    p.add_argument(
        "--sizes", default=None, help="comma-separated GiB (default: 1,4,16 on CUDA; 0.0625,0.25,1 on CPU)"
    )
    p.add_argument("--cycles", type=int, default=3, help="kept pause/resume cycles timed per size")
    p.add_argument("--discard-cycles", type=int, default=5, help="discard cycles timed per size")
    p.add_argument("--chunk-mib", type=int, default=None, help="Region chunk size in MiB (default: Region's)")
    p.add_argument(
        "--chunk-sweep", default=None, help="comma-separated chunk MiB to compare at the largest size"
    )
    args = run_.parse(argv)
    device = run_.device
    default_sizes = "1,4,16" if device.type == "cuda" else "0.0625,0.25,1"
    try:
        sizes = [float(s) for s in (args.sizes or default_sizes).split(",")]
        sweep = [int(s) << 20 for s in args.chunk_sweep.split(",")] if args.chunk_sweep else None
    except ValueError:
        run_.error("--sizes and --chunk-sweep take comma-separated numbers")
    if any(s <= 0 for s in sizes) or args.cycles < 1 or args.discard_cycles < 1:
        run_.error("--sizes must be positive and --cycles / --discard-cycles at least 1")
    print(f"rlmem bench region on {run_.machine} ({device}), sizes {sizes} GiB", file=sys.stderr, flush=True)
    result = run(
        sizes,
        device,
        cycles=args.cycles,
        discard_cycles=args.discard_cycles,
        chunk_bytes=args.chunk_mib << 20 if args.chunk_mib else None,
        chunk_sweep=sweep,
    )
    print(format_table(result["rows"], _COLUMNS))
    if result["chunk_sweep"]:
        print("\nchunk size at the largest size:")
        print(
            format_table(
                [{**r, "chunk_mib": r["chunk_bytes"] >> 20} for r in result["chunk_sweep"]],
                [
                    ("chunk_mib", "chunk MiB", "d"),
                    ("pause_gbps", "pause GB/s", ".1f"),
                    ("resume_gbps", "resume GB/s", ".1f"),
                    ("discard_cycle_ms", "discard cycle ms", ".2f"),
                ],
            )
        )
    print()
    run_.finish(
        result["summary"],
        met=result["targets_met"],
        config=result["config"],
        rows=result["rows"],
        chunk_sweep=result["chunk_sweep"],
    )
    return 0 if result["summary"]["all_intact"] else 1
