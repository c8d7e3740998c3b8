"""The device as the ledger and the fences see it: free and total bytes, and waiting for its work.

On a GPU: ``cudaMemGetInfo`` (what every process on the device leaves free) and a device synchronize. On the
host backend the "device" is the machine's shared memory, where shareable host Regions live (``memfd``):
its total is the machine's memory and its used bytes are the ``Shmem`` line of ``/proc/meminfo``, which
rises and falls only as shared memory is mapped and let go, so two processes on a CPU see each other's
releases the way two processes on a GPU do.
"""

from __future__ import annotations

import torch

__all__ = ["mem_info", "synchronize"]


def _meminfo(key: str) -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {key} line in /proc/meminfo")


def mem_info(device: torch.device) -> tuple[int, int]:
    """(free, total) bytes of ``device``, as every process on it sees them."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return int(free), int(total)
    total = _meminfo("MemTotal")
    return total - _meminfo("Shmem"), total


def synchronize(device: torch.device) -> None:
    """Wait until the work this process queued on ``device`` has finished (none to wait for on a host)."""
    if device.type == "cuda" and torch.cuda.is_initialized():
        torch.cuda.synchronize(device)
