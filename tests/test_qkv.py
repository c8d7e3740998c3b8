"""Fused query/key/value projections while sampling (``_qkv``): one GEMM per layer over a copy of the three
weights that lives and sleeps with the KV cache and follows the weights from one generation to the next;
greedy tokens those of ``generate()``; and decode steps that hand SDPA an additive mask made once per step."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from _models import grouped_model, reference  # noqa: E402

from rlmem.rollout import HFSampler  # noqa: E402

PROMPTS = [[5, 9, 3], [7, 1, 4, 4, 8], [11, 12], [3, 3, 3, 9, 10, 6], [20]]
KW = dict(max_len=32, batch_size=4, pad_token_id=0, eos_token_id=2)


def _proj_bytes(model: torch.nn.Module) -> int:
    return sum(
        t.numel() * t.element_size()
        for n, t in model.named_parameters()
        if n.split(".")[-2] in ("q_proj", "k_proj", "v_proj")
    )


class _Linears:
    """The output widths of every ``F.linear`` call."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.widths: list[int] = []
        real = torch.nn.functional.linear

        def spy(x, w, b=None):
            self.widths.append(w.shape[0])
            return real(x, w, b)

        monkeypatch.setattr(torch.nn.functional, "linear", spy)


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3"])
def test_one_gemm_per_layer_for_the_three_projections_with_generate_s_tokens(family, monkeypatch):
    model = grouped_model(family, "cpu")
    cfg = model.config
    qkv = (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * cfg.head_dim
    s = HFSampler(model, fused="on", **KW)
    assert s.memory()["fused_weights"] == _proj_bytes(model)
    spy = _Linears(monkeypatch)
    got = s.generate(PROMPTS, max_new_tokens=10, temperature=0)
    monkeypatch.undo()
    # every forward (prefills and decode steps) ran one GEMM of the three widths per layer, no other
    per_layer = [w for w in spy.widths if w in (qkv, cfg.num_key_value_heads * cfg.head_dim)]
    assert per_layer and set(per_layer) == {qkv}
    assert got == [reference(model, p, 10) for p in PROMPTS]
    assert all("forward" not in vars(m) for m in model.modules())  # the swap is undone after sampling
    off = HFSampler(model, fused="off", **KW)
    assert off.memory()["fused_weights"] == 0 and off.kv_bytes == s.kv_bytes


def test_the_copy_follows_the_weights_and_sleeps_with_the_cache():
    model = grouped_model("qwen2", "cpu")
    s = HFSampler(model, fused="on", **KW)
    before = s.generate(PROMPTS, max_new_tokens=8, temperature=0)
    with torch.no_grad():  # an optimizer step, in place: the next generation must see it
        for layer in model.model.layers:
            layer.self_attn.k_proj.weight.mul_(-1.5)
            layer.self_attn.v_proj.bias.add_(0.5)
    after = s.generate(PROMPTS, max_new_tokens=8, temperature=0)
    assert after == [reference(model, p, 8) for p in PROMPTS] and after != before
    kv = s.memory()["kv_cache"]
    s.sleep()
    assert s.memory()["fused_weights"] == 0 and s.memory()["kv_cache"] == 0
    s.wake()
    assert s.memory()["fused_weights"] == _proj_bytes(model) and s.memory()["kv_cache"] == kv
    assert s.generate(PROMPTS, max_new_tokens=8, temperature=0) == after


def test_the_copy_is_taken_from_the_weights_the_sampler_runs_over():
    model = grouped_model("llama", "cpu")
    other = grouped_model("llama", "cpu")
    with torch.no_grad():
        for p in other.parameters():
            p.copy_(torch.randn_like(p) * p.std())
    s = HFSampler(model, fused="on", weights=dict(other.named_parameters()), **KW)
    assert s.generate(PROMPTS, max_new_tokens=8, temperature=0) == [reference(other, p, 8) for p in PROMPTS]


def test_a_decode_step_hands_attention_an_additive_mask(monkeypatch):
    model = grouped_model("qwen3", "cpu")
    s = HFSampler(model, **KW)
    masks: list[torch.Tensor] = []
    real = torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, **kw):
        masks.append(attn_mask)
        return real(q, k, v, attn_mask=attn_mask, **kw)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    got = s.generate(PROMPTS[:2], max_new_tokens=6, temperature=0)
    monkeypatch.undo()
    decode = [m for m in masks if m is not None and m.shape[2] == 1]
    assert decode and all(m.dtype == torch.float32 for m in decode)
    # one mask per step, shared by the layers; 0 where attended, -inf elsewhere
    assert len({id(m) for m in decode}) == len(decode) // model.config.num_hidden_layers
    assert set(torch.unique(decode[-1]).tolist()) == {0.0, float("-inf")}
    assert got == [reference(model, p, 6) for p in PROMPTS[:2]]
