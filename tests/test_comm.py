"""rlmem.comm: NCCL communicator memory suspended and resumed with the process groups kept.

Two-rank runs happen in fresh processes (tests/_comm.py): on CPU with Gloo groups and a host stand-in for
NCCL (state machine, guard, errors, PhaseManager wiring), and on two GPUs with the real NCCL binding."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import rlmem
from rlmem import _nccl, comm

ROOT = Path(__file__).resolve().parent.parent
MiB = 1 << 20


def _run(mode: str, cycles: int, tmp_path: Path) -> list[dict]:
    out = tmp_path / "comm"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "_comm.py"), mode, str(cycles), str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [json.loads((tmp_path / f"comm.rank{r}.json").read_text()) for r in (0, 1)]


def test_version_strings():
    assert _nccl.version_string(22907) == "2.29.7"
    assert _nccl.version_string(23203) == "2.32.3"
    assert _nccl.version_string(2708) == "2.7.8"
    assert _nccl.SUSPEND_VERSION == 22907


def test_needs_an_initialised_process_group():
    with pytest.raises(RuntimeError, match="not initialized"):
        comm.memory_stats()


def test_offload_config_comms_is_validated():
    assert rlmem.OffloadConfig().comms == "keep"
    with pytest.raises(ValueError, match=r"OffloadConfig\.comms"):
        rlmem.OffloadConfig(comms="destroy")


def test_two_ranks_host_stand_in(tmp_path):
    ranks = _run("host", 50, tmp_path)
    for r in ranks:
        assert len(r["errors"]) == 3 and "Nothing was suspended" in r["errors"][2]
        assert "'allreduce' cannot run" in r["guard"]
        assert len(r["cycles"]) == 50
        # world, this rank's own group, the pair: 8 MiB each in the stand-in
        assert all(c["freed_bytes"] == 3 * 8 * MiB == c["taken_bytes"] for c in r["cycles"])
        assert r["methods_restored"] and r["guard_removed"]
        assert r["train_suspended"] == [] and len(r["rollout_suspended"]) == 1
        pair = r["rollout_suspended"][0]
        assert r["stats"][pair]["suspends"] == 51 and r["stats"][pair]["resumes"] == 51
    # Both ranks suspend the shared groups in the same order (NCCL synchronises inside each call).
    shared = [[c for c in r["calls_head"] if c[1] in ("0", ranks[0]["rollout_suspended"][0])] for r in ranks]
    assert shared[0] == shared[1]


@pytest.mark.gpus(2)
def test_two_gpus_suspend_resume_50_cycles(tmp_path):
    ranks = _run("cuda", 50, tmp_path)
    for r in ranks:
        if "no_suspend_error" in r:
            # The NCCL torch loaded predates ncclCommSuspend: a clear error naming what would do better.
            assert "2.29.7" in r["no_suspend_error"] and "LD_PRELOAD" in r["no_suspend_error"]
            pytest.skip(f"loaded NCCL has no suspend API ({r['nccl']})")
        suspendable = sum(v or 0 for v in r["suspendable"].values())
        assert suspendable > 0, r["suspendable"]
        assert len(r["cycles"]) == 50
        for c in r["cycles"]:
            assert c["free_rise"] >= 0.9 * suspendable, (c, suspendable)
        assert "'allreduce' cannot run" in r["guard"]
        assert r["methods_restored"] and r["guard_removed"]
        assert r["train_suspended"] == []
