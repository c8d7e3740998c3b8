"""What rlmem.comm asks of NCCL, torch.distributed and the device, in one object (the tests swap in a
host-only one that drives Gloo groups)."""

from __future__ import annotations

from typing import Any

import torch

from . import _nccl

__all__ = ["_Driver"]


class _Driver:
    """What rlmem.comm asks of NCCL and the device (the tests swap in a host-only one)."""

    def __init__(self) -> None:
        self.nccl = _nccl.library()

    def handles(self, pg: Any) -> bool:
        import torch.distributed as dist

        return "nccl" in str(dist.get_backend(pg)).lower()

    def comm(self, pg: Any) -> int:
        dev = torch.device("cuda", torch.cuda.current_device())
        backend = pg._get_backend(dev)
        ptr = int(backend._comm_ptr()) if hasattr(backend, "_comm_ptr") else 0
        if not ptr:
            raise RuntimeError(
                f"rlmem.comm: group {pg.group_name!r} has no NCCL communicator on {dev} yet; create groups "
                "eagerly (init_process_group(..., device_id=torch.device('cuda', i))) or run one "
                "collective first"
            )
        return ptr

    @property
    def can_suspend(self) -> bool:
        return self.nccl.has_suspend

    @property
    def describe(self) -> str:
        return f"NCCL {self.nccl.version_string} ({self.nccl.path})"

    def sync(self) -> None:
        torch.cuda.synchronize()

    def free_bytes(self) -> int:
        return int(torch.cuda.mem_get_info()[0])

    def async_error(self, comm: int) -> int:
        return self.nccl.async_error(comm)

    def suspend(self, comm: int) -> None:
        self.nccl.suspend(comm)

    def resume(self, comm: int) -> None:
        self.nccl.resume(comm)

    def mem_stat(self, comm: int, stat: int) -> int:
        return self.nccl.mem_stat(comm, stat)

    # The rebuild fallback.
    @property
    def backend_type(self) -> Any:
        import torch.distributed as dist

        return dist.ProcessGroup.BackendType.NCCL

    def is_comm(self, backend: Any) -> bool:
        return type(backend).__name__ == "ProcessGroupNCCL"

    def destroy(self, backend: Any) -> None:
        backend.shutdown()  # flushes, joins torch's watchdog, destroys the communicators

    def new_backend(self, store: Any, rank: int, size: int, old: Any) -> Any:
        from torch.distributed import ProcessGroupNCCL

        opts = ProcessGroupNCCL.Options()
        prev = getattr(old, "options", None)
        # Not split_from: the parent's communicators may be the ones just destroyed.
        for field in ("is_high_priority_stream", "_timeout", "global_ranks_in_group", "group_name"):
            if hasattr(prev, field):  # False for None too
                setattr(opts, field, getattr(prev, field))
        return ProcessGroupNCCL(store, rank, size, opts)

    def connect(self, backend: Any) -> None:
        backend.eager_connect_single_device(torch.device("cuda", torch.cuda.current_device()))
