"""Placing pinned host buffers on the NUMA node of the GPU that copies them.

On a host with several NUMA nodes, a GPU's DMA engine reaches host memory on its own node directly and
memory on another node through the inter-socket link, at a lower rate. Pages are placed where they are
first touched, so before a pinned buffer is populated its range gets a preferred-node policy (``mbind``,
``MPOL_PREFERRED``) for the GPU's node, read from ``/sys/bus/pci/devices/<bus id>/numa_node``. On a host with
one node (or where the kernel does not say) nothing is done. ``libnuma`` is not needed: ``mbind`` is one
system call.
"""

from __future__ import annotations

import ctypes
import os
import platform
from pathlib import Path

__all__ = ["gpu_bus_id", "gpu_node", "node_count", "node_cpus", "pages_by_node", "pci_node", "place"]

SYSFS = Path("/sys")
_MPOL_PREFERRED = 1
_SYS_MBIND = {"x86_64": 237, "aarch64": 235}


def _node_ids(root: Path) -> list[int]:
    """The NUMA nodes the kernel reports (``nodeN`` directories), sorted; none if it reports none."""
    d = root / "devices" / "system" / "node"
    try:
        return sorted(
            int(p.name[4:]) for p in d.iterdir() if p.name.startswith("node") and p.name[4:].isdigit()
        )
    except OSError:
        return []


def node_count(root: Path = SYSFS) -> int:
    """NUMA nodes the kernel reports (1 when it reports none)."""
    return max(len(_node_ids(root)), 1)


def node_cpus(root: Path = SYSFS) -> dict[int, list[int]]:
    """The CPUs of each NUMA node, from ``nodeN/cpulist`` (empty when the kernel reports no nodes)."""
    out: dict[int, list[int]] = {}
    d = root / "devices" / "system" / "node"
    for n in _node_ids(root):
        try:
            text = (d / f"node{n}" / "cpulist").read_text().strip()
        except OSError:
            continue
        cpus: list[int] = []
        for part in filter(None, text.split(",")):
            lo, _, hi = part.partition("-")
            cpus.extend(range(int(lo), int(hi or lo) + 1))
        out[n] = cpus
    return out


def gpu_bus_id(index: int) -> str | None:
    """The PCI address of CUDA device ``index`` as sysfs names it (``0000:1b:00.0``), None if unknown."""
    try:
        import torch

        props = torch.cuda.get_device_properties(index)
        return f"{props.pci_domain_id:04x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"
    except (AttributeError, RuntimeError, AssertionError):
        return None


def gpu_node(index: int, root: Path = SYSFS) -> int | None:
    """The NUMA node of CUDA device ``index`` (None if unknown or the host has one node)."""
    if node_count(root) <= 1:
        return None
    bus_id = gpu_bus_id(index)
    return None if bus_id is None else pci_node(bus_id, root)


def pci_node(bus_id: str, root: Path = SYSFS) -> int | None:
    """The NUMA node sysfs gives the PCI device ``bus_id`` (None: -1, or no such file)."""
    return _read_node(root / "bus" / "pci" / "devices" / bus_id / "numa_node")


def pages_by_node(addr: int, maps: Path = Path("/proc/self/numa_maps")) -> dict[int, int]:
    """Pages of the mapping that starts at ``addr`` on each node, as the kernel reports them (empty when it
    does not)."""
    try:
        lines = maps.read_text().splitlines()
    except OSError:
        return {}
    for line in lines:
        head, _, rest = line.partition(" ")
        if head and int(head, 16) == addr:
            return {
                int(k[1:]): int(v)
                for k, _, v in (f.partition("=") for f in rest.split())
                if k[:1] == "N" and k[1:].isdigit()
            }
    return {}


def _read_node(path: Path) -> int | None:
    try:
        node = int(path.read_text().strip())
    except (OSError, ValueError):
        return None
    return node if node >= 0 else None


def place(addr: int, nbytes: int, node: int | None) -> bool:
    """Prefer ``node`` for the pages of ``[addr, addr + nbytes)`` not yet touched; True if the policy was
    set. A no-op (False) without a node, off Linux, or where the call fails (the pages then go wherever
    the kernel puts them, as without rlmem)."""
    number = _SYS_MBIND.get(platform.machine())
    if node is None or number is None or not hasattr(os, "sched_getaffinity") or node >= 1024:
        return False
    mask = (ctypes.c_ulong * 16)()  # 1024 nodes
    mask[node // 64] = 1 << (node % 64)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        rc = libc.syscall(
            ctypes.c_long(number),
            ctypes.c_void_p(addr),
            ctypes.c_ulong(nbytes),
            ctypes.c_int(_MPOL_PREFERRED),
            mask,
            ctypes.c_ulong(1024),
            ctypes.c_uint(0),
        )
    except (OSError, AttributeError):
        return False
    return rc == 0
