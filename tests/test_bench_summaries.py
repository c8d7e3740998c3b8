"""Benchmark summaries: the figures targets are checked against, formed from rows (synthetic here, or a
committed result's)."""

from __future__ import annotations

from pathlib import Path

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
    args.gpus = 4
    for part in grpo_colocated.SERVER_PARTS + grpo_colocated.SERVER_EXTRA_PARTS:
        cfg = grpo_colocated._config(args, part, str(tmp_path))
        assert cfg.engine == ("server" if part.startswith("server-") else "local")
        assert cfg.prompts_per_step == 4 * 29 and cfg.offload == (not part.endswith("-nooffload"))
        # only the part that asks for it suspends the trainer's communicators, with the handoff's budget
        assert cfg.comms == ("suspend" if part == "server-big-suspend" else "keep")
    assert grpo_colocated._config(args, "server-big-suspend", str(tmp_path)).kv_budget == "52.0GiB"


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


def _server_part(step_s: float, world: int, *, freed: list[int] | None = None, server: bool = True) -> dict:
    """A part of the server benchmark as its lead rank reports it, with every rank's phases."""
    last = {"step_s": step_s, "switch_s": 0.6, "tokens_per_s": 3e4, "kv_bytes": 51 << 30, "sync_s": 0.07}
    last.update(peak_rollout=6 << 30, peak_train=22 << 30, kv_batch=464, rollout_s=8.0, train_s=step_s - 9)
    if freed is not None:
        last.update(comm_method="suspend", comm_suspend_s=1.9, comm_resume_s=1.8, comm_freed_bytes=freed[0])
        last["comm_freed_bytes_by_rank"] = freed
    kv = (51 << 30) if server else None
    ranks = [
        {
            "rollout": {"peak": (6 << 30) + r, "max_server_kv_cache": kv, "max_server_torch_cache": 1 << 30},
            "train": {"peak": 22 << 30, "max_server_kv_cache": 0 if server else None},
        }
        for r in range(world)
    ]
    return {"oom": False, "world_size": world, "last": last, "phases": ranks[0], "phases_by_rank": ranks}


def test_grpo_server_summary_at_four_ranks_with_the_communicators_suspended():
    from rlmem.benchmarks import grpo_colocated

    freed = [int(3.8 * (1 << 30)) + r for r in range(4)]
    res = {
        "server-big-offload": _server_part(60.0, 4),
        "big-offload": _server_part(62.0, 4, server=False),
        "server-big-suspend": _server_part(63.0, 4, freed=freed),
    }
    s = grpo_colocated.summarize_server(res)
    assert s["world_size"] == 4 and s["step_vs_single_process"] == pytest.approx(60.0 / 62.0)
    assert s["sync_s"] == 0.07 and s["switch_share"] == pytest.approx(0.6 / 60.0)
    # each rank's trainer and server, in rank order, for every part that ran with the ranks' phases
    for key in ("server", "single", "server_suspend"):
        peaks = s[f"rank_peaks_gib_{key}"]
        assert [p["rollout"] for p in peaks] == [((6 << 30) + r) / (1 << 30) for r in range(4)]
    assert all(p["server_rollout"] == 52.0 for p in s["rank_peaks_gib_server"])
    assert all(p["server_rollout"] is None for p in s["rank_peaks_gib_single"])
    # the suspend part: what every rank's suspend freed, and its step against the same layout with them kept
    assert s["comm_freed_bytes_by_rank"] == freed and s["comm_method"] == "suspend"
    assert s["comm_freed_gib_min"] == pytest.approx(freed[0] / (1 << 30))
    assert s["step_s_server_suspend"] == 63.0 and s["step_suspend_vs_keep"] == pytest.approx(63.0 / 60.0)
    assert s["switch_share_server_suspend"] == pytest.approx(0.6 / 63.0)
    assert s["comm_suspend_s"] == 1.9 and s["comm_resume_s"] == 1.8
    # without the part, none of its keys: the two-GPU file's summary keeps its keys as they were
    two = grpo_colocated.summarize_server({k: v for k, v in res.items() if k != "server-big-suspend"})
    assert not [k for k in two if "suspend" in k or k.startswith("comm_")]


def test_grpo_server_benchmark_refuses_what_cannot_run(tmp_path, capsys):
    from rlmem.benchmarks import grpo_colocated

    base = ["--engine", "server", "--device", "cpu", "--model", "tiny", "--json", str(tmp_path / "b.json")]
    for extra, says in (
        (["--parts", "server-big-suspend"], "needs --gpus 2 or more"),
        (["--parts", "server-big-offload", "--gpus", "0"], "--gpus must be at least 1"),
        (["--parts", "server-big-offload", "--time-budget", "0"], "--time-budget must be positive"),
        (["--parts", "big-overlap"], "comma-separated subset of"),  # a one-process part, not a server one
    ):
        with pytest.raises(SystemExit):
            grpo_colocated.main([*base, *extra])
        assert says in capsys.readouterr().err
    assert not (tmp_path / "b.json").exists()


def test_grpo_server_benchmark_starts_no_part_past_its_time_budget(tmp_path, capsys):
    # A call that has run out of time writes its file with what ran before: merged parts are kept, and the
    # part it did not start is said on stderr (and fails the call) rather than left as an error over them.
    import json

    from rlmem.benchmarks import grpo_colocated

    out = tmp_path / "b.json"
    argv = ["--engine", "server", "--device", "cpu", "--model", "tiny", "--gpus", "4", "--json", str(out)]
    kept = {"server-big-offload": _server_part(60.0, 4), "big-offload": _server_part(62.0, 4, server=False)}
    assert grpo_colocated.main([*argv, "--parts", "big-offload", "--time-budget", "1"]) == 1
    assert "big-offload: not started" in capsys.readouterr().err
    data = json.loads(out.read_text())
    out.write_text(json.dumps({**data, "results": kept}))
    assert grpo_colocated.main([*argv, "--parts", "server-big-suspend", "--time-budget", "1", "--merge"]) == 1
    data = json.loads(out.read_text())
    assert data["results"] == kept and data["summary"]["world_size"] == 4
    assert data["summary"]["step_vs_single_process"] == pytest.approx(60.0 / 62.0)


def test_grpo_server_benchmark_loads_the_suspend_nccl_in_its_suspend_part_only(tmp_path, monkeypatch):
    from rlmem.benchmarks import grpo_colocated

    lib = tmp_path / "libnccl.so.2"
    lib.write_bytes(b"")
    calls = {}

    def spawn(module, part, argv, *, env=None, nproc=1, timeout_s=None, outcome_key=None):
        calls[part] = {"env": env, "nproc": nproc, "timeout_s": timeout_s, "outcome_key": outcome_key}
        return _server_part(60.0, nproc, freed=[1, 2, 3, 4] if part.endswith("-suspend") else None)

    monkeypatch.setattr(grpo_colocated, "spawn_part", spawn)
    monkeypatch.setenv("LD_PRELOAD", "/x/other.so")
    argv = ["--engine", "server", "--device", "cpu", "--model", "tiny", "--gpus", "4"]
    argv += ["--parts", "server-big-offload,server-big-suspend", "--suspend-nccl", str(lib)]
    argv += ["--time-budget", "500", "--part-timeout", "3600", "--json", str(tmp_path / "b.json")]
    assert grpo_colocated.main(argv) == 0
    assert calls["server-big-offload"]["env"] is None
    assert calls["server-big-suspend"]["env"] == {"LD_PRELOAD": f"{lib}:/x/other.so"}
    assert all(c["nproc"] == 4 and c["timeout_s"] <= 500 for c in calls.values())  # the budget bounds each
    assert all(c["outcome_key"] == "oom" for c in calls.values())  # a rank out of memory ends the part


def test_grpo_server_benchmark_keeps_a_finished_run_killed_in_its_teardown(tmp_path, monkeypatch):
    # A part killed past its time after its run logged every step and wrote its summary keeps those
    # figures (marked ended_past_time); one killed before its last step stays an error.
    import json

    from rlmem.benchmarks import grpo_colocated

    one = _server_part(62.0, 2, server=False)
    summary = {"world_size": 2, "steps": 2, "phases": one["phases"], "precision": "bf16-mixed"}
    summary["phases_by_rank"] = one["phases_by_rank"]
    logged = {"big-offload": 2, "server-big-offload": 1}

    def spawn(module, part, argv, *, env=None, nproc=1, timeout_s=None, outcome_key=None):
        d = Path(argv[argv.index("--part-dir") + 1])
        rows = [{**one["last"], "step": k + 1} for k in range(logged[part])]
        (d / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        if logged[part] == 2:
            (d / "summary.json").write_text(json.dumps(summary))
        return {"error": f"ran past {timeout_s:g} s: (its end)"}

    monkeypatch.setattr(grpo_colocated, "spawn_part", spawn)
    out = tmp_path / "b.json"
    argv = ["--engine", "server", "--device", "cpu", "--model", "tiny", "--gpus", "2", "--json", str(out)]
    assert grpo_colocated.main([*argv, "--parts", "server-big-offload,big-offload"]) == 1
    res = json.loads(out.read_text())["results"]
    assert res["server-big-offload"]["error"].startswith("ran past")
    kept = res["big-offload"]
    assert kept["ended_past_time"] and kept["world_size"] == 2 and kept["engine"] == "local"
    assert [r["step"] for r in kept["steps"]] == [1, 2] and kept["last"]["step_s"] == 62.0
    assert kept["phases_by_rank"] == one["phases_by_rank"] and "nccl" not in kept


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


def test_a_sigterm_to_a_benchmark_ends_the_part_it_runs(tmp_path):
    # A part runs in a session of its own (so that one run past its time goes whole), which coreutils'
    # timeout, signalling the benchmark's process group, does not reach: the benchmark must take it along.
    import os
    import signal
    import subprocess
    import sys
    import time

    from _helpers import ROOT

    (tmp_path / "sleeper.py").write_text(
        "import os, sys, time\nopen(sys.argv[-1], 'w').write(str(os.getpid()))\ntime.sleep(120)\n"
    )
    pid_file = tmp_path / "pid"
    code = (
        "from rlmem.benchmarks._common import spawn_part\n"
        f"spawn_part('sleeper', 'x', [{str(pid_file)!r}], env={{'PYTHONPATH': {str(tmp_path)!r}}})\n"
    )
    bench = subprocess.Popen([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        deadline = time.monotonic() + 60
        while not (pid_file.is_file() and pid_file.read_text()) and time.monotonic() < deadline:
            time.sleep(0.05)
        part = int(pid_file.read_text())
        bench.send_signal(signal.SIGTERM)
        assert bench.wait(timeout=30) == 128 + signal.SIGTERM
    finally:
        bench.kill()
    deadline = time.monotonic() + 10
    while os.path.exists(f"/proc/{part}") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not os.path.exists(f"/proc/{part}"), "the part outlived its benchmark"


def test_grpo_colocated_names_the_loaded_nccl_through_the_driver(monkeypatch):
    """The part's record names the libnccl its ranks loaded (``Driver.describe``, a property), and what
    that lookup raises never costs the part's figures."""
    from types import SimpleNamespace

    from rlmem.benchmarks import grpo_colocated
    from rlmem.comm import _driver, _suspend

    lib = SimpleNamespace(version_string="2.32.3", path="/x/libnccl.so.2", has_suspend=True)
    monkeypatch.setattr(_driver._nccl, "library", lambda: lib)
    monkeypatch.setattr(_suspend.registry, "driver", None)
    via = "torch ProcessGroupNCCL.suspend" if _driver.torch_has_api() else "ctypes"
    assert grpo_colocated._nccl_loaded() == f"NCCL 2.32.3 (/x/libnccl.so.2; via {via})"

    def broken():
        raise OSError("libnccl.so.2: cannot open shared object file")

    monkeypatch.setattr(_driver._nccl, "library", broken)
    monkeypatch.setattr(_suspend.registry, "driver", None)
    assert grpo_colocated._nccl_loaded().startswith("unknown (libnccl.so.2: cannot open")


_FAILING_PART = """
import json, os, sys, time
if os.environ.get("RANK", "0") == "1":
    print(json.dumps({"oom": True, "rank": 1}), flush=True)
    os._exit(3)
time.sleep(120)  # the others wait, as in a collective the failed rank will never join
"""


def test_a_rank_out_of_memory_ends_the_part_with_its_outcome(tmp_path):
    # A rank that ran out of memory alone prints its outcome and fails: torchrun ends the rank still
    # waiting, and the part's outcome is that line, not an error (and not the timeout).
    import os
    import time

    from rlmem.benchmarks._common import spawn_part

    (tmp_path / "failing_part.py").write_text(_FAILING_PART)
    env = {"PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    t0 = time.monotonic()
    out = spawn_part("failing_part", "p", [], env=env, nproc=2, timeout_s=100, outcome_key="oom")
    assert out == {"oom": True, "rank": 1} and time.monotonic() - t0 < 90
    (tmp_path / "failing_part.py").write_text(_FAILING_PART.replace('"0") == "1"', '"0") == "0"'))
    out = spawn_part("failing_part", "p", [], env=env, timeout_s=100)  # the line without its key: a failure
    assert out["error"].startswith("exit 3")


def test_every_committed_result_names_its_machine_and_is_in_the_index():
    # each file under bench/results says where and when it was measured (its machine is the one its name
    # ends with) and docs/benchmarks.md's index lists it
    import json

    root = Path(__file__).parents[1]
    lines = (root / "docs" / "benchmarks.md").read_text().splitlines()
    index = "\n".join(x for x in lines if x.startswith("| "))  # the table of benchmarks and their files
    files = sorted((root / "bench" / "results").glob("*.json"))
    assert files
    for f in files:
        data = json.loads(f.read_text())
        assert all(data.get(k) for k in ("date", "versions", "device")), f.name
        assert f.name.endswith(f"-{data['machine']}.json"), f.name
        assert f"`{f.name}`" in index, f"{f.name} is not in docs/benchmarks.md's index"


def test_verl_summary_from_the_committed_rows_and_a_part_that_diverges():
    import json

    from rlmem.benchmarks import verl

    path = Path(__file__).resolve().parents[1] / "bench" / "results" / "verl-nvidia-h200-x1.json"
    data = json.loads(path.read_text())
    rows = [r for r in data["results"] if "error" not in r]
    by = {r["part"]: dict(r) for r in rows}
    got = verl.summarize(by, data["config"]["parts"], data["pinned_link"])
    assert got == pytest.approx(data["summary"])
    # a part whose stage hashes differ from the reference's, or one that did not finish: not bit-identical
    by["rlmem"]["hashes"] = {**by["rlmem"]["hashes"], "update": "0"}
    assert verl.summarize(by, data["config"]["parts"], data["pinned_link"])["bit_identical"] == 0.0
    assert by["rlmem"]["equals_reference"] is False and by["verl"]["equals_reference"] is True
    del by["rlmem"]
    short = verl.summarize(by, data["config"]["parts"], data["pinned_link"])
    assert short["bit_identical"] == 0.0 and "steady_vs_verl" not in short


def test_prefix_summary_takes_the_headline_cell_and_the_train_phase():
    from rlmem.benchmarks import prefix

    def cell(p, g, r, kv, x):
        side = {"greedy_gap": {"max": 0.1}}
        return {"prompt_len": p, "group_size": g, "new_tokens": r, "kv_bytes_ratio": kv, "rollout_speedup": x,
                "same_greedy_tokens": 0.5, "shared": side, "unshared": side}  # fmt: skip

    cells = [cell(512, 8, 256, 0.44, 2.0), cell(*prefix.HEADLINE, 0.1667, 4.3)]
    s = prefix.summarize(cells, {"train_phase_speedup": 3.4, "train_peak_ratio": 0.33})
    assert (s["kv_bytes_ratio"], s["rollout_speedup"]) == (0.1667, 4.3)
    assert (s["train_phase_speedup"], s["train_peak_ratio"]) == (3.4, 0.33)
    assert prefix.summarize(cells[:1], None) == {}  # no headline cell: nothing to check


def test_prefix_cells_on_the_host_hold_more_rows_in_the_same_bytes_for_the_same_tokens():
    # both layouts of one small cell of the tiny preset, as the benchmark runs them on a GPU
    import torch

    from rlmem.benchmarks import prefix
    from rlmem.models.presets import build, vocab_size

    model = build("qwen2-tiny", torch.device("cpu"), torch.float32).eval()
    res = prefix.rollout_cell(model, 32, 4, 8, 4, vocab_size("qwen2-tiny"), torch.device("cpu"))
    assert res["unshared"]["kv_cache_bytes"] == res["shared"]["kv_cache_bytes"]  # one budget
    assert res["shared"]["rows"] > res["unshared"]["rows"]
    assert res["kv_bytes_ratio"] == res["unshared"]["rows"] / res["shared"]["rows"]
    assert res["kv_bytes_ratio"] >= res["kv_bytes_floor"]
    assert res["same_greedy_tokens"] == 1.0  # fp32 on the host: the same tokens
    assert res["shared"]["greedy_gap"]["max"] == res["unshared"]["greedy_gap"]["max"] == 0.0
