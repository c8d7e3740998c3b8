"""``rlmem.integrations.trl`` with TRL's own ``GRPOTrainer`` (CPU): training with :class:`RLMemCallback` is
bit-identical to TRL alone (losses, gradient norms, final weights, the saved optimizer), with gradient
accumulation, several iterations per generation, a reference model and a resumed checkpoint; the
optimizer's bytes are away from the device while TRL generates and scores. The sampler samples from the
prompt ids TRL's own generation computes (text and chat, with and without a BOS); what the callback cannot
carry out is refused before anything is trained; docs/trl.md's blocks run as written."""

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


def _args(out, **over):
    cfg = dict(
        output_dir=str(out),
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=4,
        max_steps=1,
        learning_rate=1e-3,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        seed=0,
        bf16=False,
    )
    cfg.update(over)
    return trl.GRPOConfig(**cfg)


def _train(path, out, *, callbacks=None, manage_it=False, resume=None, watch=None, rollout_func=None, **over):
    """TRL's GRPOTrainer on the tiny model: (losses and gradient norms by step, final weights, trainer,
    the managed callback)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    trainer = trl.GRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32),
        reward_funcs=[_reward, watch or _zero],
        args=_args(out, **{"max_completion_length": 8, "max_steps": 3, **over}),
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
    with pytest.raises(ValueError, match="cannot manage the optimizer under DeepSpeed: "):
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


# -- TRL's prompts through the sampler --------------------------------------------------------------------

_CHAT = (
    "{{ bos_token if bos_token else '' }}{% if greeting %}{{ greeting }}{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def _tokenizer(bos: bool):
    """A BPE tokenizer trained on PROMPTS with a chat template (which writes the BOS where there is one);
    with ``bos``, its plain call adds a BOS as Llama's does."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    special = ["<|endoftext|>", "<|pad|>", "<|bos|>", "<|user|>", "<|assistant|>"]
    bpe = trainers.BpeTrainer(vocab_size=300, special_tokens=special, show_progress=False)
    tok.train_from_iterator([*PROMPTS, "Hi there"], bpe)
    kw = {}
    if bos:
        b = tok.token_to_id("<|bos|>")
        tok.post_processor = processors.TemplateProcessing(
            single="<|bos|> $A", pair="<|bos|> $A <|bos|> $B", special_tokens=[("<|bos|>", b)]
        )
        kw["bos_token"] = "<|bos|>"
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|pad|>", **kw)
    fast.chat_template = _CHAT
    return fast


def _tiny_model(tok):
    import transformers

    cfg = transformers.Qwen2Config(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=128,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        bos_token_id=tok.bos_token_id,
    )
    torch.manual_seed(0)
    return transformers.Qwen2ForCausalLM(cfg)


@pytest.mark.parametrize("bos", [True, False], ids=["adds-bos", "no-bos"])
@pytest.mark.parametrize("chat", [False, True], ids=["text", "conversational"])
def test_the_sampler_sees_the_prompt_ids_trls_own_generation_computes(tmp_path, monkeypatch, bos, chat):
    from rlmem.rollout import HFSampler

    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    tok = _tokenizer(bos)
    rows = [{"prompt": [{"role": "user", "content": p}] if chat else p} for p in PROMPTS]
    seen: dict[str, list] = {"prompts": [], "ids": []}
    generate = HFSampler.generate

    def watched(self, ids, **k):
        seen["ids"].append([list(x) for x in ids])
        return generate(self, ids, **k)

    monkeypatch.setattr(HFSampler, "generate", watched)
    r = sampler_rollout()

    def rollout(prompts, trainer):
        seen["prompts"].append(prompts)
        return r(prompts, trainer)

    over = dict(chat_template_kwargs={"greeting": "Hi there"}) if chat else {}
    trainer = trl.GRPOTrainer(
        model=_tiny_model(tok),
        reward_funcs=[_reward],
        args=_args(tmp_path, **over),
        train_dataset=datasets.Dataset.from_list(rows),
        processing_class=tok,
        rollout_func=rollout,
        callbacks=[r.callback],
    )
    trainer.train()
    assert len(seen["ids"]) == 1 and len(seen["ids"][0]) == 4
    # TRL's own generation path (GRPOTrainer._generate without a rollout_func) on the same prompts
    trl_ids, _, _ = trainer._tokenize_prompts(seen["prompts"][0])
    assert seen["ids"][0] == [list(x) for x in trl_ids]
    first = seen["ids"][0][0]
    if bos:  # the one BOS: the tokenizer's for text, the template's for chat (none added on top)
        assert first[0] == tok.bos_token_id and first.count(tok.bos_token_id) == 1
    else:
        assert tok.bos_token_id is None
    if chat:  # GRPOConfig.chat_template_kwargs reached the template, and the generation prompt is there
        text = tok.decode(first)
        assert "Hi there<|user|>" in text and text.endswith("<|assistant|>")


# -- what a TRL user meets: refusals -------------------------------------------------------------------------


def _trainer(tmp_path, *, callbacks=None, rollout_func=None, **over):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = tmp_path.parent / "shared-model"
    if not path.exists():
        tok, _ = tokenizer_and_data(tmp_path.parent / "shared-assets", rows=64)
        model_dir("qwen2", path, tok)
    return trl.GRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32),
        reward_funcs=[_reward],
        args=_args(tmp_path / "out", **over),
        train_dataset=datasets.Dataset.from_list([{"prompt": p} for p in PROMPTS]),
        processing_class=AutoTokenizer.from_pretrained(str(path)),
        callbacks=callbacks,
        rollout_func=rollout_func,
    )


def _weights(trainer):
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_deepspeed_is_refused_at_every_zero_stage(stage):
    # Under DeepSpeed the Trainer's optimizer is accelerate's DeepSpeedOptimizerWrapper over DeepSpeed's
    # engine's optimizer; at stage 0 (fp32) that is the torch optimizer itself, which the callback adopted
    # until step 2 crashed inside DeepSpeed's step.
    from types import SimpleNamespace

    from accelerate.utils.deepspeed import DeepSpeedOptimizerWrapper

    model = torch.nn.Linear(4, 4)
    wrapped = DeepSpeedOptimizerWrapper.__new__(DeepSpeedOptimizerWrapper)  # its __init__ wants DeepSpeed
    wrapped.optimizer = torch.optim.AdamW(model.parameters())
    args = SimpleNamespace(deepspeed={"zero_optimization": {"stage": stage}})
    cb = RLMemCallback()
    with pytest.raises(ValueError, match=rf"under DeepSpeed ZeRO stage {stage}: .*offload_optimizer"):
        cb.on_train_begin(args, None, None, model=model, optimizer=wrapped)
    assert cb.pm is None  # nothing adopted
    no_section = SimpleNamespace(deepspeed={"train_batch_size": 4})  # DeepSpeed's default is stage 0
    with pytest.raises(ValueError, match="DeepSpeed ZeRO stage 0"):
        cb.on_train_begin(no_section, None, None, model=model, optimizer=wrapped)


def test_manage_refuses_what_is_not_a_trainer(model_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_path))
    for bad, name in ((None, "NoneType"), (model, "Qwen2ForCausalLM")):
        with pytest.raises(ValueError, match=rf"^trainer must be TRL's GRPOTrainer .*got {name}"):
            manage(bad)


def test_a_second_rlmem_callback_in_one_trainer_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    # manage() beside callbacks=[RLMemCallback()]: at the call
    trainer = _trainer(tmp_path / "a", callbacks=[RLMemCallback()])
    with pytest.raises(ValueError, match=r"has an RLMemCallback already .*use one of the two"):
        manage(trainer)
    # two in callbacks=, or one beside a sampler's: as training starts, before any step
    r = sampler_rollout()
    for i, cbs, rollout in (
        (0, [RLMemCallback(), RLMemCallback()], None),
        (1, [r.callback, RLMemCallback()], r),
    ):
        trainer = _trainer(tmp_path / f"b{i}", callbacks=cbs, rollout_func=rollout)
        before = _weights(trainer)
        with pytest.raises(ValueError, match="a second rlmem callback in this GRPOTrainer: keep one"):
            trainer.train()
        assert trainer.state.global_step == 0
        assert all(torch.equal(before[k], v) for k, v in _weights(trainer).items())


def test_a_sampler_callback_without_its_rollout_func_and_the_reverse_are_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    r = sampler_rollout()
    trainer = _trainer(tmp_path / "a", callbacks=[r.callback])
    before = _weights(trainer)
    with pytest.raises(ValueError, match=r"rollout_func is not r .*callbacks=\[r\.callback\]\)$"):
        trainer.train()  # refused before the first optimizer step: the weights are as they were
    assert all(torch.equal(before[k], v) for k, v in _weights(trainer).items())
    with pytest.raises(ValueError, match="rollout_func is not r"):
        manage(trainer)
    r = sampler_rollout()
    trainer = _trainer(tmp_path / "b", rollout_func=r)
    with pytest.raises(ValueError, match=r"needs r\.callback in its callbacks too"):
        trainer.train()
    assert trainer.state.global_step == 0


def test_manage_gives_a_sampler_rollouts_callback_the_reference(tmp_path, monkeypatch):
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    r = sampler_rollout()
    trainer = _trainer(tmp_path, rollout_func=r, beta=0.1, max_steps=2)
    cb = manage(trainer)  # adds r.callback, which the trainer did not have
    assert cb is r.callback and cb in trainer.callback_handler.callbacks and cb.ref_model is trainer.ref_model
    trainer.train()
    assert trainer.state.global_step == 2 and r.calls == 2
    assert cb.ref_state is not None and cb.ref_state.stats().categories["params"].bytes > 0


def test_a_sampler_rollout_serves_a_second_trainer(tmp_path, monkeypatch):
    # The second trainer samples from its own model: what a new sampler_rollout seeded where the first one's
    # calls left off gives it, bit for bit.
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    r = sampler_rollout()
    _trainer(tmp_path / "a", rollout_func=r, callbacks=[r.callback]).train()
    first = r.sampler
    again = _trainer(tmp_path / "b", rollout_func=r, callbacks=[r.callback])
    again.train()
    assert r.sampler is not first and r.sampler.model is again.model
    fresh = sampler_rollout(seed=1)
    alone = _trainer(tmp_path / "c", rollout_func=fresh, callbacks=[fresh.callback])
    alone.train()
    logs = [[x["loss"] for x in t.state.log_history if "loss" in x] for t in (again, alone)]
    assert logs[0] == logs[1] and len(logs[0]) == 1
    assert all(torch.equal(v, _weights(alone)[k]) for k, v in _weights(again).items())


def test_the_docstrings_path_to_manage_works_after_import_rlmem():
    import subprocess
    import sys

    code = (
        "import sys, rlmem\n"
        "assert 'trl' not in sys.modules and 'rlmem.integrations.trl' not in sys.modules\n"
        "print(rlmem.integrations.trl.manage.__name__, 'transformers' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.split() == ["manage", "True"], out.stdout + out.stderr


def test_the_docs_blocks_run_as_written(model_path, tmp_path, monkeypatch):
    # docs/trl.md's python blocks, each in a namespace of its own given what they say they are given
    import re
    from pathlib import Path

    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    text = (Path(__file__).parent.parent / "docs" / "trl.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert len(blocks) == 3
    for i, block in enumerate(blocks):
        ns = {
            "model": str(model_path),
            "reward": _reward,
            "args": _args(tmp_path / str(i), max_steps=2, beta=0.1),
            "data": datasets.Dataset.from_list([{"prompt": p} for p in PROMPTS]),
        }
        exec(compile(block, f"docs/trl.md block {i + 1}", "exec"), ns)
        trainer = ns["trainer"]
        assert trainer.state.global_step == 2
        ours = [c for c in trainer.callback_handler.callbacks if isinstance(c, RLMemCallback)]
        assert len(ours) == 1 and ours[0].pm is not None, block
