"""``rlmem.integrations.trl`` with TRL's own ``GRPOTrainer`` (CPU): training with :class:`RLMemCallback` is
bit-identical to TRL alone (losses, gradient norms, final weights, the saved optimizer), with gradient
accumulation, several iterations per generation, a reference model and a resumed checkpoint; the
optimizer's bytes are away from the device while TRL generates and scores."""

from __future__ import annotations

import json
import time

import pytest
import torch

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

from rlmem.benchmarks.assets import model_dir, tokenizer_and_data  # noqa: E402
from rlmem.integrations.trl import RLMemCallback, manage, sampler_rollout  # noqa: E402

PROMPTS = [f"What is {a} plus {b}?" for a, b in zip(range(8), range(3, 11), strict=True)]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    d = tmp_path_factory.mktemp("trl")
    tok, _ = tokenizer_and_data(d / "assets", rows=64)
    return model_dir("qwen2", d / "qwen2", tok)


def _reward(completions, **_):
    return [float(len(c) % 7) for c in completions]  # every character moves it


def _train(path, out, *, callbacks=None, manage_it=False, resume=None, watch=None, rollout_func=None, **over):
    """TRL's GRPOTrainer on the tiny model: (losses and gradient norms by step, final weights, trainer,
    the managed callback)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cfg = dict(
        output_dir=str(out),
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=8,
        max_steps=3,
        learning_rate=1e-3,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        seed=0,
        bf16=False,
    )
    cfg.update(over)
    trainer = trl.GRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32),
        reward_funcs=[_reward, watch or _zero],
        args=trl.GRPOConfig(**cfg),
        train_dataset=datasets.Dataset.from_list([{"prompt": p} for p in PROMPTS]),
        processing_class=AutoTokenizer.from_pretrained(str(path)),
        callbacks=callbacks,
        rollout_func=rollout_func,
    )
    cb = manage(trainer) if manage_it else None
    trainer.train(resume_from_checkpoint=resume)
    logs = [
        {k: r[k] for k in ("loss", "grad_norm") if k in r} for r in trainer.state.log_history if "loss" in r
    ]
    weights = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    return logs, weights, trainer, cb


def _zero(completions, **_):
    return [0.0] * len(completions)


def _same(a, b):
    assert a[0] == b[0] and len(a[0]) > 0  # losses and gradient norms, step by step
    assert a[1].keys() == b[1].keys() and all(torch.equal(a[1][k], b[1][k]) for k in a[1])


def test_the_callback_changes_nothing_and_keeps_the_optimizer_away_while_trl_generates(model_path, tmp_path):
    cb = RLMemCallback()
    seen: list[int] = []

    def watch(completions, **_):  # TRL scores right after generating, before forward and backward
        if cb.pm is not None and cb.pm.state is not None:
            cats = cb.pm.state.stats().categories
            seen.append(cats["optimizer"].resident_bytes if "optimizer" in cats else -1)
        return _zero(completions)

    base = _train(model_path, tmp_path / "base")
    mine = _train(model_path, tmp_path / "cb", callbacks=[cb], watch=watch)
    _same(base, mine)
    # from the second step on the optimizer has states, and none of their bytes is resident while TRL
    # generates and scores
    assert len(seen) == 3 and seen[1:] == [0, 0], seen
    assert cb.pm.state.stats().categories["optimizer"].bytes > 0
    # the gradients stay PyTorch's, freed by TRL's zero_grad() between steps as without the callback: no
    # Region holds their bytes through generation
    assert cb.pm.state.stats().categories["grads"].bytes == 0


@pytest.mark.parametrize(
    "over",
    [
        dict(gradient_accumulation_steps=2, per_device_train_batch_size=2, num_generations=4),
        dict(num_iterations=2, max_steps=4),
        dict(beta=0.1),
    ],
    ids=["grad-accumulation", "two-iterations", "reference"],
)
def test_bit_identical_to_trl_alone(model_path, tmp_path, over):
    base = _train(model_path, tmp_path / "base", **over)
    mine = _train(model_path, tmp_path / "mine", manage_it=True, **over)
    _same(base, mine)
    cb = mine[3]
    if over.get("beta"):  # the reference is managed: it leaves the device between its scorings
        assert cb.ref_state is not None and cb.ref_state.stats().categories["params"].bytes > 0


def test_a_checkpoint_resumes_to_the_same_weights_and_optimizer(model_path, tmp_path):
    common = dict(save_strategy="steps", save_steps=2, max_steps=4)
    whole = _train(model_path, tmp_path / "whole", **common)
    mine = _train(model_path, tmp_path / "mine", callbacks=[RLMemCallback()], **common)
    _same(whole, mine)
    # the optimizer saved while rlmem held its states: what TRL alone saved
    ref = torch.load(tmp_path / "whole" / "checkpoint-4" / "optimizer.pt", weights_only=False)
    got = torch.load(tmp_path / "mine" / "checkpoint-4" / "optimizer.pt", weights_only=False)
    assert ref["state"].keys() == got["state"].keys()
    assert all(torch.equal(v, got["state"][k][n]) for k, st in ref["state"].items() for n, v in st.items())
    # a new trainer resumed from step 2 with the callback ends where the whole run did
    resumed = _train(
        model_path,
        tmp_path / "mine",
        callbacks=[RLMemCallback()],
        resume=str(tmp_path / "mine" / "checkpoint-2"),
        **common,
    )
    assert all(torch.equal(resumed[1][k], whole[1][k]) for k in whole[1])


def test_the_sampler_rollout_with_the_weights_away_trains_as_without(model_path, tmp_path, monkeypatch):
    # TRL's rollout_func on rlmem's sampler, sampling from a bf16 copy: during generation the training weights
    # and the optimizer states wait in host memory; training is what it is with them kept
    from rlmem.rollout import HFSampler

    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    away: list[tuple[int, int]] = []
    generate = HFSampler.generate

    def watched(self, *a, **k):
        cats = mine.callback.pm.state.stats().categories
        away.append(
            (cats["params"].resident_bytes, cats.get("optimizer") and cats["optimizer"].resident_bytes)
        )
        return generate(self, *a, **k)

    kept = sampler_rollout(offload=False)
    base = _train(model_path, tmp_path / "kept", rollout_func=kept, callbacks=[kept.callback])
    mine = sampler_rollout()
    monkeypatch.setattr(HFSampler, "generate", watched)
    got = _train(model_path, tmp_path / "away", rollout_func=mine, callbacks=[mine.callback])
    _same(base, got)
    assert len(away) == 3 and all(p == 0 for p, _ in away) and all(o == 0 for _, o in away[1:]), away
    other = sampler_rollout()
    with pytest.raises(ValueError, match="GRPOConfig sets top_k=5"):  # it would sample otherwise than asked
        _train(model_path, tmp_path / "topk", rollout_func=other, callbacks=[other.callback], top_k=5)


def test_what_it_cannot_manage_is_refused_clearly():
    from rlmem.integrations.trl import _inner

    class DeepSpeedOpt:
        pass

    DeepSpeedOpt.__module__ = "deepspeed.runtime.zero"
    with pytest.raises(ValueError, match="DeepSpeed optimizer"):
        _inner(DeepSpeedOpt())
    with pytest.raises(ValueError, match="no torch optimizer found in object"):
        _inner(object())
    with pytest.raises(ValueError, match=r"ref_model must be an nn\.Module"):
        RLMemCallback(ref_model="ref")
    for bad, key in ((dict(rollout_dtype=torch.int8), "rollout_dtype"), (dict(batch_size=0), "batch_size")):
        with pytest.raises(ValueError, match=key):
            sampler_rollout(**bad)


def test_the_benchmark_runs_its_parts_on_the_cpu(tmp_path):
    # rlmem bench trl off a GPU: TRL alone against the callback (no device memory to read here)
    from rlmem.benchmarks import trl as bench

    out = tmp_path / "trl.json"
    argv = ["--device", "cpu", "--json", str(out), "--parts", "trl,callback", "--steps", "2", "--group", "2"]
    assert bench.main(argv) == 0
    data = json.loads(out.read_text())
    assert data["summary"]["bit_identical"] is True and data["summary"]["optimizer_gib"] > 0
    assert all(len(data["results"][p]["steps"]) == 2 for p in ("trl", "callback"))


def test_the_benchmarks_peak_drops_a_reading_begun_before_its_window():
    # The sampling thread's read can begin in one phase and return after the next has been marked (it waits
    # out the same device synchronize): what it read belongs to the phase before, not to the new window.
    import threading

    from rlmem.benchmarks.trl import _Used

    began, release = threading.Event(), threading.Event()
    state = {"used": 100}

    def read() -> int:
        v = state["used"]
        if threading.current_thread() is not threading.main_thread() and not release.is_set():
            began.set()
            assert release.wait(10)
        return v

    used = _Used(torch.device("cpu"), read=read)
    try:
        assert began.wait(10)  # the thread has read 100 and is held
        state["used"] = 10  # the phase changed: 10 in use now
        used.mark()
        release.set()
        time.sleep(0.05)  # the held reading comes back, and later ones read 10
        assert used.peak() == 10
        state["used"] = 30
        deadline = time.monotonic() + 10
        while used.top != 30 and time.monotonic() < deadline:  # the thread still samples the window
            time.sleep(0.001)
        state["used"] = 20
        assert used.peak() == 30
    finally:
        used.stop()


def test_the_benchmark_says_whether_trl_repeats_itself():
    from rlmem.benchmarks.trl import summarize

    def part(sha: str, loss: float) -> dict:
        steps = [{"gen_s": 1.0, "gen_tokens": 10, "step_s": 2.0, "gen_peak": 2**30, "train_peak": 2**31}] * 2
        return {"steps": steps, "logs": [{"loss": loss}], "weights_sha256": sha, "optimizer_bytes": 2**30}

    s = summarize({"trl": part("a", 1.0), "callback": part("a", 1.0), "trl-again": part("b", 1.5)})
    assert s["bit_identical"] is True and s["trl_reproducible"] is False
    assert s["step_s_trl_again"] == 2.0 and "trl_reproducible" not in summarize({"trl": part("a", 1.0)})
