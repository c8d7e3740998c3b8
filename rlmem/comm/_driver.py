"""What rlmem.comm asks of NCCL, torch.distributed and the device, in one object (the tests swap in a
host-only one that drives Gloo groups).

Two ways to suspend a communicator: torch's own ``ProcessGroupNCCL.suspend()`` / ``resume()`` /
``memory_stats()`` where the loaded torch has them (>= 2.12; they call ``ncclCommSuspend`` under torch's
communicator lock), else ctypes on the libnccl torch loaded. torch's methods exist in builds whose NCCL
headers are older than 2.29.7 too, where they raise; the driver then falls back to ctypes for good.
"""

from __future__ import annotations

from typing import Any

import torch

from . import _nccl

__all__ = ["Comm", "Driver", "torch_has_api"]


# torch's memory_stats() keys for NCCL's ncclCommMemStat_t values.
_TORCH_STATS = {
    _nccl.STAT_SUSPEND: "suspend",
    _nccl.STAT_SUSPENDED: "suspended",
    _nccl.STAT_PERSIST: "persist",
    _nccl.STAT_TOTAL: "total",
}


class Comm:
    """One group's communicator on this rank: torch's backend object and NCCL's handle (0 if unknown)."""

    __slots__ = ("backend", "ptr")

    def __init__(self, backend: Any, ptr: int) -> None:
        self.backend = backend
        self.ptr = ptr


def torch_has_api() -> bool:
    """The loaded torch's NCCL backend has ``suspend()``, ``resume()``, ``memory_stats()`` (torch >= 2.12)."""
    try:
        from torch.distributed import ProcessGroupNCCL
    except ImportError:
        return False
    return all(hasattr(ProcessGroupNCCL, m) for m in ("suspend", "resume", "memory_stats"))


class Driver:
    """What rlmem.comm asks of NCCL and the device (the tests swap in a host-only one).

    Args:
        api: ``"auto"`` (torch's methods where they exist and work, else ctypes), ``"torch"`` or ``"ctypes"``.
    """

    def __init__(self, api: str = "auto") -> None:
        self.nccl = _nccl.library()
        self.api = "torch" if api in ("auto", "torch") and torch_has_api() else "ctypes"
        if api == "torch" and self.api != "torch":
            raise RuntimeError("rlmem.comm: this torch's ProcessGroupNCCL has no suspend()/resume() (< 2.12)")
        self._forced = api != "auto"

    def handles(self, pg: Any) -> bool:
        import torch.distributed as dist

        return "nccl" in str(dist.get_backend(pg)).lower()

    def comm(self, pg: Any) -> Comm:
        dev = torch.device("cuda", torch.cuda.current_device())
        backend = pg._get_backend(dev)
        ptr = int(backend._comm_ptr()) if hasattr(backend, "_comm_ptr") else 0
        if not ptr:
            raise RuntimeError(
                f"rlmem.comm: group {pg.group_name!r} has no NCCL communicator on {dev} yet; create groups "
                "eagerly (init_process_group(..., device_id=torch.device('cuda', i))) or run one "
                "collective first"
            )
        return Comm(backend, ptr)

    @property
    def can_suspend(self) -> bool:
        # torch's methods call the same NCCL entry points: they work only where the loaded NCCL has them.
        return self.nccl.has_suspend

    @property
    def describe(self) -> str:
        via = "torch ProcessGroupNCCL.suspend" if self.api == "torch" else "ctypes"
        return f"NCCL {self.nccl.version_string} ({self.nccl.path}; via {via})"

    def _torch_call(self, what: str, c: Comm) -> tuple[bool, Any]:
        """``(True, result)`` of torch's method, or ``(False, None)`` once it has proven unusable (a torch
        built against NCCL headers older than the API raises "requires NCCL 2.29.7"): ctypes from then on."""
        try:
            return True, getattr(c.backend, what)()
        except RuntimeError as e:
            if self._forced or "requires NCCL" not in str(e):
                raise
            self.api = "ctypes"
            return False, None

    def sync(self) -> None:
        torch.cuda.synchronize()

    def free_bytes(self) -> int:
        return int(torch.cuda.mem_get_info()[0])

    def async_error(self, c: Comm) -> int:
        return self.nccl.async_error(c.ptr)

    def suspend(self, c: Comm) -> None:
        if not (self.api == "torch" and self._torch_call("suspend", c)[0]):
            self.nccl.suspend(c.ptr)

    def resume(self, c: Comm) -> None:
        if not (self.api == "torch" and self._torch_call("resume", c)[0]):
            self.nccl.resume(c.ptr)

    def mem_stat(self, c: Comm, stat: int) -> int:
        if self.api == "torch":
            ok, got = self._torch_call("memory_stats", c)
            if ok:
                return int(got[_TORCH_STATS[stat]])
        return self.nccl.mem_stat(c.ptr, stat)

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
