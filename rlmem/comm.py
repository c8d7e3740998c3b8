"""NCCL communicator memory: suspend and resume it without destroying process groups.

``suspend(group)`` releases the GPU memory NCCL allocated for the communicators of ``group`` (buffers,
channels, proxies) through NCCL's own ``ncclCommSuspend(comm, NCCL_SUSPEND_MEM)`` (NCCL >= 2.29.7);
``resume(group)`` maps it back with ``ncclCommResume``; the process groups, their ranks and their names stay
as they are. The binding is to the libnccl torch loaded, and the communicators are torch's own
(``ProcessGroupNCCL._comm_ptr()``).

Contract (as for any collective): every rank of a group calls ``suspend`` and ``resume`` for it, with the same
groups in the same order; NCCL synchronises the ranks inside each call. Calls are idempotent per rank: a
suspended group is not suspended again. While a group is suspended, calling one of its collectives through
``torch.distributed`` raises :class:`GroupSuspendedError` instead of reaching NCCL. Collectives issued from
C++ (functional collectives, compiled graphs) are not intercepted: suspend only groups those do not use.

NCCL tracks (and so releases) its memory only with ``NCCL_CUMEM_ENABLE`` on, NCCL's default; with it off,
suspend frees nothing and rlmem warns.
"""

from __future__ import annotations

import os
import threading
import time
import warnings
from typing import Any

import torch

from . import _nccl

__all__ = ["GroupSuspendedError", "memory_stats", "resume", "suspend", "suspended"]

_lock = threading.RLock()
_suspended: dict[str, Any] = {}  # group name -> the group, while suspended
_stats: dict[str, dict[str, Any]] = {}
_originals: dict[str, Any] = {}
# ProcessGroup methods that torch.distributed's Python API calls for each collective and point-to-point op.
_GUARDED = (
    "allreduce",
    "allreduce_coalesced",
    "allgather",
    "allgather_coalesced",
    "allgather_into_tensor_coalesced",
    "_allgather_base",
    "reduce_scatter",
    "_reduce_scatter_base",
    "reduce_scatter_tensor_coalesced",
    "broadcast",
    "reduce",
    "gather",
    "scatter",
    "alltoall",
    "alltoall_base",
    "barrier",
    "monitored_barrier",
    "send",
    "recv",
    "recv_anysource",
)


class GroupSuspendedError(RuntimeError):
    """A collective was called on a process group whose communicators rlmem.comm suspended."""


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


_driver: Any = None


def _get_driver() -> Any:
    global _driver
    if _driver is None:
        _driver = _Driver()
    return _driver


def _initialized() -> None:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("rlmem.comm: torch.distributed is not initialized (call init_process_group first)")


def _resolve(group: Any, drv: Any) -> list[Any]:
    import torch.distributed as dist

    pg_map = dist.distributed_c10d._world.pg_map
    if group is None:
        groups = [pg for pg in pg_map if drv.handles(pg)]
    elif isinstance(group, dist.ProcessGroup):
        groups = [group]
    elif isinstance(group, (list, tuple)) and all(isinstance(g, dist.ProcessGroup) for g in group):
        groups = list(group)
    else:
        raise ValueError(
            "group must be a torch.distributed ProcessGroup, a list of them, or None (every NCCL group "
            f"of this process); got {type(group).__name__}"
        )
    out: dict[str, Any] = {}
    for g in groups:
        if g not in pg_map:
            raise ValueError(f"group {g.group_name!r} is not a live process group of this rank (destroyed?)")
        if not drv.handles(g):
            raise ValueError(
                f"group {g.group_name!r} uses backend {dist.get_backend(g)!r}; rlmem.comm handles NCCL groups"
            )
        out.setdefault(g.group_name, g)
    return list(out.values())


def _guard(name: str, orig: Any) -> Any:
    def guarded(self: Any, *args: Any, **kwargs: Any) -> Any:
        if _suspended and self.group_name in _suspended:
            raise GroupSuspendedError(
                f"process group {self.group_name!r} is suspended by rlmem.comm.suspend(); its collective "
                f"{name!r} cannot run until every rank calls rlmem.comm.resume() for it"
            )
        return orig(self, *args, **kwargs)

    guarded.__name__ = name
    guarded.__doc__ = getattr(orig, "__doc__", None)
    return guarded


def _install_guard() -> None:
    # Only while a group is suspended: with nothing suspended, torch's methods are untouched.
    import torch.distributed as dist

    if _originals:
        return
    cls = dist.ProcessGroup
    for name in _GUARDED:
        orig = cls.__dict__.get(name)
        if orig is not None:
            _originals[name] = orig
            setattr(cls, name, _guard(name, orig))


def _remove_guard() -> None:
    import torch.distributed as dist

    for name, orig in _originals.items():
        setattr(dist.ProcessGroup, name, orig)
    _originals.clear()


def _record(name: str) -> dict[str, Any]:
    return _stats.setdefault(
        name,
        {"suspends": 0, "resumes": 0, "last_suspend_s": None, "last_resume_s": None, "freed_bytes": None},
    )


def suspended() -> list[str]:
    """Names of the process groups this rank has suspended."""
    with _lock:
        return list(_suspended)


def suspend(group: Any = None) -> dict[str, Any]:
    """Release the GPU memory of the NCCL communicators of ``group``, keeping the process groups.

    Args:
        group: a ``torch.distributed`` process group, a list of them, or ``None`` for every NCCL group of
            this process. Every rank of each group must call this too, with the same groups in the same order.

    Returns:
        ``{"groups": [...], "seconds": s, "freed_bytes": n}`` for this call (device free memory before and
        after; groups already suspended are skipped).

    Raises:
        ValueError: ``group`` is not a process group, a list of them or None; or a group is not NCCL.
        RuntimeError: torch.distributed is not initialised; a group's communicator does not exist yet or
            reports pending or failed work; the loaded NCCL has no suspend API (older than 2.29.7).
    """
    with _lock:
        _initialized()
        drv = _get_driver()
        todo = [g for g in _resolve(group, drv) if g.group_name not in _suspended]
        if not todo:
            return {"groups": [], "seconds": 0.0, "freed_bytes": 0}
        if not drv.can_suspend:
            raise RuntimeError(
                f"rlmem.comm.suspend needs NCCL >= {_nccl.version_string(_nccl.SUSPEND_VERSION)} for "
                f"ncclCommSuspend; this process loaded {drv.describe}. Load a newer libnccl before torch "
                "initialises NCCL (LD_PRELOAD=/path/libnccl.so.2), e.g. from the nvidia-nccl-cu13 wheel"
            )
        if os.environ.get("NCCL_CUMEM_ENABLE", "").strip() == "0":
            warnings.warn(
                "NCCL_CUMEM_ENABLE=0: NCCL does not track its memory, so suspending frees nothing; unset it "
                "(NCCL's default is on) for rlmem.comm.suspend to give memory back",
                stacklevel=2,
            )
        t0 = time.perf_counter()
        drv.sync()  # what this rank queued on these groups has run
        comms = []
        for g in todo:
            c = drv.comm(g)
            err = drv.async_error(c)
            if err != 0:
                raise RuntimeError(
                    f"rlmem.comm.suspend: group {g.group_name!r} has pending or failed NCCL work (async "
                    f"state {err}); wait for its collectives to finish first. Nothing was suspended"
                )
            comms.append(c)
        freed = 0
        done: list[str] = []
        try:
            for g, c in zip(todo, comms, strict=True):
                before = drv.free_bytes()
                suspendable = drv.mem_stat(c, _nccl.STAT_SUSPEND)
                ts = time.perf_counter()
                drv.suspend(c)
                rec = _record(g.group_name)
                rec["last_suspend_s"] = time.perf_counter() - ts
                rec["freed_bytes"] = max(0, drv.free_bytes() - before)
                rec["suspendable_bytes"] = suspendable
                rec["suspends"] += 1
                freed += rec["freed_bytes"]
                _suspended[g.group_name] = g
                done.append(g.group_name)
                if drv.mem_stat(c, _nccl.STAT_TOTAL) == 0:
                    warnings.warn(
                        f"NCCL tracks no memory for group {g.group_name!r}: NCCL_CUMEM_ENABLE is probably "
                        "off, so suspending it freed nothing",
                        stacklevel=2,
                    )
        finally:
            if _suspended:
                _install_guard()
        return {"groups": done, "seconds": time.perf_counter() - t0, "freed_bytes": freed}


def resume(group: Any = None) -> dict[str, Any]:
    """Bring back the communicator memory of suspended groups (every rank of each group calls it too).

    Args:
        group: as for :func:`suspend`; groups that are not suspended are skipped.

    Returns:
        ``{"groups": [...], "seconds": s, "taken_bytes": n}`` for this call.

    Raises:
        ValueError, RuntimeError: as for :func:`suspend`; an NCCL error leaves the group suspended.
    """
    with _lock:
        _initialized()
        drv = _get_driver()
        todo = [g for g in _resolve(group, drv) if g.group_name in _suspended]
        t0 = time.perf_counter()
        taken = 0
        done: list[str] = []
        try:
            for g in todo:
                c = drv.comm(g)
                before = drv.free_bytes()
                ts = time.perf_counter()
                drv.resume(c)
                rec = _record(g.group_name)
                rec["last_resume_s"] = time.perf_counter() - ts
                rec["resumes"] += 1
                taken += max(0, before - drv.free_bytes())
                del _suspended[g.group_name]
                done.append(g.group_name)
        finally:
            if not _suspended:
                _remove_guard()
        return {"groups": done, "seconds": time.perf_counter() - t0, "taken_bytes": taken}


def memory_stats(group: Any = None) -> dict[str, dict[str, Any]]:
    """Per group name: NCCL's own figures (``suspendable_bytes``, ``persistent_bytes``, ``total_bytes``,
    ``suspended``) and rlmem's (suspend/resume counts, seconds of the last calls, device bytes freed by the
    last suspend).

    Raises:
        ValueError, RuntimeError: as for :func:`suspend`.
    """
    with _lock:
        _initialized()
        drv = _get_driver()
        out: dict[str, dict[str, Any]] = {}
        for g in _resolve(group, drv):
            entry: dict[str, Any] = {"suspended": g.group_name in _suspended, "nccl": drv.describe}
            if drv.can_suspend:
                c = drv.comm(g)
                entry["suspendable_bytes"] = drv.mem_stat(c, _nccl.STAT_SUSPEND)
                entry["persistent_bytes"] = drv.mem_stat(c, _nccl.STAT_PERSIST)
                entry["total_bytes"] = drv.mem_stat(c, _nccl.STAT_TOTAL)
                entry["suspended"] = bool(drv.mem_stat(c, _nccl.STAT_SUSPENDED))
            entry.update(_stats.get(g.group_name, {}))
            out[g.group_name] = entry
        return out
