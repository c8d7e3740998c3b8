"""Host-link copy rate by where the pinned pages live and which cores issue the copies, with the topology.

Rows: pinned buffers as rlmem allocates them (``HostBuffer``: on a host with several NUMA nodes, pages
preferred on the GPU's node), as the kernel places them without a policy (first touch by PyTorch's
intra-op threads), and, where there are several nodes, placed on each node in turn and with the issuing
thread bound to each node's cores. Each row: H2D and D2H GB/s of one ``--size-mib`` copy (best and median
of ``--reps``) and where the kernel says the pages are (``/proc/self/numa_maps``). On a one-node host the
placement is a no-op and the two first rows measure the same thing twice (the spread is the noise).
Writes bench/results/numa-<machine>.json: ``rlmem bench numa``.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from ..memory import HostBuffer, _numa
from ._common import format_table, median
from ._harness import Run

NAME = "numa"


def _rates(host: torch.Tensor, dev: torch.Tensor, reps: int) -> dict[str, float]:
    """GB/s of H2D and D2H copies between ``host`` and ``dev`` (best and median of ``reps``)."""
    out: dict[str, float] = {}
    for name, dst, src in (("h2d", dev, host), ("d2h", host, dev)):
        times = []
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            dst.copy_(src, non_blocking=True)
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        out[f"{name}_gbps"] = host.numel() / min(times) / 1e9
        out[f"{name}_median_gbps"] = host.numel() / median(times) / 1e9
    return out


def _row(label: str, host: torch.Tensor, dev: torch.Tensor, reps: int, **extra: Any) -> dict[str, Any]:
    pages = _numa.pages_by_node(host.data_ptr())
    total = sum(pages.values())
    where = ", ".join(f"node{n} {c / total:.0%}" for n, c in sorted(pages.items())) if total else "unknown"
    return {"pages": label, **extra, "pages_on": where, **_rates(host, dev, reps)}


def main(argv: list[str] | None = None) -> int:
    run_ = Run(NAME, __doc__.splitlines()[0])
    run_.parser.add_argument("--size-mib", type=int, default=1024, help="bytes per copy (MiB)")
    run_.parser.add_argument("--reps", type=int, default=8, help="copies timed per direction and row")
    args = run_.parse(argv)
    if args.size_mib < 1:
        run_.error(f"--size-mib must be >= 1, got {args.size_mib}")
    if args.reps < 1:
        run_.error(f"--reps must be >= 1, got {args.reps}")
    if not run_.needs_cuda():
        return 2
    idx = run_.device.index
    nbytes = args.size_mib << 20
    nodes = _numa.node_cpus()
    gpu = _numa.gpu_node(idx)
    bus = _numa.gpu_bus_id(idx)
    raw = None if bus is None else _numa.pci_node(bus)
    topology = {
        "nodes": len(nodes) or 1,
        "cpus_per_node": {str(n): len(c) for n, c in nodes.items()},
        "gpu_bus_id": bus,
        "gpu_numa_node": raw,  # as sysfs says it (None: -1 or no file)
        "rlmem_places_on": gpu,  # what HostBuffer prefers (None: nothing done)
        "cpus_allowed": len(os.sched_getaffinity(0)),
    }
    dev = torch.empty(nbytes, dtype=torch.uint8, device=run_.device)
    _rates(torch.empty(nbytes, dtype=torch.uint8, pin_memory=True), dev, 2)  # warm the copy engines
    rows = []
    # As rlmem makes them, then with the pages' policy given: none (first touch), each node in turn.
    choices: list[tuple[str, int | str | None]] = [("rlmem (HostBuffer)", "gpu"), ("first touch", None)]
    choices += [(f"node{n}", n) for n in sorted(nodes)] if len(nodes) > 1 else []
    for label, node in choices:
        buf = HostBuffer(nbytes, device_index=idx, node=node)
        try:
            assert buf.tensor is not None
            rows.append(_row(label, buf.tensor, dev, args.reps, thread="as is", placed=buf.numa_node))
        finally:
            buf.free()
    if len(nodes) > 1:  # the issuing thread on each node's cores, pages where rlmem puts them
        allowed = os.sched_getaffinity(0)
        buf = HostBuffer(nbytes, device_index=idx)
        try:
            assert buf.tensor is not None
            for n, cpus in sorted(nodes.items()):
                mine = set(cpus) & allowed
                if not mine:
                    continue
                os.sched_setaffinity(0, mine)
                try:
                    rows.append(
                        _row(
                            "rlmem (HostBuffer)",
                            buf.tensor,
                            dev,
                            args.reps,
                            thread=f"node{n}",
                            placed=buf.numa_node,
                        )
                    )
                finally:
                    os.sched_setaffinity(0, allowed)
        finally:
            buf.free()
    cols = [
        ("pages", "pages", ""),
        ("placed", "policy node", ""),
        ("thread", "thread", ""),
        ("pages_on", "pages on", ""),
    ]
    cols += [(k, k.replace("_gbps", " GB/s").replace("_", " "), ".2f") for k in rows[0] if k.endswith("gbps")]
    print(f"topology: {topology}")
    print(format_table(rows, cols))
    ours, plain = rows[0], rows[1]
    summary: dict[str, Any] = {
        "numa_nodes": topology["nodes"],
        "gpu_numa_node": raw,
        "placement_applies": gpu is not None,
        "h2d_gbps": ours["h2d_gbps"],
        "d2h_gbps": ours["d2h_gbps"],
        "h2d_gbps_first_touch": plain["h2d_gbps"],
        "d2h_gbps_first_touch": plain["d2h_gbps"],
        "h2d_vs_first_touch": ours["h2d_gbps"] / plain["h2d_gbps"],
        "d2h_vs_first_touch": ours["d2h_gbps"] / plain["d2h_gbps"],
    }
    placed = [r for r in rows if r["pages"].startswith("node")]
    if placed:
        worst = min(placed, key=lambda r: r["h2d_gbps"] + r["d2h_gbps"])
        summary["h2d_vs_worst_node"] = ours["h2d_gbps"] / worst["h2d_gbps"]
        summary["d2h_vs_worst_node"] = ours["d2h_gbps"] / worst["d2h_gbps"]
    run_.finish(
        summary, config={"size_mib": args.size_mib, "reps": args.reps}, topology=topology, results=rows
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
