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


# Run `python -m rlmem ARGS` with the named top-level packages made uninstalled: importing one (or a module
# of it) raises ModuleNotFoundError as for a package that is not there.
_WITHOUT = """
import importlib.abc, runpy, sys
class NotInstalled(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {hidden!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None
sys.meta_path.insert(0, NotInstalled())
sys.argv = ["rlmem", *{args!r}]
runpy.run_module("rlmem", run_name="__main__", alter_sys=True)
"""


def _rlmem_without(hidden: list[str], *args: str) -> subprocess.CompletedProcess:
    code = _WITHOUT.format(hidden=hidden, args=list(args))
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)


def test_serve_without_its_extra_names_it():
    p = _rlmem_without(["uvicorn"], "serve", "tiny", "--device", "cpu")
    assert p.returncode == 2, p.stderr[-2000:]
    assert "Traceback" not in p.stderr
    last = p.stderr.strip().splitlines()[-1]
    assert "rlmem serve needs rlmem's [serve] extra (uvicorn is not installed)" in last
    assert 'pip install -e ".[serve]"' in last


@pytest.mark.parametrize("hidden", ["transformers", "yaml"])
def test_train_without_its_extra_names_it_before_writing_anything(tmp_path, hidden):
    pytest.importorskip("transformers")
    out = tmp_path / "run"
    p = _rlmem_without([hidden], "train", "device=cpu", "steps=1", f"out_dir={out}")
    assert p.returncode == 2, p.stderr[-2000:]
    assert p.stderr.strip().splitlines() == [
        f"rlmem train: error: rlmem train needs rlmem's [train] extra ({hidden} is not installed): "
        'pip install -e ".[train]" (in a checkout of rlmem; else pip install "rlmem[train]")'
    ]
    assert not out.exists()


def test_reading_a_data_file_without_datasets_names_the_extra(tmp_path, monkeypatch):
    from rlmem.recipes.user_data import PromptData

    f = tmp_path / "d.jsonl"
    f.write_text('{"prompt": "1+1", "answer": "2"}\n')
    monkeypatch.setitem(sys.modules, "datasets", None)  # an import of it raises ModuleNotFoundError
    with pytest.raises(ValueError, match=r"needs rlmem's \[train\] extra \(datasets is not installed\)"):
        PromptData(str(f), tokenizer=None)
