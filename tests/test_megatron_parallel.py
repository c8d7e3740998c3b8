"""Megatron-Core on two ranks under ``rlmem.TrainState``: tensor parallel (TP=2), two pipeline stages (PP=2)
and data parallel (DP=2), each rank's DDP buffers, main parameters and optimizer states leaving the device
every step and coming back; its losses and weights bit-identical to a trainer that never offloads, nothing
of the adopted state left resident while away, the weights and main parameters readable meanwhile; under
TP, activations offloaded with Megatron's names leave the gradients bit-equal. On two Gloo ranks through the
host backend (``tests/megatron_parallel_rank.py`` says what is redirected there), and on two GPUs with
Megatron's distributed optimizer, and sequence parallelism under TP."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from _helpers import ROOT

pytest.importorskip("megatron.core")

_RANK = Path(__file__).with_name("megatron_parallel_rank.py")


def _run(tmp_path: Path, layout: str, *extra: str) -> list[dict]:
    run = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    proc = subprocess.run(
        [*run, str(_RANK), layout, str(tmp_path), *extra],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])},
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-5000:]
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]


def _check(ranks: list[dict], layout: str) -> None:
    sizes = {"tp2": (2, 1, 1), "pp2": (1, 2, 1), "dp2": (1, 1, 2)}[layout]
    for r in ranks:
        assert (r["tp"], r["pp"], r["dp"]) == sizes
        assert r["losses"] == r["ref"] and r["same_params"] and r["same_main"], r
        for c in r["checks"]:
            assert c["resident"] == 0 and c["bytes"] > 0  # every adopted byte away: freed fraction 1.0
            assert c["params_read"] and c["main_read"]
    assert ranks[0]["losses"] == ranks[1]["losses"]  # one loss per step, every rank the same
    if layout == "pp2":  # each rank its own stage of the model
        assert [r["stage"] for r in ranks] == ["first", "last"]
        assert ranks[0]["n_params"] != ranks[1]["n_params"]
    if layout == "tp2":
        assert all(r["activations_offloaded_grads_equal"] for r in ranks)
        assert all(r["activations_offloaded_bytes"] > 0 for r in ranks)


@pytest.mark.parametrize("layout", ["tp2", "pp2", "dp2"])
def test_two_cpu_ranks(tmp_path, layout):
    _check(_run(tmp_path, layout), layout)


@pytest.mark.gpus(2)
@pytest.mark.parametrize("layout,extra", [("tp2", ()), ("tp2", ("--sp",)), ("pp2", ()), ("dp2", ())])
def test_two_gpus(tmp_path, layout, extra):
    ranks = _run(tmp_path, layout, "--device", "cuda", *extra)
    _check(ranks, layout)
    assert all(r["sequence_parallel"] == bool(extra) for r in ranks)
