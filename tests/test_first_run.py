"""What a first run of the rlmem command meets: fast help, every key listed, numbers read as numbers, one-line
errors, a step line that fits 100 columns."""

from __future__ import annotations

import subprocess
import sys

import pytest

from rlmem.recipes import yaml_config as _config
from rlmem.recipes.config import GRPOConfig, keys_help
from rlmem.recipes.report import step_line as _step_line


def _py(code: str) -> str:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout


def test_help_answers_without_importing_torch() -> None:
    code = (
        "import sys, contextlib, io\n"
        "from rlmem.cli import main\n"
        "for argv in (['--help'], ['train', '--help']):\n"
        "    with contextlib.redirect_stdout(io.StringIO()) as out:\n"
        "        try:\n"
        "            main(argv)\n"
        "        except SystemExit:\n"
        "            pass\n"
        "    print(len(out.getvalue()) > 100)\n"
        "print('torch' in sys.modules)\n"
    )
    assert _py(code).split() == ["True", "True", "False"]


def test_train_help_lists_every_key_with_type_and_default() -> None:
    text = keys_help()
    for name in ("model", "data", "prompt_key", "answer_key", "reward", "save_every", "resume", "lr"):
        assert f"  {name} " in text
    assert "default 'tiny'" in text and "default 0.001" in text


def test_yaml_numbers_are_numbers(tmp_path) -> None:
    f = tmp_path / "c.yaml"
    f.write_text("lr: 1e-5\nsteps: 3\nkv_budget: 64MiB\n")
    cfg = _config.load(GRPOConfig, f, ["weight_decay=1e-2"])
    assert cfg.lr == 1e-5 and cfg.weight_decay == 0.01 and cfg.steps == 3 and cfg.kv_budget == "64MiB"


def test_report_of_a_missing_directory_is_one_line(tmp_path, capsys) -> None:
    from rlmem.cli import main

    assert main(["report", str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("rlmem report: error:") and "nowhere" in err and len(err.splitlines()) == 1


def test_step_line_fits_100_columns() -> None:
    r = dict(
        step=1999,
        reward=0.123,
        loss=-1.2345,
        kl=12.3456,
        tokens_per_s=123456.0,
        rollout_s=123.45,
        train_s=456.78,
        switch_s=1.23,
        used_rollout=70.5 * 2**30,
        used_train=79.9 * 2**30,
    )
    assert len(_step_line(r, 2000)) <= 100


def test_plan_names_a_hub_id_and_defaults_to_mixed_precision(capsys) -> None:
    from rlmem.cli import main

    with pytest.raises(SystemExit):
        main(["plan", "Qwen/Qwen2.5-0.5B", "--micro-batch-tokens", "8k"])
    assert "looks like a Hugging Face hub ID" in capsys.readouterr().err
    assert main(["plan", "qwen2-2.5b", "--micro-batch-tokens", "8k", "--gpu-memory", "80G"]) == 0
    assert "mixed" in capsys.readouterr().out
