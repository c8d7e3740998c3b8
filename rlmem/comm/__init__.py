"""NCCL communicator memory released and restored without destroying process groups.

Owns :func:`suspend` / :func:`resume` and the registry of suspended groups, the binding to the libnccl
torch loaded (``ncclCommSuspend`` / ``ncclCommResume``), and the fallback that destroys and rebuilds a
group's communicators where that NCCL has no suspend API. Imports only :mod:`rlmem.errors` and torch.
The contract and the mechanics are in :mod:`rlmem.comm._suspend`.
"""

from ._suspend import (
    CommFallbackWarning,
    CommStats,
    GroupSuspendedError,
    ResumeResult,
    SuspendResult,
    memory_stats,
    nccl_driver,
    resume,
    suspend,
    suspended,
)

__all__ = [
    "CommFallbackWarning",
    "CommStats",
    "GroupSuspendedError",
    "ResumeResult",
    "SuspendResult",
    "memory_stats",
    "nccl_driver",
    "resume",
    "suspend",
    "suspended",
]
