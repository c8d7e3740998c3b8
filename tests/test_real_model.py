"""A real model out of the box: a GGUF model (a tiny Llama written here) trained on the built-in arithmetic
task with evaluation from step 0, checkpoints that load with plain transformers, a save that is proven
before step 1 and falls back when it fails later, answers reaching rewards as text, and the training
weights offloaded while a rollout copy samples."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("yaml")

from _models import PROMPTS, tiny_qwen2

import rlmem
from rlmem.cli import main as cli_main
from rlmem.models import gguf
from rlmem.recipes import arithmetic
from rlmem.rollout import HFSampler

SMALL = [
    "device=cpu",
    "prompts_per_step=4",
    "group_size=2",
    "micro_batch_size=4",
    "progress=false",
    "plot=false",
]


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("gguf")
    pytest.importorskip("accelerate")
    from _gguf import write_tiny_llama

    f = tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf"
    write_tiny_llama(f)
    return f


def _rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]


def test_the_gguf_file_loads_as_the_model_it_holds(gguf_file, tmp_path):
    from _gguf import write_tiny_llama

    ref, tok = write_tiny_llama(tmp_path / "again.gguf")
    model = gguf.load_model(gguf_file, torch.float32, torch.device("cpu"))
    ids = torch.tensor([tok("What is 3 plus 4?")["input_ids"]])
    assert torch.equal(model(ids).logits, ref(ids).logits)
    assert getattr(model, "hf_quantizer", None) is None and not hasattr(model.config, "quantization_config")
    assert gguf.load_tokenizer(gguf_file).chat_template == tok.chat_template


def test_gguf_files_are_found_by_file_directory_or_package(gguf_file, tmp_path, monkeypatch):
    assert gguf.find(str(gguf_file)) == gguf_file
    assert gguf.find(str(gguf_file.parent)) == gguf_file
    pkg = tmp_path / "site" / "tiny_llm_pkg"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise ImportError('finding the file must not import the package')\n")
    (pkg / "m.gguf").write_bytes(gguf_file.read_bytes())
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    assert gguf.find("tiny_llm_pkg") == pkg / "m.gguf" and gguf.find("tiny-llm-pkg") == pkg / "m.gguf"
    assert gguf.find("tiny") is None and gguf.find("qwen2-2.5b") is None and gguf.find("no_such_pkg") is None
    (pkg / "n.gguf").write_bytes(b"")
    with pytest.raises(ValueError, match="holds 2 GGUF files"):
        gguf.find("tiny_llm_pkg")


def test_a_missing_gguf_package_is_one_line_naming_the_install(gguf_file, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "gguf" else real(n, *a))
    with pytest.raises(ValueError, match=r"needs the gguf package\(s\): pip install 'rlmem\[gguf\]'"):
        gguf.load_model(gguf_file, torch.float32, torch.device("cpu"))


def test_a_gguf_model_trains_on_arithmetic_evaluates_from_step_0_and_saves_plain(gguf_file, tmp_path):
    out = tmp_path / "o"
    args = ["train", f"model={gguf_file}", "data=arithmetic", "eval_data=arithmetic", "eval_every=1"]
    assert cli_main([*args, "steps=2", "max_new_tokens=6", f"out_dir={out}", *SMALL]) == 0
    rows = _rows(out)
    evals = [r for r in rows if "eval_step" in r]
    assert [r["eval_step"] for r in evals] == [0, 1, 2]  # the baseline, after each update
    assert rows[0] == evals[0] and all(0 <= r["eval/reward"] <= 1 for r in evals)
    assert [r["step"] for r in rows if "step" in r] == [0, 1]
    summary = json.loads((out / "summary.json").read_text())
    assert [e[0] for e in summary["evals"]] == [0, 1, 2]
    ckpt = out / "checkpoint-2"
    assert "quantization_config" not in json.loads((ckpt / "config.json").read_text())
    code = (
        "import sys\n"
        "sys.modules['gguf'] = None\n"
        "sys.modules['accelerate'] = None\n"  # neither is needed to load a checkpoint
        "from transformers import AutoModelForCausalLM, AutoTokenizer\n"
        f"m = AutoModelForCausalLM.from_pretrained({str(ckpt)!r})\n"
        f"t = AutoTokenizer.from_pretrained({str(ckpt)!r})\n"
        "n = sum(p.numel() for p in m.parameters())\n"
        "print('LOADED', type(m).__name__, n, t.chat_template is not None)\n"
    )
    got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    n = sum(p.numel() for p in gguf.load_model(gguf_file, torch.float32, torch.device("cpu")).parameters())
    assert f"LOADED LlamaForCausalLM {n} True" in got.stdout, got.stderr[-2000:]


def test_eval_before_train_can_be_turned_off(gguf_file, tmp_path):
    out = tmp_path / "o"
    args = ["train", f"model={gguf_file}", "data=arithmetic", "eval_data=arithmetic", "eval_every=2"]
    assert (
        cli_main([*args, "eval_before_train=false", "steps=2", "max_new_tokens=4", f"out_dir={out}", *SMALL])
        == 0
    )
    assert [r["eval_step"] for r in _rows(out) if "eval_step" in r] == [2]


def test_the_arithmetic_task_holds_out_a_fixed_split():
    train, held = arithmetic.rows("train"), arithmetic.rows("eval")
    assert len(held) == arithmetic.HELD_OUT and not {r["prompt"] for r in train} & {r["prompt"] for r in held}
    assert arithmetic.rows("eval") == held  # the same questions in every run
    ops = {r["prompt"].split()[3] for r in held}
    assert ops == {"plus", "minus", "times"}
    for r in held:
        a, op, b = r["prompt"][len("What is ") : -1].split()
        assert (
            int(r["answer"])
            == {"plus": int(a) + int(b), "minus": int(a) - int(b), "times": int(a) * int(b)}[op]
        )
    with pytest.raises(ValueError, match="split must be one of train, eval"):
        arithmetic.rows("test")


def _unsavable(monkeypatch, after: int = 0) -> list[int]:
    """Make the tiny policy's save_pretrained raise from its ``after``+1-th call on."""
    import transformers

    calls: list[int] = []
    real = transformers.Qwen2ForCausalLM.save_pretrained

    def save(self, *a, **k):
        calls.append(1)
        if len(calls) > after:
            raise RuntimeError("this model refuses to be serialized")
        return real(self, *a, **k)

    monkeypatch.setattr(transformers.Qwen2ForCausalLM, "save_pretrained", save)
    return calls


def test_the_preflight_refuses_a_model_that_cannot_be_saved_before_step_1(tmp_path, monkeypatch, capsys):
    out = tmp_path / "o"
    out.mkdir()
    (out / "log.jsonl").write_text('{"step": 0, "reward": 0.5}\n')  # an earlier run's
    _unsavable(monkeypatch)
    assert cli_main(["train", "steps=2", f"out_dir={out}", *SMALL]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert (
        len(err) == 1
        and "checkpoint: the model's save_pretrained fails" in err[0]
        and "save_every=0" in err[0]
    )
    assert sorted(p.name for p in out.iterdir()) == ["log.jsonl"]  # nothing written over, nothing left
    assert (out / "log.jsonl").read_text() == '{"step": 0, "reward": 0.5}\n'
    assert not list(tmp_path.glob(".rlmem-preflight-*"))
    assert cli_main(["train", "steps=1", "save_every=0", f"out_dir={tmp_path / 'p'}", *SMALL]) == 0


def test_a_save_that_fails_mid_run_falls_back_to_torch_save_and_exits_non_zero(tmp_path, monkeypatch, capsys):
    out = tmp_path / "o"
    calls = _unsavable(monkeypatch, after=1)  # the preflight's dry save passes, the first real one fails
    assert cli_main(["train", "steps=3", "save_every=1", f"out_dir={out}", *SMALL]) == 4
    assert len(calls) == 2
    err = capsys.readouterr().err
    assert "checkpoint-1 could not be written (this model refuses to be serialized)" in err
    fb = out / "fallback-1"
    assert str(fb) in err and not (out / "checkpoint-1").exists() and not (out / "checkpoint-1.tmp").exists()
    weights = torch.load(fb / "model_state.pt")
    state = torch.load(fb / "trainer_state.pt", weights_only=False)
    assert "model.embed_tokens.weight" in weights and state["step"] == 1 and state["optimizer"]["state"]
    assert [r["step"] for r in _rows(out)] == [0]  # the run stopped at the failed save


def test_offloaded_weights_with_a_rollout_copy_sample_the_same_tokens(device):
    kw = dict(max_len=24, batch_size=4, pad_token_id=0, eos_token_id=2, rollout_dtype=torch.bfloat16)
    got = {}
    for params in ("keep", "offload"):
        model = tiny_qwen2(device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        pm = rlmem.PhaseManager(
            model, opt, rlmem.OffloadConfig(offload_during_rollout=True, params=params, engine_sleep_level=2)
        )
        s = HFSampler(model, **kw)
        pm.add_engine(s)
        with pm.rollout(sync_weights=s.sync_weights):
            assert pm.state.paused("params") == (params == "offload")
            got[params] = s.generate(PROMPTS, max_new_tokens=8, temperature=0)
            if params == "offload":  # the training model itself is still refused
                with pytest.raises(
                    RuntimeError, match="the model was called while its parameters are offloaded"
                ):
                    model(torch.tensor([PROMPTS[0]]))
            resident = pm.state.stats().categories["params"].resident_bytes
            assert (resident == 0) == (params == "offload")  # only the copy stays on the device
        with pm.train():
            assert not pm.state.paused("params")
    assert got["offload"] == got["keep"]
