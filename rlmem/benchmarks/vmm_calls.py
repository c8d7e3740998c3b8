"""Cost of the CUDA virtual-memory calls behind a discard pause+resume, by chunk size and call pattern.

A discard cycle of a Region is: per chunk cuMemUnmap + cuMemRelease (pause), then per chunk cuMemCreate +
cuMemMap + cuMemSetAccess (resume). This times each call kind separately over a range of SIZE GiB, for
several chunk sizes, with access set per chunk or once over the whole range, and with the resume started at
once or after a pause of the host (to see whether the driver's work on freed memory is on the path).
Writes bench/results/vmm_calls-<machine>.json: ``rlmem bench vmm_calls --machine nvidia-h100-x1``.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from ..memory._cuda import CudaBackend, call, context
from ._common import format_table, median
from ._harness import Run

NAME = "vmm_calls"


def cycle(backend, ptr, size, chunk, one_access, gap_s):
    idx = backend.index
    t = dict.fromkeys(("unmap", "release", "create", "map", "access"), 0.0)
    offsets = list(range(0, size, chunk))
    handles = {}
    with context(idx):
        for off in offsets:
            h = call("cuMemCreate", chunk, backend._prop, 0)
            call("cuMemMap", ptr + off, chunk, 0, h, 0)
            handles[off] = h
        call("cuMemSetAccess", ptr, size, backend._access, 1)
        torch.cuda.synchronize()
        # pause (discard)
        for off in offsets:
            a = time.perf_counter()
            call("cuMemUnmap", ptr + off, chunk)
            b = time.perf_counter()
            call("cuMemRelease", handles.pop(off))
            c = time.perf_counter()
            t["unmap"] += b - a
            t["release"] += c - b
        if gap_s:
            time.sleep(gap_s)
        # resume
        for off in offsets:
            a = time.perf_counter()
            h = call("cuMemCreate", chunk, backend._prop, 0)
            b = time.perf_counter()
            call("cuMemMap", ptr + off, chunk, 0, h, 0)
            c = time.perf_counter()
            handles[off] = h
            if not one_access:
                call("cuMemSetAccess", ptr + off, chunk, backend._access, 1)
            t["create"] += b - a
            t["map"] += c - b
            t["access"] += time.perf_counter() - c
        if one_access:
            a = time.perf_counter()
            call("cuMemSetAccess", ptr, size, backend._access, 1)
            t["access"] += time.perf_counter() - a
        for off in offsets:
            call("cuMemUnmap", ptr + off, chunk)
            call("cuMemRelease", handles.pop(off))
    return {k: v * 1e3 for k, v in t.items()}


def main(argv: list[str] | None = None) -> int:
    run_ = Run(NAME, __doc__.splitlines()[0])
    run_.parser.add_argument("--size-gib", type=int, default=16)
    run_.parser.add_argument("--chunks-mib", default="64,256,1024,2048")
    run_.parser.add_argument("--cycles", type=int, default=5)
    args = run_.parse(argv)
    if not run_.needs_cuda():
        return 2
    dev = run_.device
    backend = CudaBackend(dev.index)
    size = args.size_gib << 30
    with context(dev.index):
        ptr = int(call("cuMemAddressReserve", size, 2 << 20, 0, 0))
    rows = []
    try:
        for chunk_mib in [int(c) for c in args.chunks_mib.split(",")]:
            for one_access in (False, True):
                for gap_s in (0.0, 0.2):
                    runs = [
                        cycle(backend, ptr, size, chunk_mib << 20, one_access, gap_s)
                        for _ in range(args.cycles)
                    ]
                    row = {
                        "chunk_mib": chunk_mib,
                        "access": "once" if one_access else "per chunk",
                        "gap_s": gap_s,
                    }
                    for k in runs[0]:
                        row[k + "_ms"] = median([r[k] for r in runs])
                    row["pause_ms"] = row["unmap_ms"] + row["release_ms"]
                    row["resume_ms"] = row["create_ms"] + row["map_ms"] + row["access_ms"]
                    row["cycle_ms"] = row["pause_ms"] + row["resume_ms"]
                    rows.append(row)
    finally:
        with context(dev.index):
            call("cuMemAddressFree", ptr, size)
    cols = [("chunk_mib", "chunk MiB", "d"), ("access", "access", ""), ("gap_s", "gap s", "g")]
    cols += [(k, k.replace("_ms", " ms"), ".2f") for k in rows[0] if k.endswith("_ms")]
    print(format_table(rows, cols))
    best = min(rows, key=lambda r: r["cycle_ms"])
    summary: dict[str, Any] = {
        "best_cycle_ms": best["cycle_ms"],
        "best_chunk_mib": best["chunk_mib"],
        "best_access": best["access"],
    }
    run_.finish(summary, config={"size_gib": args.size_gib, "cycles": args.cycles}, rows=rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
