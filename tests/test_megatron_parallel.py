"""``rlmem bench megatron_parallel``: Megatron-Core under ``rlmem.TrainState`` on two ranks with tensor
parallelism (TP=2), two pipeline stages (PP=2) and data parallelism (DP=2), and on four with TP=2 x PP=2
(also with a virtual pipeline, two model chunks per stage) and TP=4: each rank's DDP buffers, main parameters
and optimizer states leave the device every step and come back, and its losses, weights and main parameters
are bit-identical to a trainer that never offloads; nothing of the state stays resident while away, the
weights and main parameters read meanwhile are the same; under TP, offloading the activations of every
Megatron name leaves the gradients bit-equal. Two and four Gloo ranks (the host backend) in CI; on two GPUs
with Megatron's distributed optimizer and sequence parallelism (``scripts/gpu_check.sh two-gpu``), on four
(``scripts/gpu_check.sh megatron-4``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("megatron.core")

from rlmem.benchmarks import megatron_parallel

FOUR = "tp2pp2,tp4,tp2pp2-vpp"


def _run(tmp_path, *argv: str) -> dict:
    out = tmp_path / "mp.json"
    assert megatron_parallel.main([*argv, "--json", str(out)]) == 0
    return json.loads(out.read_text())


def _check(data: dict) -> None:
    for layout, r in data["results"].items():
        ranks = r["ranks"]
        lay = megatron_parallel.LAYOUTS[layout]
        assert [x["rank"] for x in ranks] == list(range(lay.world))
        for x in ranks:
            assert x["losses"] == x["ref"] and x["same_params"] and x["same_main"], (layout, x)
            assert len(x["cycles"]) == 3
            for c in x["cycles"]:
                assert c["params_read"] and c["main_read"] and c["moved_bytes"] > 0
        assert all(x["losses"] == ranks[0]["losses"] for x in ranks)  # one loss per step on every rank
        if (
            lay.pp == 2
        ):  # Megatron's rank order puts the pipeline outermost: the first half is the first stage
            half = lay.world // 2
            assert [x["stage"] for x in ranks] == ["first"] * half + ["last"] * half
            assert ranks[0]["n_params"] != ranks[-1]["n_params"]


def _check_two(data: dict) -> None:
    _check(data)
    assert data["summary"]["act_grads_bit_equal"] is True
    # each rank holds its shard of the tensor-parallel model: less than a whole model's
    whole = data["results"]["dp2"]["ranks"][0]["n_params"]
    assert all(x["n_params"] < whole for x in data["results"]["tp2"]["ranks"])


def test_two_cpu_ranks(tmp_path):
    data = _run(tmp_path, "--device", "cpu")
    s = data["summary"]
    assert s["tp2_bit_identical"] and s["tp2_sp_bit_identical"]  # sequence parallel off and on
    assert s["pp2_bit_identical"] and s["dp2_bit_identical"]
    assert s["act_grads_layouts"] == ["tp2", "tp2-sp"]
    assert s["freed_fraction_min"] == 1.0  # nothing of the adopted state resident while away
    _check_two(data)


def test_four_cpu_ranks(tmp_path):
    # four layers: two stages of two model chunks each under the virtual pipeline
    data = _run(tmp_path, "--device", "cpu", "--layouts", FOUR, "--shape", "4,64,4,128,16,2")
    s = data["summary"]
    assert s["tp2pp2_bit_identical"] and s["tp2pp2_vpp_bit_identical"] and s["tp4_bit_identical"]
    assert s["freed_fraction_min"] == 1.0
    assert "act_grads_bit_equal" not in s  # measured on the two-rank tensor-parallel layouts only
    _check(data)


def test_a_shape_a_layout_cannot_split_is_refused(tmp_path, capsys):
    # two layers cannot make two stages of two model chunks: refused before any process starts
    with pytest.raises(SystemExit):
        megatron_parallel.main(["--device", "cpu", "--layouts", "tp2pp2-vpp", "--json", str(tmp_path / "x")])
    assert "layers must divide by 4" in capsys.readouterr().err


def test_summary_of_the_two_gpu_file():
    # the committed two-GPU figures summarize to what the file says under the keys it has (it was written
    # before act_grads_layouts), and every one is a target
    path = Path(__file__).parents[1] / "bench/results/megatron_parallel-nvidia-h200-x2.json"
    data = json.loads(path.read_text())
    s = megatron_parallel.summarize(data["results"])
    assert set(s) == {*data["summary"], "act_grads_layouts"}
    assert {k: s[k] for k in data["summary"]} == data["summary"]
    assert set(data["summary"]) <= set(megatron_parallel.TARGETS)


def test_comms_suspend_is_refused_on_the_host(tmp_path, capsys):
    with pytest.raises(SystemExit):
        megatron_parallel.main(["--device", "cpu", "--comms", "suspend", "--json", str(tmp_path / "x")])
    assert "--comms suspend" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_summary_of_the_four_gpu_file_and_the_rates_together():
    # the committed four-GPU figures (written before the rates with every rank copying at once) summarize
    # to what the file says
    path = Path(__file__).parents[1] / "bench/results/megatron_parallel-nvidia-h100-x4.json"
    data = json.loads(path.read_text())
    s = megatron_parallel.summarize(data["results"])
    assert {k: s[k] for k in data["summary"]} == data["summary"]
    assert "offload_vs_together_min" not in s and "comm_freed_bytes_min" not in s
    # with them: the least over every rank's steps after the first, as for the rates alone
    cyc = {"freed_fraction": 1.0, "params_read": True, "main_read": True, "offload_vs_pinned": 0.5}
    cyc |= {"reload_vs_pinned": 0.6, "offload_vs_together": 0.9, "reload_vs_together": 0.95}
    cyc |= {"comm_groups": 7, "comm_freed_bytes": 3 << 30}
    first = {**cyc, "offload_vs_together": 0.1, "comm_freed_bytes": 1}
    rank = {"losses": [1.0], "ref": [1.0], "same_params": True, "same_main": True, "act_grads_equal": None}
    ranks = [{**rank, "cycles": [first, cyc, {**cyc, "reload_vs_together": 0.92}]}] * 2
    s = megatron_parallel.summarize({"tp2": {"ranks": ranks}})
    assert s["offload_vs_together_min"] == 0.9 and s["reload_vs_together_min"] == 0.92
    assert s["comm_freed_bytes_min"] == 3 << 30 and s["comm_groups"] == 7
    assert s["offload_vs_pinned_min"] == 0.5 and s["tp2_bit_identical"]


@pytest.mark.gpus(2)
def test_two_gpus(tmp_path):
    data = _run(
        tmp_path, "--device", "cuda", "--layouts", "tp2,tp2-sp,pp2,dp2", "--shape", "2,256,4,512,64,2"
    )
    s = data["summary"]
    assert s["tp2_bit_identical"] and s["tp2_sp_bit_identical"] and s["pp2_bit_identical"]
    assert s["dp2_distopt_bit_identical"]
    assert s["act_grads_bit_equal"] and s["act_grads_layouts"] == ["tp2", "tp2-sp"]  # SP off and on
    assert s["freed_fraction_min"] >= 0.99 - 64 * 2**20 / _least_held(data)
    _check_two(data)


@pytest.mark.gpus(4)
def test_four_gpus(tmp_path):
    data = _run(tmp_path, "--device", "cuda", "--layouts", FOUR, "--shape", "4,256,4,512,64,2")
    s = data["summary"]
    assert s["tp2pp2_bit_identical"] and s["tp2pp2_vpp_bit_identical"] and s["tp4_bit_identical"]
    assert s["freed_fraction_min"] >= 0.99 - 64 * 2**20 / _least_held(data)
    _check(data)


@pytest.mark.gpus(2)
def test_comms_suspended_while_the_state_is_away(tmp_path):
    # every NCCL group of each rank (Megatron's, created eagerly) suspended after each offload and resumed
    # before the reload: the steps after run on them, bit-identical
    from rlmem.comm import nccl_driver

    if not nccl_driver().can_suspend:
        pytest.skip(f"{nccl_driver().describe} has no ncclCommSuspend (scripts/nccl_parts.sh)")
    argv = ("--device", "cuda", "--layouts", "tp2,pp2", "--shape", "2,256,4,512,64,2", "--comms", "suspend")
    data = _run(tmp_path, *argv)
    s = data["summary"]
    assert s["tp2_bit_identical"] and s["pp2_bit_identical"]
    assert s["comm_freed_bytes_min"] > 0 and s["comm_groups"] >= 2
    _check(data)


def _least_held(data: dict) -> int:
    """The smallest state a rank held (the allocator's slack counts more against it)."""
    return min(x["held_bytes"] for r in data["results"].values() for x in r["ranks"])
