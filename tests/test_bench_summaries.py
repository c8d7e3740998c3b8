"""Benchmark summaries: the figures targets are checked against, formed from rows (synthetic here)."""

from __future__ import annotations

import pytest

from rlmem.benchmarks import activations, comm

GB = 1e9


def _row(step, fwd=None, peak=100, off=0):
    r = {"step_s": step, "peak_bytes": peak, "offloaded_bytes": off}
    if fwd is not None:
        r["forward_s"] = fwd
    return r


def test_activations_summary_takes_auto_from_every_model_and_ckpt_from_the_long_point():
    link = {"d2h_bytes_per_s": 50 * GB, "h2d_bytes_per_s": 50 * GB}
    res = {
        "qwen2-2.5b": {
            "2x2048": {"none": _row(1.0, 0.4, 100), "rlmem:auto": _row(1.02, off=int(15 * GB))},
            "4x4096": {
                "none": _row(2.0, 0.8, 200),
                "rlmem:auto": _row(2.04, off=int(36 * GB)),
                "ckpt": _row(2.5, peak=120),
                "rlmem:ckpt+off": _row(2.55, peak=121),
            },
            "1x32768": {"long": True, "ckpt": _row(3.0, peak=200), "rlmem:ckpt+off": _row(3.1, peak=150)},
        },
        "qwen2-gqa-small": {"2x4096": {"none": _row(0.5, 0.2), "rlmem:auto": _row(0.55, off=int(5 * GB))}},
    }
    s = activations.summarize(res, link)
    # at each model's largest grid point (the long point is not in the grid)
    assert s["auto_by_model"]["qwen2-2.5b"]["overhead"] == pytest.approx(0.02)
    assert s["auto_by_model"]["qwen2-2.5b"]["hidden"] == pytest.approx(36 / 40)
    assert s["auto_by_model"]["qwen2-gqa-small"]["hidden"] == pytest.approx(5 / 10)
    assert s["auto_overhead_max"] == pytest.approx(0.1) and s["auto_hidden_min"] == pytest.approx(0.5)
    assert s["auto_points"]["qwen2-2.5b"]["2x2048"]["overhead"] == pytest.approx(0.02)
    assert "auto_overhead_small_max" not in s  # no point says how many activation bytes there were
    assert s["ckpt_offload_point"] == "1x32768"
    assert s["ckpt_offload_peak_vs_ckpt"] == pytest.approx(0.75)
    assert s["grid_ckpt_offload_peak_vs_ckpt"] == pytest.approx(121 / 120)


def _rank(sr, freed, busbw, exposed=None):
    point = {"suspend_s": sr / 2, "resume_s": sr / 2, "first_collective_s": 0.0}
    point.update(suspendable_bytes=800, freed_bytes=freed)
    point.update(rebuild_suspend_s=1.0, rebuild_resume_s=0.5, rebuild_first_collective_s=0.5)
    point.update(rebuild_freed_bytes=800, destroy_s=1.0, recreate_s=1.0)
    r = {"can_suspend": True, "busbw_bytes_per_s": busbw, "points": {"8": point}}
    if exposed is not None:
        r["phase"] = {"exposed_comm_s": exposed, "state_bytes": 1}
    return r


def test_comm_summary_slowest_rank_variants_and_exposure():
    ranks = [_rank(3.0, 800, 280 * GB, 2.9), _rank(3.6, 792, 285 * GB, 3.5)]
    lean = [_rank(0.6, 800, 80 * GB), _rank(0.5, 800, 82 * GB)]
    s = comm.summarize(ranks, {"default": ranks, "lean": lean})
    assert s["suspend_resume_s"] == pytest.approx(3.6) and s["recreate_s"] == pytest.approx(2.0)
    assert s["speedup_vs_recreate"] == pytest.approx(2.0 / 3.6)
    assert s["freed_fraction"] == pytest.approx(0.99) and s["exposed_comm_s"] == pytest.approx(3.5)
    v = s["variants"]["lean"]
    assert v["suspend_resume_s"] == pytest.approx(0.6) and v["busbw_gb_per_s"] == pytest.approx(80)
    assert v["speedup_vs_recreate"] == pytest.approx(2.0 / 0.6) and v["suspendable_bytes_per_group"] == 100


def test_grpo_colocated_parts_make_valid_recipe_configs(tmp_path):
    import argparse

    from rlmem.benchmarks import grpo_colocated

    args = argparse.Namespace(
        model="qwen2-2.7b-mha", device="cuda:0", steps=2, prompts=29, group=16, max_new_tokens=512,
        micro_batch=2, kv_big_gib=52.0, kv_fit_gib=20.0, rollout_dtype=None, gpus=1,
    )  # fmt: skip
    for part in grpo_colocated.PARTS:
        cfg = grpo_colocated._config(args, part, str(tmp_path))
        assert cfg.device == "cuda" and cfg.offload == (not part.endswith("-nooffload"))
        assert cfg.overlap_offload == (part == "big-overlap")
        assert cfg.prompts_per_step == 29
    args.gpus = 2  # each GPU the one-GPU workload
    assert grpo_colocated._config(args, "big-offload", str(tmp_path)).prompts_per_step == 58


def test_grpo_colocated_summary_says_what_the_overlap_leaves_exposed():
    from rlmem.benchmarks import grpo_colocated

    def part(switch_s: float, rollout_s: float) -> dict:
        last = {"switch_s": switch_s, "rollout_s": rollout_s, "step_s": 50.0, "tokens_per_s": 1e4}
        last.update(kv_bytes=0, peak_rollout=0, peak_train=0)
        return {"last": last}

    s = grpo_colocated.summarize({"big-offload": part(1.0, 20.0), "big-overlap": part(0.25, 20.5)})
    assert s["overlap_exposed_s"] == pytest.approx(0.75) and s["overlap_saved_s"] == pytest.approx(0.25)
    assert s["switch_share_of_step_overlap"] == pytest.approx(0.005)


def test_real_model_summary_reads_the_eval_curve_and_compares_the_two_runs():
    from rlmem.benchmarks import real_model

    def part(rewards, losses, evals):
        steps = [{"step": i, "reward": r, "step_s": 2.0, "switch_s": 0.05} for i, r in enumerate(rewards)]
        rows = [{"eval_step": k, "eval/reward": v} for k, v in evals]
        return {
            "steps": steps,
            "evals": rows,
            "rewards": rewards,
            "losses": losses,
            "checkpoint_loads_plain": True,
        }

    on = part([0.1, 0.3], [0.5, 0.25], [(0, 0.3), (1, 0.4), (2, 0.6)])
    s = real_model.summarize(
        {"offload": on, "nooffload": part([0.1, 0.3], [0.5, 0.25], [(0, 0.3), (2, 0.6)])}
    )
    assert s["eval_reward_before"] == 0.3 and s["eval_reward_after"] == 0.6
    assert s["eval_gain"] == pytest.approx(0.3) and s["switch_share_of_step"] == pytest.approx(0.025)
    assert s["offload_identical"] is True and s["checkpoint_loads_plain"] is True and s["step_s"] == 2.0
    off = part([0.1, 0.3], [0.5, 0.2500001], [(0, 0.3), (2, 0.6)])
    assert real_model.summarize({"offload": on, "nooffload": off})["offload_identical"] is False
    # step times are compared only between parts of one invocation (merged parts may be other machines)
    assert "offload_step_ratio" not in s
    slow = part([0.1, 0.3], [0.5, 0.25], [(0, 0.3), (2, 0.6)])
    for st in slow["steps"]:
        st["step_s"] = 1.6
    s = real_model.summarize({"offload": {**on, "invocation": "a"}, "nooffload": {**slow, "invocation": "a"}})
    assert s["offload_step_ratio"] == pytest.approx(1.25)
    s = real_model.summarize({"offload": {**on, "invocation": "a"}, "nooffload": {**slow, "invocation": "b"}})
    assert "offload_step_ratio" not in s and s["step_s_nooffload"] == 1.6
    # each step against its twin, the first (capture, compilation) left out
    on["steps"][0]["step_s"], slow["steps"][1]["step_s"] = 9.0, 1.0
    s = real_model.summarize({"offload": {**on, "invocation": "a"}, "nooffload": {**slow, "invocation": "a"}})
    assert s["offload_step_ratio_paired"] == pytest.approx(2.0) and s["offload_extra_s_paired"] == 1.0


def test_colocate_summary_compares_the_three_syncs_with_the_bound():
    from rlmem.benchmarks import colocate

    res = {
        "attach": {"median_ms": 1.8},
        "sync": {
            "bound_s": 0.005,
            "shared_s": [0.0062, 0.0065, 0.0070],
            "ipc_s": [2.0, 2.2],
            "bucketed_s": [0.030, 0.031, 0.029],
            "intact": {"shared": True, "ipc": True, "bucketed": True},
        },
    }
    s = colocate.summarize(res)
    assert s["attach_8gib_ms"] == 1.8 and s["sync_ms"] == pytest.approx(6.5)
    assert s["sync_vs_bound"] == pytest.approx(0.005 / 0.0065)
    assert s["sync_speedup_vs_ipc"] == pytest.approx(2.1 / 0.0065)
    assert s["sync_speedup_vs_bucketed"] == pytest.approx(0.030 / 0.0065) and s["sync_intact"] is True


def test_grpo_server_summary_compares_the_two_processes_with_one():
    from rlmem.benchmarks import grpo_colocated

    def part(step_s: float, kv: int, sync: float = 0.0065) -> dict:
        last = {"step_s": step_s, "switch_s": 0.8, "tokens_per_s": 2e4, "kv_bytes": kv, "sync_s": sync}
        last.update(peak_rollout=0, peak_train=0)
        phases = {"rollout": {"max_server_kv_cache": kv, "max_server_torch_cache": 1 << 29}}
        return {"oom": False, "last": last, "phases": phases}

    res = {"server-big-offload": part(51.3, 50 << 30), "big-offload": part(52.7, 50 << 30)}
    s = grpo_colocated.summarize_server({**res, "server-big-nooffload": {"oom": True}})
    assert s["fits_with_rlmem"] and s["oom_or_smaller_kv_without"]
    assert s["step_vs_single_process"] == pytest.approx(51.3 / 52.7)
    assert s["switch_share"] == pytest.approx(0.8 / 51.3) and s["sync_s"] == 0.0065
    assert s["server_peak_rollout_gib_server"] == pytest.approx(50.5)
    # Without the handoff: a smaller cache that fits counts; the same cache does not.
    smaller = grpo_colocated.summarize_server({**res, "server-big-nooffload": part(60.0, 16 << 30)})
    same = grpo_colocated.summarize_server({**res, "server-big-nooffload": part(60.0, 50 << 30)})
    assert smaller["oom_or_smaller_kv_without"] and not same["oom_or_smaller_kv_without"]


def test_rollout_summary_takes_the_gqa_keys_from_the_gqa_preset_whatever_the_order():
    from rlmem.benchmarks import rollout

    def b64(
        bound: float, graph: float, hf: float, call: float, hf_call: float, off: float | None = None
    ) -> dict:
        r = {
            "bound_ms": bound,
            "rlmem_eager": {"ms_per_step": 30.0},
            "rlmem_graphs": {"ms_per_step": graph, "call_s": call},
            "hf_static": {"ms_per_step": hf, "call_s": hf_call},
        }
        if off is not None:
            r["rlmem_graphs_gqa_off"] = {"ms_per_step": off}
        return {"batches": {"64": r}}

    res = {rollout.MHA: b64(2.8, 5.0, 7.0, 1.3, 1.8), rollout.GQA: b64(1.77, 3.93, 8.6, 1.09, 2.25, 8.51)}
    extra = {
        "varlen": {"speedup": 1.6, "greedy": {"speedup": 1.8, "same_tokens": True}},
        "capture": {"capture_s": 10.0},
        "recapture": {"recaptures": 0, "same_tokens": True},
    }
    s = rollout.summarize(res, extra)
    assert s["gqa_graph_vs_bound_b64"] == pytest.approx(1.77 / 3.93)
    assert s["gqa_speedup_vs_hf_static_b64"] == pytest.approx(2.25 / 1.09)
    assert s["gqa_step_speedup_vs_transformers_attention_b64"] == pytest.approx(8.51 / 3.93)
    assert s["graph_vs_bound_b64"] == pytest.approx(2.8 / 5.0) and s["speedup_vs_hf_generate_b64"] == 1.4
    assert s["varlen_speedup_vs_static"] == 1.6 and s["varlen_greedy_speedup_vs_static"] == 1.8
    assert s["recaptures_over_100_cycles"] == 0 and s["capture_s"] == 10.0


def test_activations_auto_overhead_is_over_the_interleaved_steps_at_every_point():
    link = {"d2h_bytes_per_s": 50 * GB, "h2d_bytes_per_s": 50 * GB}

    def auto(step, plain, off, act):
        return {**_row(step, off=off), "none_step_s": plain, "activation_bytes": act}

    res = {
        "mixtral-small": {
            # none's block ran faster than the steps interleaved with auto's: the pairs count
            "2x2048": {"none": _row(0.070, 0.03), "rlmem:auto": auto(0.0836, 0.0820, 0, 100)},
            "4x4096": {"none": _row(0.125, 0.05), "rlmem:auto": auto(0.1275, 0.1250, 30, 100)},
        },
        "gpt2-tied": {"2x2048": {"rlmem:auto": auto(0.0505, 0.050, 5, 100)}},  # --only rlmem:auto
    }
    s = activations.summarize(res, link, dict.fromkeys(res, link))
    pts = s["auto_points"]
    assert pts["mixtral-small"]["2x2048"]["overhead"] == pytest.approx(0.0836 / 0.0820 - 1)
    assert pts["mixtral-small"]["2x2048"]["interleaved"] is True
    assert s["auto_overhead_max"] == pytest.approx(0.02)  # 4x4096: 0.1275 / 0.125, over every point
    # where it offloaded under a tenth of the activations: mixtral 2x2048 (0) and gpt2 (5%)
    assert s["auto_overhead_small_max"] == pytest.approx(0.0836 / 0.0820 - 1)
    assert s["auto_by_model"]["mixtral-small"]["hidden"] == pytest.approx(30 / (50 * GB * 0.05))
    assert "hidden" not in s["auto_by_model"]["gpt2-tied"]  # no none at its point: no forward time


def test_activations_summary_of_the_main_model_run_with_auto_alone_keeps_the_auto_figures():
    """``--only rlmem:auto`` on qwen2-2.5b leaves its points without the ``none`` contender the grid's
    figures divide by: the summary keeps the auto figures instead of failing after the measurements."""
    link = {"d2h_bytes_per_s": 50 * GB, "h2d_bytes_per_s": 50 * GB}
    auto = {**_row(1.02, off=int(15 * GB)), "interleaved": True, "none_step_s": 1.0}
    s = activations.summarize({"qwen2-2.5b": {"2x2048": {"rlmem:auto": auto}}}, link)
    assert "best_config_at_5pct" not in s and "link_bound_bytes" not in s
    assert s["auto_by_model"]["qwen2-2.5b"]["offloaded_bytes"] == int(15 * GB)


def test_merge_refuses_a_file_measured_on_another_device(tmp_path):
    import json

    from rlmem.benchmarks._harness import Run

    path = tmp_path / "x.json"
    run = Run("x", "a benchmark")
    run.parse(["--device", "cpu", "--json", str(path)])
    assert run.previous_file() == {}  # nothing yet
    here = {"device": {"name": "elsewhere"}, "results": {"a": 1}}
    path.write_text(json.dumps(here))
    with pytest.raises(SystemExit):
        run.previous_file()
    from rlmem.benchmarks._common import environment

    here["device"] = environment(run.device)["device"]
    path.write_text(json.dumps(here))
    assert run.previous() == {"a": 1}
