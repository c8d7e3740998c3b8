"""``rlmem bench megatron_parallel``: Megatron-Core on two ranks under ``rlmem.TrainState`` with tensor
parallelism (TP=2), two pipeline stages (PP=2) and data parallelism (DP=2): each rank's DDP buffers, main
parameters and optimizer states leave the device every step and come back, and its losses, weights and main
parameters are bit-identical to a trainer that never offloads; nothing of the state stays resident while
away, the weights and main parameters read meanwhile are the same; under TP, offloading the activations of
every Megatron name leaves the gradients bit-equal. Two Gloo ranks (the host backend) in CI; on two GPUs
with Megatron's distributed optimizer and sequence parallelism (``scripts/gpu_check.sh two-gpu``)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("megatron.core")

from rlmem.benchmarks import megatron_parallel


def _run(tmp_path, *argv: str) -> dict:
    out = tmp_path / "mp.json"
    assert megatron_parallel.main([*argv, "--json", str(out)]) == 0
    return json.loads(out.read_text())


def _check(data: dict) -> None:
    for layout, r in data["results"].items():
        ranks = r["ranks"]
        assert [x["rank"] for x in ranks] == [0, 1]
        for x in ranks:
            assert x["losses"] == x["ref"] and x["same_params"] and x["same_main"], (layout, x)
            assert len(x["cycles"]) == 3
            for c in x["cycles"]:
                assert c["params_read"] and c["main_read"] and c["moved_bytes"] > 0
        assert ranks[0]["losses"] == ranks[1]["losses"]  # one loss per step on every rank
    pp = data["results"]["pp2"]["ranks"]
    assert [x["stage"] for x in pp] == ["first", "last"] and pp[0]["n_params"] != pp[1]["n_params"]
    assert data["summary"]["act_grads_bit_equal"] is True
    # each rank holds its shard of the tensor-parallel model: less than a whole model's
    whole = data["results"]["dp2"]["ranks"][0]["n_params"]
    assert all(x["n_params"] < whole for x in data["results"]["tp2"]["ranks"])


def test_two_cpu_ranks(tmp_path):
    data = _run(tmp_path, "--device", "cpu")
    s = data["summary"]
    assert s["tp2_bit_identical"] and s["pp2_bit_identical"] and s["dp2_bit_identical"]
    assert s["freed_fraction_min"] == 1.0  # nothing of the adopted state resident while away
    _check(data)


@pytest.mark.gpus(2)
def test_two_gpus(tmp_path):
    data = _run(tmp_path, "--device", "cuda", "--shape", "2,256,4,512,64,2")
    s = data["summary"]
    assert s["tp2_bit_identical"] and s["tp2_sp_bit_identical"] and s["pp2_bit_identical"]
    assert s["dp2_distopt_bit_identical"]
    assert s["act_grads_bit_equal"] and s["act_grads_layouts"] == ["tp2", "tp2-sp"]  # SP off and on
    assert s["freed_fraction_min"] >= 0.99 - 64 * 2**20 / min(
        x["held_bytes"] for r in data["results"].values() for x in r["ranks"]
    )
    _check(data)
