"""Ranks (two unless WORLD says) exercising rlmem.comm; each rank writes what it observed to OUT.rank<N>.json.

host:         Gloo groups on CPU with a host-only driver standing in for NCCL (the state machine, the guard,
              group resolution, errors and PhaseManager wiring run for real; the driver counts suspends and
              simulates freed bytes).
host-rebuild: the same driver without a suspend API, so rlmem.comm falls back to destroying the groups' Gloo
              backends and building new ones: the collectives after each resume run on the rebuilt backends,
              reached through the group objects the program holds.
cuda:         NCCL groups, a GPU per rank, with the real binding (the libnccl torch loaded): NCCL's suspend
              where that NCCL has it, the rebuild fallback where it does not.
cuda-rebuild: NCCL groups with the rebuild fallback forced (method="rebuild").

Run in a fresh process: python tests/_comm.py MODE CYCLES OUT [WORLD]
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time
import warnings

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))

from _helpers import GROUP_TIMEOUT_S, free_port, spawn

import rlmem
from rlmem import comm
from rlmem.comm import _nccl
from rlmem.comm._suspend import registry

MiB = 1 << 20


class HostDriver:
    """Stands in for NCCL on Gloo groups: a communicator per group name, 8 MiB suspendable each."""

    describe = "host stand-in"

    def __init__(self, can_suspend: bool = True) -> None:
        self.can_suspend = can_suspend
        self.backend_type = dist.ProcessGroup.BackendType.GLOO
        self.destroyed: list = []  # Gloo backends destroyed by the fallback (kept, so identity holds)
        self.created = 0
        self.state: dict[int, bool] = {}
        self.calls: list[tuple[str, str]] = []
        self.fail_async: set[int] = set()
        self.names: dict[int, str] = {}

    def handles(self, pg):
        return "gloo" in str(dist.get_backend(pg))

    def comm(self, pg):
        c = abs(hash(pg.group_name)) % (1 << 40) + 1
        if getattr(self, "rebuild_ids", None) is not None:
            # Which backend carries the group now: proves the fallback's forwarding reached a rebuilt one.
            self.rebuild_ids.append(pg._get_backend(torch.device("cpu")))
        self.names[c] = pg.group_name
        self.state.setdefault(c, False)
        return c

    def sync(self):
        pass

    def free_bytes(self):
        return (1 << 30) + 8 * MiB * (sum(self.state.values()) + len(self.destroyed) - self.created)

    def async_error(self, c):
        return 7 if c in self.fail_async else 0

    def suspend(self, c):
        assert not self.state[c], "suspended twice"
        self.state[c] = True
        self.calls.append(("suspend", self.names[c]))

    def resume(self, c):
        assert self.state[c], "resumed while active"
        self.state[c] = False
        self.calls.append(("resume", self.names[c]))

    def is_comm(self, backend):
        return type(backend).__name__ == "ProcessGroupGloo"

    def destroy(self, backend):
        assert all(b is not backend for b in self.destroyed), "destroyed twice"
        self.destroyed.append(backend)
        self.calls.append(("destroy", ""))
        backend.abort()

    def new_backend(self, store, rank, size, old):
        self.created += 1
        return dist.ProcessGroupGloo(store, rank, size, old.options._timeout)

    def connect(self, backend):
        pass

    def mem_stat(self, c, stat):
        return {
            _nccl.STAT_SUSPEND: 8 * MiB,
            _nccl.STAT_PERSIST: MiB,
            _nccl.STAT_TOTAL: 9 * MiB,
            _nccl.STAT_SUSPENDED: int(self.state[c]),
        }[stat]


def check_collectives(rank: int, world: int, groups: list, device: str) -> None:
    for g in groups:
        n = dist.get_world_size(g)
        t = torch.full((1000,), float(rank + 1), device=device)
        dist.all_reduce(t, group=g)
        ranks = dist.get_process_group_ranks(g)
        assert torch.equal(t, torch.full_like(t, float(sum(r + 1 for r in ranks)))), "all_reduce"
        out = torch.empty(n * 1000, device=device)
        dist.all_gather_into_tensor(out, torch.full((1000,), float(rank), device=device), group=g)
        want = torch.cat([torch.full((1000,), float(r), device=device) for r in ranks])
        assert torch.equal(out, want), "all_gather"


def expect_error(fn, exc, match: str) -> str:
    try:
        fn()
    except exc as e:
        assert match in str(e), str(e)
        return str(e)
    raise AssertionError(f"expected {exc.__name__}")


def worker(rank: int, world: int, mode: str, cycles: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    res: dict = {"rank": rank}
    bounded = datetime.timedelta(seconds=GROUP_TIMEOUT_S)  # a peer gone or stuck ends a collective then
    if mode.startswith("cuda"):
        torch.cuda.set_device(rank)
        cuda = torch.device("cuda", rank)
        dist.init_process_group("nccl", rank=rank, world_size=world, device_id=cuda, timeout=bounded)
        device = f"cuda:{rank}"
    else:
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=bounded)
        device = "cpu"
        registry.driver = HostDriver(can_suspend=mode != "host-rebuild")
    method = "rebuild" if mode == "cuda-rebuild" else "auto"
    res["method"] = method
    original = dist.ProcessGroup.__dict__["allreduce"]
    try:
        # TP/DP-like splits: the world, one group per rank, and a second world-sized group.
        singles = [dist.new_group([r]) for r in range(world)]
        mine = singles[rank]
        pair = dist.new_group(list(range(world)))
        world_pg = dist.group.WORLD
        groups = [world_pg, mine, pair]
        check_collectives(rank, world, groups, device)
        drv = registry.get_driver()
        res["nccl"] = drv.describe
        res["can_suspend"] = drv.can_suspend
        if mode.startswith("cuda"):
            if not drv.can_suspend:
                res["no_suspend_error"] = expect_error(
                    lambda: comm.suspend(method="suspend"), RuntimeError, "needs NCCL >="
                )
                if mode == "cuda":
                    dist.barrier()  # both ranks done with the groups before either destroys them
                    return  # "auto" is the rebuild fallback here: the cuda-rebuild run covers it
        else:
            res["errors"] = [
                expect_error(lambda: comm.suspend("world"), ValueError, "group must be"),
                expect_error(lambda: comm.suspend([world_pg, 3]), ValueError, "group must be"),
                expect_error(lambda: comm.suspend(world_pg, method="destroy"), ValueError, "method must be"),
            ]
            drv.fail_async.add(drv.comm(pair))
            res["errors"].append(expect_error(lambda: comm.suspend(groups), RuntimeError, "pending"))
            assert comm.suspended() == [] and not any(drv.state.values()), "a failed suspend freed"
            assert drv.destroyed == [], "a failed suspend destroyed a backend"
            drv.fail_async.clear()
            if mode == "host-rebuild":
                drv.rebuild_ids = []
        stats0 = comm.memory_stats()
        res["groups"] = sorted(stats0)
        res["suspendable"] = {k: v.suspendable_bytes for k, v in stats0.items()}
        res["cycles"] = []
        for i in range(cycles):
            free0 = torch.cuda.mem_get_info()[0] if mode.startswith("cuda") else None
            if i < 2:
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    s = comm.suspend(method=method)
                res.setdefault("warnings", []).extend(str(w.message) for w in caught)
            else:
                s = comm.suspend(method=method)
            res.setdefault("methods", []).append(s.method)
            again = comm.suspend(method=method)  # idempotent: nothing left to suspend
            if i == 0:
                res["first_freed"] = {k: v.freed_bytes for k, v in comm.memory_stats().items()}
            assert again.groups == [], again
            st = comm.memory_stats()
            assert all(v.suspended for v in st.values()), st
            if i == 0:
                res["guard"] = expect_error(
                    lambda: dist.all_reduce(torch.ones(4, device=device), group=pair),
                    comm.GroupSuspendedError,
                    "suspended",
                )
                expect_error(lambda: dist.barrier(), comm.GroupSuspendedError, "suspended")
            free1 = torch.cuda.mem_get_info()[0] if mode.startswith("cuda") else None
            if i < 2:
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    r = comm.resume()
                res["warnings"].extend(str(w.message) for w in caught)
            else:
                r = comm.resume()
            assert comm.suspended() == [] and comm.resume().groups == []
            check_collectives(rank, world, groups, device)
            res["cycles"].append(
                {
                    "suspend_s": s.seconds,
                    "resume_s": r.seconds,
                    "freed_bytes": s.freed_bytes,
                    "taken_bytes": r.taken_bytes,
                    "free_rise": None if free0 is None else free1 - free0,
                }
            )
        # resume_on_use: the first collective on any of them brings them all back, then runs.
        s = comm.suspend(method=method, resume_on_use=True)
        res["on_use_suspended"] = sorted(s.groups)
        check_collectives(rank, world, [pair], device)
        res["on_use_after"] = comm.suspended()
        check_collectives(rank, world, groups, device)
        res["methods_restored"] = dist.ProcessGroup.__dict__["allreduce"] is original
        res["guard_removed"] = registry.originals == {}
        res["rebuilt_objects"] = sum(registry.now(g) is not g for g in groups)
        # PhaseManager: the train phase's groups sleep during rollout.
        model = torch.nn.Linear(8, 8, device=device)
        pm = rlmem.PhaseManager(
            model, None, rlmem.OffloadConfig(offload_during_rollout=True, comms="suspend"), comm_groups=[pair]
        )
        with pm.rollout():
            res["rollout_suspended"] = comm.suspended()
            expect_error(lambda: dist.all_reduce(torch.ones(2, device=device), group=pair), RuntimeError, "")
            dist.all_reduce(torch.ones(2, device=device), group=mine)  # not a train group: still works
        with pm.train():
            res["train_suspended"] = comm.suspended()
            check_collectives(rank, world, [pair], device)
        # A collective the program needs before its next train phase (a checkpoint, the run's last barrier).
        with pm.rollout():
            pm.resume_comms()
            res["resumed_in_rollout"] = comm.suspended()
            check_collectives(rank, world, [pair], device)
        with pm.train():
            res["train_after_resume"] = comm.suspended()
        res["stats"] = {k: v.as_dict() for k, v in comm.memory_stats(pair).items()}
        if mode.startswith("host"):
            res["calls_head"] = drv.calls[:4]
            res["distinct_backends_seen"] = len({id(b) for b in getattr(drv, "rebuild_ids", None) or []})
        dist.barrier()  # both ranks done with the groups before either destroys one
        for g in (pair, mine):
            dist.destroy_process_group(g)
        dist.destroy_process_group()
        # Destroying the groups drops the forwarding: torch's methods are its own again.
        res["restored_after_destroy"] = dist.ProcessGroup.__dict__["allreduce"] is original
    finally:
        with open(f"{out}.rank{rank}.json", "w") as f:
            json.dump(res, f, default=str)
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    mode, cycles, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    world = int(sys.argv[4]) if len(sys.argv) > 4 else 2
    t0 = time.perf_counter()
    spawn(worker, world, world, mode, cycles, free_port(), out)  # each rank leaves with os._exit once done
    print(f"done in {time.perf_counter() - t0:.1f} s")
