"""``rlmem bench families`` off a GPU: ``rlmem train`` on a tiny random model of each family users train
(Llama, Qwen2, Qwen3, Mistral, Gemma2, Phi-3, GPT-2, GPT-NeoX, OLMo2, Gemma3 and the mixtures of experts
Qwen3-MoE, Mixtral and Qwen2-MoE), saved with ``save_pretrained`` beside a tokenizer trained here, in fp32
for two steps each, and Qwen3 through ``rlmem serve`` equal to the in-process engine bit for bit. On a GPU the
same benchmark runs every precision (``scripts/gpu_check.sh families``)."""

from __future__ import annotations

import json
import math

import pytest

pytest.importorskip("transformers")
pytest.importorskip("fastapi")

from rlmem.benchmarks import families


def test_every_family_trains_in_fp32_and_through_the_server(tmp_path):
    out = tmp_path / "families.json"
    # --merge keeps a cell of an earlier call that this one does not run (a family not asked for now)
    earlier = dict(family="olmo", precision="fp32", rollout_dtype="none", engine="local", passed=True)
    out.write_text(json.dumps({"results": {"cells": [earlier]}}))
    argv = ["--device", "cpu", "--server", "qwen3", "--jobs", "2", "--merge", "--json", str(out)]
    code = families.main(argv)
    data = json.loads(out.read_text())
    assert data["results"]["cells"][0] == earlier
    assert data["config"]["kept_from_earlier_calls"] == ["olmo/fp32/none/local"]
    cells = data["results"]["cells"][1:]
    assert data["summary"]["failed"] == [] and code == 0
    summary = data["summary"]
    assert summary["cells"] == summary["passed"] == len(families.FAMILIES) + 2 == len(cells) + 1
    assert {c["family"] for c in cells} == set(families.FAMILIES)
    for c in cells:
        assert c["precision"] == "fp32" and c["exit_code"] == 0, c
        assert len(c["losses"]) == 2 and all(math.isfinite(x) for x in c["losses"]), c
    served = [c for c in cells if c["engine"] == "server"]
    assert [c["family"] for c in served] == ["qwen3"] and served[0]["same_as_local"]
    # the equality says something: the reward moves with the sampled text, so updates are not zero
    twin = next(c for c in cells if c["family"] == "qwen3" and c["engine"] == "local")
    assert any(x != 0 for x in twin["losses"] + twin["grad_norm"]) and len(set(twin["rewards"])) > 1, twin
    for field in ("losses", "rewards", "tokens", "kl", "grad_norm"):
        other = {**served[0], field: [x + 1 for x in served[0][field]]}
        assert not families._same_as_local(other, cells), field


def test_the_matrix_and_bad_arguments(capsys):
    local, served = families.matrix(
        ["qwen3", "gpt2"], ["bf16-mixed"], ["none", "bf16"], ["qwen3"], ("bf16-mixed", "bf16")
    )
    assert [families.cell_name(c) for c in local] == [
        "qwen3/bf16-mixed/none/local",
        "qwen3/bf16-mixed/bf16/local",
        "gpt2/bf16-mixed/none/local",
        "gpt2/bf16-mixed/bf16/local",
    ]
    assert [families.cell_name(c) for c in served] == ["qwen3/bf16-mixed/bf16/server"]
    # a server cell's local twin joins the matrix where it lacks it
    local, _ = families.matrix(["gpt2"], ["bf16"], ["none"], ["gpt2"], ("bf16-mixed", "bf16"))
    assert families.cell_name(local[-1]) == "gpt2/bf16-mixed/bf16/local"
    for bad, msg in (
        ("--families=opt", "--families: 'opt' is not one of"),
        ("--precisions=fp8", "--precisions: 'fp8' is not one of"),
        ("--server=gpt2", "--server: 'gpt2' is not one of"),
    ):
        with pytest.raises(SystemExit):
            families.main(["--device", "cpu", "--families=qwen3", bad])
        assert msg in capsys.readouterr().err


def test_the_moe_families_route_through_transformers_grouped_experts(tmp_path):
    """The matrix's mixture-of-experts models, loaded as ``rlmem train`` loads them, have an experts module
    of transformers' form in each layer, dispatched by its grouped GEMM (the path whose copy to the host
    broke the sampler's CUDA graphs); its new dense families have none."""
    import transformers

    from rlmem.rollout.sampler._experts import experts_modules

    tok, _ = families.tokenizer_and_data(tmp_path)
    for family, n in (("qwen3_moe", 2), ("mixtral", 2), ("qwen2_moe", 2), ("olmo2", 0), ("gemma3", 0)):
        d = families.model_dir(family, tmp_path / family, tok)
        model = transformers.AutoModelForCausalLM.from_pretrained(str(d))
        assert len(experts_modules(model)) == n, family
        if n:
            assert model.config._experts_implementation == "grouped_mm", family
