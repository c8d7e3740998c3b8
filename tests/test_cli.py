"""The rlmem command: version, help, and the region benchmark end to end on the host backend."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from _helpers import ROOT

import rlmem


def _rlmem(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run(
        [sys.executable, "-m", "rlmem", *args], capture_output=True, text=True, env=env, timeout=300
    )


def test_version_and_help():
    p = _rlmem("--version")
    assert p.returncode == 0 and rlmem.__version__ in p.stdout
    p = _rlmem()
    assert p.returncode == 2 and "bench" in p.stdout


def test_bench_region_writes_every_figure(tmp_path):
    out = tmp_path / "region.json"
    p = _rlmem(
        "bench",
        "region",
        "--device",
        "cpu",
        "--sizes",
        "0.01,0.02",
        "--cycles",
        "2",
        "--discard-cycles",
        "2",
        "--chunk-sweep",
        "1,4",
        "--json",
        str(out),
    )
    assert p.returncode == 0, p.stderr
    assert "pause/pinned" in p.stdout and "summary:" in p.stdout
    data = json.loads(out.read_text())
    assert data["name"] == "region" and data["machine"] == "cpu"
    assert data["versions"]["torch"] and data["date"] and data["device"]["type"] == "cpu"
    assert [r["size_gib"] for r in data["rows"]] == [0.01, 0.02]
    for row in data["rows"]:
        assert row["intact"] is True
        assert row["freed_fraction"] >= 0.99
        for key in ("pinned_d2h_gbps", "pause_gbps", "resume_gbps", "naive_out_gbps", "discard_cycle_ms"):
            assert row[key] > 0
    assert len(data["chunk_sweep"]) == 2
    assert {"pause_vs_pinned", "resume_vs_pinned", "all_intact"} <= set(data["summary"])


def test_bench_region_rejects_bad_sizes():
    p = _rlmem("bench", "region", "--device", "cpu", "--sizes", "abc")
    assert p.returncode == 2 and "--sizes" in p.stderr
    p = _rlmem("bench", "unknown")
    assert p.returncode == 2


def test_bench_phase_switch_runs_its_contenders_on_cpu(tmp_path):
    out = tmp_path / "ps.json"
    p = _rlmem(
        "bench",
        "phase_switch",
        "--device",
        "cpu",
        "--parts",
        "rlmem,naive",
        "--cycles",
        "3",
        "--json",
        str(out),
    )
    assert p.returncode == 0, p.stderr
    data = json.loads(out.read_text())
    r = data["results"]["rlmem"]
    assert r["intact"] and r["state_bytes"] > 0 and len(r["cycles"]) == 3
    assert data["results"]["naive"]["intact"]
    assert {"speedup_vs_naive", "first_cycle_s", "freed_fraction"} <= set(data["summary"])


def test_bench_help_is_the_benchmarks_own(capsys) -> None:
    from rlmem.cli import main

    with pytest.raises(SystemExit) as e:
        main(["bench", "plan_accuracy", "--help"])
    assert e.value.code == 0
    assert "usage: rlmem bench plan_accuracy" in capsys.readouterr().out
