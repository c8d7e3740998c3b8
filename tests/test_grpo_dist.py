"""`torchrun -m rlmem train`: FSDP2 over two ranks (four on four GPUs), each sampling its share; offload
changes nothing."""

from __future__ import annotations

import json
import shlex
import signal
import subprocess
import sys
import time

import pytest
import torch
from _helpers import gpu_worlds, run_launcher

from rlmem._procs import communicate_or_stop, launch, stop_tree

pytest.importorskip("transformers")
pytest.importorskip("yaml")


def _torchrun(tmp_path, name: str, *args: str, world: int = 2) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={world}",
        "-m",
        "rlmem",
        "train",
        *args,
        f"out_dir={tmp_path / name}",
        "plot=false",
        "progress=false",
    ]
    # a bound a GPU machine's call leaves room for: past it the ranks' stacks say where they were
    proc = run_launcher(cmd, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads((tmp_path / name / "summary.json").read_text())


def _compare(tmp_path, device: str, *extra: str, steps: int = 3, world: int = 2) -> None:
    common = [f"device={device}", f"steps={steps}", "prompts_per_step=8", "group_size=4", "kl_coef=0.1"]
    common += ["updates_per_step=2", "micro_batch_size=4", *extra]
    off = _torchrun(tmp_path, "off", *common, "offload=false", world=world)
    on = _torchrun(tmp_path, "on", *common, "offload=true", world=world)
    assert off["world_size"] == on["world_size"] == world and on["offload"] and not off["offload"]
    assert on["losses"] == off["losses"] and on["rewards"] == off["rewards"]
    rows = [json.loads(r) for r in (tmp_path / "on" / "log.jsonl").read_text().splitlines()]
    # rewards and token counts are reduced over the ranks: 8 prompts x 4 samples per step in all
    assert all(r["tokens"] >= 32 for r in rows)


def test_fsdp2_two_cpu_ranks_offload_on_and_off_identical(tmp_path):
    _compare(tmp_path, "cpu")


def test_fsdp2_two_cpu_ranks_rollout_copy_offload_on_and_off_identical(tmp_path):
    # each rank samples from a full bf16 copy through the model's unsharded twin (HFSampler rollout_dtype)
    _compare(tmp_path, "cpu", "rollout_dtype=bf16", steps=2)


@pytest.mark.parametrize("world", gpu_worlds(2, 4))
def test_fsdp2_gpus_offload_on_and_off_identical(tmp_path, world):
    _compare(tmp_path, "cuda", world=world)


@pytest.mark.parametrize("world", gpu_worlds(2, 4))
@pytest.mark.parametrize(
    "copy", ["rollout_dtype=none", "rollout_dtype=bf16"], ids=["fsdp-weights", "rollout-copy"]
)
def test_fsdp2_gpus_comms_suspended_during_rollout_identical(tmp_path, copy, world):
    # Without a copy the rollout samples from FSDP's gathered weights (kept gathered through the rollout);
    # with one, FSDP gathers the weights only to fill it (and shards them again at once).
    # The NCCL communicators give their memory back during rollout through NCCL's suspend (an NCCL without
    # it is refused: FSDP2's DTensor reductions reach communicators by name, past the rebuild fallback);
    # FSDP gathers the weights before they go, and training is what it is with them kept.
    from rlmem.benchmarks.assets import model_dir, tokenizer_and_data
    from rlmem.comm import _nccl

    # A model directory with data: the evaluation after the last step (eval_every, which needs eval_data) is
    # one more switch to rollout, after which the run's end meets in a barrier on the groups it suspended.
    tok, data = tokenizer_and_data(tmp_path / "assets", rows=64)
    model = model_dir("qwen2", tmp_path / "model", tok)
    common = ["device=cuda", "steps=3", "prompts_per_step=8", "group_size=4", "kl_coef=0.1", "offload=true"]
    common += [f"model={model}", f"data={data}", f"eval_data={data}", "eval_every=2", "max_new_tokens=8"]
    # a reward every sampled character moves: the losses are not all zero, so agreeing means something
    common += ["reward=rlmem.benchmarks.assets:text_reward"]
    common += ["updates_per_step=2", "micro_batch_size=4", "save_every=0", copy]
    if not _nccl.library().has_suspend:  # refused up front, before anything is built
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}"]
        cmd += ["-m", "rlmem", "train", *common, "comms=suspend", f"out_dir={tmp_path / 'refused'}"]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        assert proc.returncode != 0 and "comms='suspend' needs an NCCL that can suspend" in proc.stderr
        return
    keep = _torchrun(tmp_path, "keep", *common, "comms=keep", world=world)
    susp = _torchrun(tmp_path, "susp", *common, "comms=suspend", world=world)
    assert susp["losses"] == keep["losses"] and susp["rewards"] == keep["rewards"]
    lines = [json.loads(r) for r in (tmp_path / "susp" / "log.jsonl").read_text().splitlines()]
    rows = [r for r in lines if "eval_step" not in r]  # the steps' records; evaluations have their own
    assert len(rows) == 3 and all(r["comm_method"] == "suspend" and r["comm_freed_bytes"] > 0 for r in rows)
    # every rank's suspend freed memory, not only the lead's
    assert all(len(r["comm_freed_bytes_by_rank"]) == world for r in rows)
    assert all(b > 0 for r in rows for b in r["comm_freed_bytes_by_rank"])
    assert susp["comm_freed_bytes_mean"] > 0 and "comm_freed_bytes_mean" not in keep
    assert [r["eval_step"] for r in lines if "eval_step" in r][-1] == 3  # the evaluation after the last step


def test_prompts_must_split_evenly_over_ranks(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "rlmem"]
    cmd += ["train", "device=cpu", "steps=1", "prompts_per_step=3", f"out_dir={tmp_path}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "prompts_per_step (3) must be divisible by the 2 ranks" in proc.stderr


def test_fsdp2_two_cpu_ranks_dynamic_batching(tmp_path):
    # Token-budget micro-batches per rank, the count agreed by an all-reduce (FSDP2's collectives need every
    # rank to run as many forward/backward passes); a small budget gives several micro-batches per rank.
    args = ["device=cpu", "steps=2", "prompts_per_step=8", "group_size=4", "updates_per_step=1"]
    args += ["dynamic_batching=true", "max_tokens_per_micro_batch=40"]
    s = _torchrun(tmp_path, "dyn", *args)
    assert s["world_size"] == 2 and len(s["losses"]) == 2


def test_fsdp2_two_cpu_ranks_checkpoint_and_resume_bit_identical(tmp_path):
    # Rank 0 writes one Hugging Face checkpoint gathered from both ranks' shards; a resume loads it into
    # the shards again, with the optimizer state, and continues as if never stopped.
    args = ["device=cpu", "prompts_per_step=8", "group_size=4", "kl_coef=0.1", "updates_per_step=2"]
    args += ["micro_batch_size=4"]
    full = _torchrun(tmp_path, "full", *args, "steps=3", "save_every=0")
    _torchrun(tmp_path, "part", *args, "steps=2", "save_every=1")
    part = _torchrun(tmp_path, "part", *args, "steps=3", "save_every=1", "resume=auto")
    assert full["losses"] == part["losses"] and full["rewards"] == part["rewards"]
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(str(tmp_path / "part" / "checkpoint-3"))
    assert sum(p.numel() for p in m.parameters()) > 0


def test_sigterm_to_torchrun_stops_every_rank_after_the_same_step_with_a_checkpoint(tmp_path):
    # How Kubernetes and `timeout` stop a job: SIGTERM to the launcher, which forwards it to each rank's
    # process group. Each rank runs under `sh`, which waits for it (its trap runs once the rank is done)
    # and records the rank's exit status.
    out = tmp_path / "run"
    train = [sys.executable, "-m", "rlmem", "train", "device=cpu", "steps=100000", "prompts_per_step=4"]
    train += ["group_size=2", "plot=false", "progress=false", f"out_dir={out}"]
    status = shlex.quote(str(tmp_path / "exit-rank"))
    rank = f"trap : TERM; {shlex.join(train)}; echo $? > {status}$RANK"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "--no-python"]
    proc = launch([*cmd, "sh", "-c", rank], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    log = out / "log.jsonl"
    try:
        deadline = time.monotonic() + 240
        while not (log.is_file() and log.read_text()) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert proc.poll() is None and log.read_text(), "no step was logged"
        proc.send_signal(signal.SIGTERM)
        stdout, stderr, late = communicate_or_stop(proc, 120)
    finally:
        if proc.poll() is None:
            stop_tree(proc)
    assert not late, stderr[-4000:]
    # torchrun itself ends with its own SignalException (1); what each rank did is what matters
    ranks = [(tmp_path / f"exit-rank{r}").read_text().strip() for r in (0, 1)]
    assert ranks == ["143", "143"], stdout[-2000:] + stderr[-4000:]
    summary = json.loads((out / "summary.json").read_text())
    done = summary["steps"]
    assert summary["stopped_by"] == "SIGTERM" and len(summary["phases_by_rank"]) == 2  # together
    assert f"interrupted after {done} steps (SIGTERM)" in stdout
    assert (out / "timeline-rank1.jsonl").is_file() and len(log.read_text().splitlines()) == done
    st = torch.load(out / f"checkpoint-{done}" / "trainer_state.pt", weights_only=False)
    assert done >= 1 and st["step"] == done
