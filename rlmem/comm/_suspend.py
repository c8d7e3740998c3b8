"""NCCL communicator memory: suspend and resume it without destroying process groups.

``suspend(group)`` releases the GPU memory NCCL allocated for the communicators of ``group`` (buffers,
channels, proxies) through NCCL's own ``ncclCommSuspend(comm, NCCL_SUSPEND_MEM)`` (NCCL >= 2.29.7);
``resume(group)`` maps it back with ``ncclCommResume``; the process groups, their ranks and their names stay
as they are. The binding is to the libnccl torch loaded, and the communicators are torch's own
(``ProcessGroupNCCL._comm_ptr()``).

Contract (as for any collective): every rank of a group calls ``suspend`` and ``resume`` for it, with the same
groups in the same order; NCCL synchronises the ranks inside each call. Calls are idempotent per rank: a
suspended group is not suspended again. While a group is suspended, calling one of its collectives through
``torch.distributed`` raises :class:`GroupSuspendedError` instead of reaching NCCL (or, for groups
suspended with ``resume_on_use=True``, resumes them first). Collectives issued from
C++ (functional collectives, compiled graphs) are not intercepted: suspend only groups those do not use.

NCCL tracks (and so releases) its memory only with ``NCCL_CUMEM_ENABLE`` on, NCCL's default; with it off,
suspend frees nothing and rlmem warns.

Where the loaded NCCL has no suspend API (older than 2.29.7), or with ``method="rebuild"``, ``suspend`` falls
back to destroying the group's communicators and ``resume`` builds them again (a :class:`CommFallbackWarning`
says how long that took and which NCCL would do better). torch cannot put a new backend under an existing
``ProcessGroup``, so the rebuilt communicators live in a new group object with the same rank, size and name,
and the object the program holds forwards its methods (collectives, ``_get_backend``, ``shutdown``) to it:
code that calls ``torch.distributed`` with the group it holds keeps working; C++ code that looks groups up by
name (functional collectives) does not see the rebuilt communicators.
"""

from __future__ import annotations

import os
import threading
import time
import warnings
from dataclasses import dataclass
from typing import Any

from .._checks import check_choice, check_flag
from .._results import Result
from .._units import MiB
from . import _nccl
from . import _rebuild as _comm_rebuild
from ._driver import Driver

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

METHODS = ("auto", "suspend", "rebuild")
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
    "all_gather_single",
    "all_gather_single_coalesced",
    "all_to_all_single",
    "reduce_scatter_single",
    "reduce_scatter_single_coalesced",
)
# Also forwarded to a rebuilt group, never refused: what torch.distributed asks of a group besides
# collectives.
_FORWARDED = (
    "_get_backend",
    "_start_coalescing",
    "_end_coalescing",
    "_wait_for_pending_works",
    "shutdown",
    "abort",
)


class GroupSuspendedError(RuntimeError):
    """A collective was called on a process group whose communicators rlmem.comm suspended."""


class CommFallbackWarning(UserWarning):
    """rlmem.comm destroyed and rebuilt communicators because the loaded NCCL cannot suspend them."""


@dataclass(frozen=True)
class SuspendResult(Result):
    """What :func:`suspend` did in this call: the groups it suspended (those already suspended are skipped),
    how, in how many seconds, and the device bytes that became free."""

    groups: list[str]
    method: str
    seconds: float
    freed_bytes: int


@dataclass(frozen=True)
class ResumeResult(Result):
    """What :func:`resume` did in this call: the groups it resumed, seconds, device bytes taken again."""

    groups: list[str]
    seconds: float
    taken_bytes: int


@dataclass(frozen=True)
class CommStats(Result):
    """One group, as :func:`memory_stats` reports it.

    Attributes:
        suspended: its communicators are suspended (or destroyed by the rebuild fallback) now.
        nccl: the loaded NCCL, version and path.
        suspendable_bytes, persistent_bytes, total_bytes: NCCL's own figures (None where the loaded NCCL
            cannot report them, or while the group is rebuilt).
        method: how it was last suspended (``"suspend"`` or ``"rebuild"``; None if never).
        suspends, resumes: counts so far.
        last_suspend_s, last_resume_s: seconds of the last calls.
        freed_bytes: device bytes the last suspend freed.
        rebuilds: times its communicators were built again.
    """

    suspended: bool
    nccl: str
    suspendable_bytes: int | None = None
    persistent_bytes: int | None = None
    total_bytes: int | None = None
    method: str | None = None
    suspends: int = 0
    resumes: int = 0
    last_suspend_s: float | None = None
    last_resume_s: float | None = None
    freed_bytes: int | None = None
    rebuilds: int = 0


class _Registry:
    """Everything rlmem.comm remembers in this process, in one place, behind one lock: which groups are
    suspended and how, the group objects carrying rebuilt communicators, per-group figures, the
    ProcessGroup methods it wrapped while any group is suspended, and the driver (the tests swap in a
    host-only one)."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.suspended: dict[str, str] = {}  # group name -> "suspend" or "rebuild", while it is
        # Suspended groups whose first collective resumes them (suspend(..., resume_on_use=True)).
        self.on_use: set[str] = set()
        # id(group the program holds) -> (that group, the group object carrying its rebuilt communicators)
        self.current: dict[int, tuple[Any, Any]] = {}
        self.generation: dict[str, int] = {}
        self.warned: set[str] = set()
        self.stats: dict[str, dict[str, Any]] = {}
        self.originals: dict[str, Any] = {}
        self.driver: Any = None

    def get_driver(self) -> Any:
        if self.driver is None:
            self.driver = Driver()
        return self.driver

    def now(self, pg: Any) -> Any:
        """The group object carrying ``pg``'s communicators (``pg`` itself unless rebuilt)."""
        entry = self.current.get(id(pg))
        return pg if entry is None else entry[1]

    def raw(self, name: str) -> Any:
        import torch.distributed as dist

        return self.originals.get(name) or dist.ProcessGroup.__dict__[name]

    def install_guard(self) -> None:
        # Only while a group is suspended or rebuilt: otherwise torch's methods are untouched.
        import torch.distributed as dist

        if self.originals:
            return
        cls = dist.ProcessGroup
        for name in _GUARDED + _FORWARDED:
            orig = cls.__dict__.get(name)
            if orig is not None:
                self.originals[name] = orig
                setattr(cls, name, _wrap(name, orig))

    def remove_guard(self) -> None:
        import torch.distributed as dist

        if self.suspended or self.current:
            return
        for name, orig in self.originals.items():
            setattr(dist.ProcessGroup, name, orig)
        self.originals.clear()

    def forget(self, pg: Any) -> None:
        # The program shut ``pg`` down: nothing of it is suspended or forwarded any more.
        self.current.pop(id(pg), None)
        self.suspended.pop(pg.group_name, None)
        self.on_use.discard(pg.group_name)
        self.remove_guard()

    def warn_once(self, kind: str, message: str) -> None:
        if kind not in self.warned:
            self.warned.add(kind)
            warnings.warn(message, CommFallbackWarning, stacklevel=3)

    def record(self, name: str) -> dict[str, Any]:
        return self.stats.setdefault(
            name,
            {"suspends": 0, "resumes": 0, "last_suspend_s": None, "last_resume_s": None, "freed_bytes": None},
        )


registry = _Registry()


def nccl_driver() -> Any:
    """This process's binding to NCCL: ``can_suspend`` (the loaded libnccl has ``ncclCommSuspend``, or torch
    has ``ProcessGroupNCCL.suspend``) and ``describe`` (which NCCL, which path). Loads nothing until asked."""
    return registry.get_driver()


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


def _wrap(name: str, orig: Any) -> Any:
    refuse = name in _GUARDED
    ends = name in ("shutdown", "abort")

    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        gname = self.group_name
        if refuse and gname in registry.on_use:
            _resume_on_use()
        if gname in registry.suspended:
            if refuse:
                raise GroupSuspendedError(
                    f"process group {gname!r} is suspended by rlmem.comm.suspend(); its collective "
                    f"{name!r} cannot run until every rank calls rlmem.comm.resume() for it"
                )
            if ends and registry.suspended[gname] == "rebuild":
                # Its communicators are destroyed already; shutting them down again is not safe.
                registry.forget(self)
                return None
        entry = registry.current.get(id(self))
        try:
            return orig(self if entry is None else entry[1], *args, **kwargs)
        finally:
            if ends and entry is not None:
                registry.forget(self)

    method.__name__ = name
    method.__doc__ = getattr(orig, "__doc__", None)
    return method


def _resume_on_use() -> None:
    """The first collective on a group suspended with ``resume_on_use``: every such group comes back, in the
    order of the process's groups (the same on every rank), before the collective runs."""
    import torch.distributed as dist

    with registry.lock:
        names = registry.on_use
        todo = [pg for pg in dist.distributed_c10d._world.pg_map if pg.group_name in names]
        if todo:
            resume(todo)


def suspended() -> list[str]:
    """Names of the process groups this rank has suspended."""
    with registry.lock:
        return list(registry.suspended)


def suspend(group: Any = None, *, method: str = "auto", resume_on_use: bool = False) -> SuspendResult:
    """Release the GPU memory of the NCCL communicators of ``group``, keeping the process groups.

    Args:
        group: a ``torch.distributed`` process group, a list of them, or ``None`` for every NCCL group of
            this process. Every rank of each group must call this too, with the same groups in the same order.
        method: ``"auto"`` (NCCL's suspend where the loaded NCCL has it, else the rebuild fallback),
            ``"suspend"`` (NCCL's suspend or an error) or ``"rebuild"`` (destroy the communicators now and
            build them again on resume).
        resume_on_use: instead of refusing, the first collective called through ``torch.distributed`` on
            any group suspended this way resumes all of them (in the process's group order) and then runs:
            for a program whose ranks reach the same first collective, as SPMD training does, that cannot
            track where its next phase starts. A collective issued from C++ is not seen (see above).

    Returns:
        a :class:`SuspendResult` for this call (freed bytes from the device's free memory before and after;
        groups already suspended are skipped).

    Raises:
        ValueError: ``group`` is not a process group, a list of them or None; a group is not NCCL; ``method``
            is not one of ``"auto"``, ``"suspend"``, ``"rebuild"``; ``resume_on_use`` is not a bool.
        RuntimeError: torch.distributed is not initialised; a group's communicator does not exist yet or
            reports pending or failed work (nothing is released then); ``method="suspend"`` and the loaded
            NCCL has no suspend API (older than 2.29.7).
    """
    check_choice("method", method, METHODS)
    check_flag("resume_on_use", resume_on_use)
    with registry.lock:
        _initialized()
        drv = registry.get_driver()
        todo = [g for g in _resolve(group, drv) if g.group_name not in registry.suspended]
        use = method if method != "auto" else ("suspend" if drv.can_suspend else "rebuild")
        if not todo:
            return SuspendResult(groups=[], method=use, seconds=0.0, freed_bytes=0)
        if use == "suspend" and not drv.can_suspend:
            raise RuntimeError(
                f"rlmem.comm.suspend needs NCCL >= {_nccl.version_string(_nccl.SUSPEND_VERSION)} for "
                f"ncclCommSuspend; this process loaded {drv.describe}. Load a newer libnccl before torch "
                "initialises NCCL (LD_PRELOAD=/path/libnccl.so.2), e.g. from the nvidia-nccl-cu13 wheel, or "
                "use method='rebuild'"
            )
        if use == "suspend" and os.environ.get("NCCL_CUMEM_ENABLE", "").strip() == "0":
            warnings.warn(
                "NCCL_CUMEM_ENABLE=0: NCCL does not track its memory, so suspending frees nothing; unset it "
                "(NCCL's default is on) for rlmem.comm.suspend to give memory back",
                stacklevel=2,
            )
        t0 = time.perf_counter()
        drv.sync()  # what this rank queued on these groups has run
        comms = []
        for g in todo:
            c = drv.comm(registry.now(g))
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
                ts = time.perf_counter()
                if use == "suspend":
                    suspendable = drv.mem_stat(c, _nccl.STAT_SUSPEND)
                    drv.suspend(c)
                else:
                    for b in _comm_rebuild.comm_backends(registry.now(g), drv, registry.raw("_get_backend")):
                        drv.destroy(b)
                rec = registry.record(g.group_name)
                rec["last_suspend_s"] = time.perf_counter() - ts
                rec["freed_bytes"] = max(0, drv.free_bytes() - before)
                rec["method"] = use
                if use == "suspend":
                    rec["suspendable_bytes"] = suspendable
                rec["suspends"] += 1
                freed += rec["freed_bytes"]
                registry.suspended[g.group_name] = use
                if resume_on_use:
                    registry.on_use.add(g.group_name)
                done.append(g.group_name)
                if use == "suspend" and drv.mem_stat(c, _nccl.STAT_TOTAL) == 0:
                    warnings.warn(
                        f"NCCL tracks no memory for group {g.group_name!r}: NCCL_CUMEM_ENABLE is probably "
                        "off, so suspending it freed nothing",
                        stacklevel=2,
                    )
        finally:
            if registry.suspended:
                registry.install_guard()
        seconds = time.perf_counter() - t0
        if use == "rebuild" and not drv.can_suspend:
            registry.warn_once(
                "suspend",
                f"rlmem.comm: {drv.describe} cannot suspend communicators (NCCL >= "
                f"{_nccl.version_string(_nccl.SUSPEND_VERSION)} can); destroyed those of "
                f"{len(done)} group(s) instead in {seconds:.3f} s, freeing {freed / MiB:.1f} MiB; resume() "
                "builds them again",
            )
        return SuspendResult(groups=done, method=use, seconds=seconds, freed_bytes=freed)


def resume(group: Any = None) -> ResumeResult:
    """Bring back the communicators of suspended groups (every rank of each group calls it too).

    Groups suspended by NCCL's suspend are resumed in place; groups whose communicators were destroyed (the
    rebuild fallback) get new ones, and the group objects the program holds forward to them.

    Args:
        group: as for :func:`suspend`; groups that are not suspended are skipped.

    Returns:
        a :class:`ResumeResult` for this call.

    Raises:
        ValueError, RuntimeError: as for :func:`suspend`; an NCCL error leaves the group suspended.
    """
    with registry.lock:
        _initialized()
        drv = registry.get_driver()
        todo = [g for g in _resolve(group, drv) if g.group_name in registry.suspended]
        t0 = time.perf_counter()
        taken = 0
        done: list[str] = []
        rebuilt = 0
        try:
            for g in todo:
                name = g.group_name
                before = drv.free_bytes()
                ts = time.perf_counter()
                if registry.suspended[name] == "suspend":
                    drv.resume(drv.comm(registry.now(g)))
                else:
                    gen = registry.generation.get(name, 0) + 1
                    new = _comm_rebuild.rebuild(g, registry.now(g), gen, drv, registry.raw("_get_backend"))
                    registry.generation[name] = gen
                    registry.current[id(g)] = (g, new)
                    rebuilt += 1
                rec = registry.record(name)
                rec["last_resume_s"] = time.perf_counter() - ts
                rec["resumes"] += 1
                taken += max(0, before - drv.free_bytes())
                del registry.suspended[name]
                registry.on_use.discard(name)
                done.append(name)
        finally:
            registry.remove_guard()
        seconds = time.perf_counter() - t0
        if rebuilt and not drv.can_suspend:
            registry.warn_once(
                "resume",
                f"rlmem.comm: rebuilt the communicators of {rebuilt} group(s) in {seconds:.3f} s; "
                f"{drv.describe} cannot suspend them, NCCL >= {_nccl.version_string(_nccl.SUSPEND_VERSION)} "
                "resumes them in place (load it with LD_PRELOAD before torch initialises NCCL)",
            )
        return ResumeResult(groups=done, seconds=seconds, taken_bytes=taken)


def memory_stats(group: Any = None) -> dict[str, CommStats]:
    """Per group name, a :class:`CommStats`: NCCL's own figures where the loaded NCCL reports them, whether
    it is suspended, and rlmem's (method of the last suspend, counts, seconds, bytes freed, rebuilds).

    Raises:
        ValueError, RuntimeError: as for :func:`suspend`.
    """
    with registry.lock:
        _initialized()
        drv = registry.get_driver()
        out: dict[str, CommStats] = {}
        for g in _resolve(group, drv):
            name = g.group_name
            entry: dict[str, Any] = {"suspended": name in registry.suspended, "nccl": drv.describe}
            if drv.can_suspend and registry.suspended.get(name) != "rebuild":
                c = drv.comm(registry.now(g))
                entry["suspendable_bytes"] = drv.mem_stat(c, _nccl.STAT_SUSPEND)
                entry["persistent_bytes"] = drv.mem_stat(c, _nccl.STAT_PERSIST)
                entry["total_bytes"] = drv.mem_stat(c, _nccl.STAT_TOTAL)
                entry["suspended"] = bool(drv.mem_stat(c, _nccl.STAT_SUSPENDED))
            entry.update(registry.stats.get(name, {}))
            entry["rebuilds"] = registry.generation.get(name, 0)
            out[name] = CommStats(**entry)
        return out
