"""rlmem train on a user's model directory, tokenizer, data and reward: checkpoints, resume, bad input.

Everything is made here: a tiny Qwen2 saved with ``save_pretrained``, a byte-level BPE tokenizer trained in
memory with ``tokenizers`` (with a chat template), and a JSONL of arithmetic questions.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("datasets")

from rlmem.benchmarks.assets import TEMPLATE
from rlmem.cli import main as cli_main
from rlmem.recipes import checkpoint
from rlmem.recipes.rewards import extract_answer, load_reward, math_reward, score


def _questions(n: int, seed: int = 0) -> list[dict[str, str]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        out.append({"prompt": f"What is {a}+{b}?", "answer": str(a + b)})
    return out


def _tokenizer(path: Path, *, template: bool = True):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    special = ["<|endoftext|>", "<|pad|>", "<|user|>", "<|assistant|>"]
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=special, show_progress=False)
    corpus = [
        f"{q['prompt']} The answer is {q['answer']}. \\boxed{{{q['answer']}}}" for q in _questions(200, 1)
    ]
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|pad|>")
    if template:
        fast.chat_template = TEMPLATE
    fast.save_pretrained(str(path))
    return fast


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    d = tmp_path_factory.mktemp("model")
    tok = _tokenizer(d)
    torch.manual_seed(0)
    cfg = Qwen2Config(
        hidden_size=64,
        num_hidden_layers=2,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        vocab_size=len(tok),
        tie_word_embeddings=True,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    Qwen2ForCausalLM(cfg).save_pretrained(str(d))
    return d


@pytest.fixture(scope="module")
def data_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    f = tmp_path_factory.mktemp("data") / "arith.jsonl"
    f.write_text("".join(json.dumps(q) + "\n" for q in _questions(24)))
    return f


def _train(model_dir: Path, data: Path, out: Path, *extra: str) -> int:
    args = [
        "train",
        f"model={model_dir}",
        f"data={data}",
        "reward=math",
        "device=cpu",
        "prompts_per_step=4",
        "group_size=2",
        "micro_batch_size=4",
        "max_new_tokens=6",
        "progress=false",
        "plot=false",
        f"out_dir={out}",
        *extra,
    ]
    return cli_main(args)


def _summary(out: Path) -> dict:
    return json.loads((out / "summary.json").read_text())


@pytest.mark.parametrize("precision", ["fp32", "fp16-mixed"])
def test_a_real_model_directory_trains_saves_and_resumes_bit_identically(
    model_dir, data_file, tmp_path, precision
):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    full = tmp_path / "full"
    prec = f"precision={precision}"
    assert _train(model_dir, data_file, full, "steps=4", "save_every=0", prec) == 0
    part = tmp_path / "part"
    assert _train(model_dir, data_file, part, "steps=2", "save_every=1", prec) == 0
    assert sorted(p.name for p in part.glob("checkpoint-*")) == ["checkpoint-1", "checkpoint-2"]
    ck = part / "checkpoint-2"
    loaded = AutoModelForCausalLM.from_pretrained(str(ck))
    assert (
        loaded.config.vocab_size == AutoTokenizer.from_pretrained(str(ck)).vocab_size
        or len(AutoTokenizer.from_pretrained(str(ck))) <= loaded.config.vocab_size
    )
    assert _train(model_dir, data_file, part, "steps=4", "save_every=1", "resume=auto", prec) == 0
    a, b = _summary(full), _summary(part)
    assert len(a["losses"]) == len(b["losses"]) == 4
    assert a["losses"] == b["losses"] and a["rewards"] == b["rewards"]
    assert checkpoint.latest(part).name == "checkpoint-4"


def test_chat_messages_and_dropped_long_prompts(model_dir, tmp_path, capsys):
    rows = [
        {"prompt": [{"role": "user", "content": q["prompt"]}], "answer": q["answer"]} for q in _questions(8)
    ]
    rows.append({"prompt": "What is " + "1+" * 200 + "1?", "answer": "201"})
    f = tmp_path / "chat.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert _train(model_dir, f, tmp_path / "o", "steps=1", "save_every=0", "max_prompt_len=64") == 0
    said = capsys.readouterr().out
    assert "data: 8 prompts" in said and "(1 longer than max_prompt_len=64 dropped)" in said


@pytest.mark.parametrize(
    "case, expect",
    [
        ("missing_key", "has no column 'question' (prompt_key)"),
        ("malformed_row", "row 1 of"),
        ("raising_reward", "raised on data row"),
        ("no_tokenizer", "has no tokenizer files"),
        ("unknown_key", "unknown config key(s) 'epochz'"),
    ],
)
def test_bad_input_is_one_line_naming_the_culprit(model_dir, data_file, tmp_path, capsys, case, expect):
    out = tmp_path / "o"
    extra: list[str] = ["steps=1", "save_every=0"]
    data, model = data_file, model_dir
    if case == "missing_key":
        extra.append("prompt_key=question")
    elif case == "malformed_row":
        data = tmp_path / "bad.jsonl"
        data.write_text(
            json.dumps({"prompt": "What is 1+1?", "answer": "2"})
            + "\n"
            + json.dumps({"prompt": 5, "answer": "1"})
            + "\n"
        )
    elif case == "raising_reward":
        r = tmp_path / "myreward.py"
        r.write_text("def reward(prompt, completion, answer):\n    raise KeyError('boom')\n")
        extra.append(f"reward={r}:reward")
    elif case == "no_tokenizer":
        bare = tmp_path / "bare"
        bare.mkdir()
        for f in model_dir.iterdir():
            if f.name in ("config.json", "model.safetensors", "generation_config.json"):
                (bare / f.name).write_bytes(f.read_bytes())
        model = bare
    elif case == "unknown_key":
        extra.append("epochz=3")
    if case == "unknown_key":
        with pytest.raises(SystemExit):
            _train(model, data, out, *extra)
    else:
        assert _train(model, data, out, *extra) == 2
    err = capsys.readouterr().err.strip()
    assert expect in err and len(err.splitlines()) <= 3, err
    assert not (out / "log.jsonl").exists()  # nothing was written


def test_resume_from_a_checkpoint_of_another_model_is_refused(model_dir, data_file, tmp_path, capsys):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    other = tmp_path / "ck" / "checkpoint-1"
    cfg = Qwen2Config(
        hidden_size=32,
        num_hidden_layers=1,
        intermediate_size=64,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=300,
    )
    Qwen2ForCausalLM(cfg).save_pretrained(str(other))
    torch.save({"step": 1}, other / "trainer_state.pt")
    out = tmp_path / "o"
    assert _train(model_dir, data_file, out, "steps=2", f"resume={other}") == 2
    err = capsys.readouterr().err
    assert "is a checkpoint of another model" in err and "hidden_size 32 vs 64" in err
    assert not (out / "log.jsonl").exists()


def test_math_reward_reads_boxed_hashes_and_last_numbers():
    assert extract_answer("so \\boxed{\\frac{1}{2}} done") == "\\frac{1}{2}"
    assert extract_answer("work... #### 1,234") == "1,234"
    assert extract_answer("I think 3 then 42.") == "42"
    assert math_reward(None, "The answer is \\boxed{0.5}", "\\frac{1}{2}") == 1.0
    assert math_reward(None, "#### 72", "Natalia sold 48/2 = 24 clips... #### 72") == 1.0
    assert math_reward(None, "it is 71", "72") == 0.0
    assert math_reward(None, "no number", "72") == 0.0
    with pytest.raises(ValueError, match="reward must be one of"):
        load_reward("nonsense")
    with pytest.raises(ValueError, match="returned 'x' on data row 7"):
        score(lambda p, c, a: "x", "f", ["p"], ["c"], ["a"], [7])


def test_the_gsm8k_example_is_a_valid_config():
    from rlmem.recipes import yaml_config as _config
    from rlmem.recipes.grpo import GRPOConfig

    cfg = _config.load(GRPOConfig, Path(__file__).parents[1] / "examples" / "grpo_gsm8k.yaml", [])
    assert (cfg.prompt_key, cfg.answer_key, cfg.reward, cfg.lr) == ("question", "answer", "math", 1e-6)


def test_eval_and_tensorboard(model_dir, data_file, tmp_path):
    out = tmp_path / "o"
    extra = ["steps=2", "save_every=0", f"eval_data={data_file}", "eval_every=1"]
    try:
        import tensorboard  # noqa: F401

        extra.append("logger=tensorboard")
    except ImportError:
        pass
    assert _train(model_dir, data_file, out, *extra) == 0
    rows = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    assert all(0.0 <= r["eval/reward"] <= 1.0 for r in rows)
    if "logger=tensorboard" in extra:
        assert any((out / "tb").iterdir())


def test_logger_and_eval_keys_are_validated():
    from rlmem.recipes.config import GRPOConfig

    with pytest.raises(ValueError, match="logger must be one or more of tensorboard, wandb"):
        GRPOConfig(logger="mlflow")
    with pytest.raises(ValueError, match="eval_data must be unset without data="):
        GRPOConfig(eval_data="x.jsonl")
    with pytest.raises(ValueError, match="eval_every must be 0 without eval_data="):
        GRPOConfig(data="d.jsonl", eval_every=5)


def test_loggers_send_the_step_scalars(tmp_path, monkeypatch):
    """TensorBoard and W&B through stand-ins with their APIs: the scalars of each step reach both."""
    import sys
    import types

    from rlmem.recipes.loggers import Loggers

    calls: list[tuple] = []

    class Writer:
        def __init__(self, log_dir):
            calls.append(("tb_dir", log_dir))

        def add_scalar(self, k, v, step):
            calls.append(("tb", k, v, step))

        def close(self):
            calls.append(("tb_close",))

    class Run:
        def log(self, scalars, step):
            calls.append(("wandb", dict(scalars), step))

        def finish(self):
            calls.append(("wandb_finish",))

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", types.SimpleNamespace(SummaryWriter=Writer))
    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=lambda **kw: Run()))
    lg = Loggers(["tensorboard", "wandb"], tmp_path, {"lr": 1.0}, resume=False)
    lg.log_eval(0, 0.125)
    lg.log({"step": 0, "reward": 0.5, "loss": 1.0, "eval/reward": 0.25, "kv_batch": 8})
    lg.close()
    assert ("tb", "train/reward", 0.5, 1) in calls and ("tb", "eval/reward", 0.125, 0) in calls
    assert ("wandb", {"reward": 0.5, "loss": 1.0}, 1) in calls
    assert ("wandb", {"eval/reward": 0.125}, 0) in calls
    assert ("tb_close",) in calls and ("wandb_finish",) in calls
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(ValueError, match="pip install wandb"):
        Loggers(["wandb"], tmp_path, {}, resume=False)


def test_the_data_path_learns_a_toy_task(model_dir, tmp_path):
    """The learnable toy on the real-work path: the embedded tiny model, the BPE tokenizer made here, a JSONL
    of "Say 7." prompts and a user reward file (the completion starts with the digit): the reward rises
    from ~0.1 to ~0.9 in 150 steps (14 s on the CPU); 60 steps here."""
    rng = random.Random(0)
    data = tmp_path / "echo.jsonl"
    data.write_text(
        "".join(
            json.dumps({"prompt": f"Say {d}.", "answer": str(d)}) + "\n"
            for d in (rng.randint(0, 9) for _ in range(256))
        )
    )
    reward = tmp_path / "echo_reward.py"
    reward.write_text(
        "def reward(prompt, completion, answer):\n"
        "    return 1.0 if completion.strip().startswith(str(answer)) else 0.0\n"
    )
    out = tmp_path / "o"
    args = [
        "train",
        "model=tiny",
        f"tokenizer={model_dir}",
        f"data={data}",
        f"reward={reward}:reward",
        "chat_template=none",
        "max_new_tokens=2",
        "steps=60",
        "lr=3e-3",
        "save_every=0",
        "progress=false",
        "plot=false",
        "device=cpu",
        f"out_dir={out}",
    ]
    assert cli_main(args) == 0
    s = _summary(out)
    assert s["reward_first5"] < 0.3 and s["reward_last5"] > s["reward_first5"] + 0.3, s["rewards"]


def test_answers_reach_the_reward_as_text_whatever_the_file_gives(model_dir, tmp_path):
    from rlmem.recipes.user_data import as_text

    data = tmp_path / "nums.csv"  # datasets reads this answer column as integers
    data.write_text("prompt,answer\n" + "".join(f"What is {a}+{a}?,{2 * a}\n" for a in range(8)))
    reward = tmp_path / "r.py"
    reward.write_text(
        "def reward(prompt, completion, answer):\n"
        "    assert isinstance(answer, str), type(answer)\n"
        "    return float(answer in completion)\n"
    )
    assert _train(model_dir, data, tmp_path / "o", f"reward={reward}:reward", "steps=1", "save_every=0") == 0
    texts = [as_text(v) for v in (72, 72.0, 2.5, "x", True, [1, 2])]
    assert texts == ["72", "72", "2.5", "x", "True", "[1, 2]"]
