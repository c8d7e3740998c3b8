"""Grouped-query decode: HFSampler's decode steps of models with fewer KV heads than query heads read the
cache as it is (each KV head once for its group), with greedy tokens those of ``generate()``, and (on a GPU)
CUDA-graph decode bit-identical to eager decode, for Llama-, Mistral-, Qwen2- and Qwen3-shaped models."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from _models import grouped_model, reference  # noqa: E402

from rlmem.rollout.sampler import HFSampler, _gqa  # noqa: E402

HEADS, KV = 8, 2
PROMPTS = [[5, 9, 3], [7, 1, 4, 4, 8], [11, 12], [3, 3, 3, 9, 10, 6], [20]]


class _Spy:
    """Every SDPA call's query and key shapes."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
        real = torch.nn.functional.scaled_dot_product_attention

        def spy(q, k, v, *a, **kw):
            self.calls.append((tuple(q.shape), tuple(k.shape)))
            return real(q, k, v, *a, **kw)

        monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3"])
def test_grouped_decode_reads_the_cache_as_it_is_and_matches_generate(family, monkeypatch):
    model = grouped_model(family, "cpu", HEADS, KV)
    s = HFSampler(model, max_len=32, batch_size=4, pad_token_id=0, eos_token_id=2)
    spy = _Spy(monkeypatch)
    got = s.generate(PROMPTS, max_new_tokens=12, temperature=0)
    decode = [(q, k) for q, k in spy.calls if q[2] == HEADS // KV and q[1] == KV]
    assert decode, "no packed decode step ran"
    assert all(k[1] == KV for _, k in decode)  # the cache's own KV heads, never expanded
    monkeypatch.undo()
    assert got == [reference(model, p, 12) for p in PROMPTS]
    assert len({tuple(g) for g in got}) > 1
    assert model.config._attn_implementation == "sdpa"  # the swap is undone after sampling
    # The same tokens as transformers' own attention path in the sampler.
    off = HFSampler(model, max_len=32, batch_size=4, pad_token_id=0, eos_token_id=2, gqa="off")
    assert off.generate(PROMPTS, max_new_tokens=12, temperature=0) == got


def test_models_whose_heads_are_not_grouped_are_left_alone():
    model = grouped_model("qwen2", "cpu", HEADS, KV)
    model.config.num_key_value_heads = HEADS
    assert not _gqa.grouped(model)
    with _gqa.grouped_decode(model) as on:
        assert not on and model.config._attn_implementation == "sdpa"
    model.config.num_key_value_heads = KV
    model.config._attn_implementation = "eager"
    assert not _gqa.grouped(model)  # only SDPA is replaced


@pytest.mark.cuda
@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3"])
def test_grouped_graph_decode_is_eager_decode_and_generate(family):
    model = grouped_model(family, "cuda", HEADS, KV).to(torch.bfloat16)
    kw = dict(max_len=32, batch_size=4, pad_token_id=0, eos_token_id=2, kv_block=8)
    eager = HFSampler(model, cuda_graphs="off", fused="on", **kw)
    graphs = HFSampler(model, cuda_graphs="on", **kw)

    def both(s: HFSampler) -> tuple:
        return (
            s.generate(PROMPTS, max_new_tokens=12, temperature=0),
            s.generate(PROMPTS, max_new_tokens=12, temperature=1.0, top_p=0.9, seed=5),
        )

    want = both(eager)
    assert both(graphs) == want and graphs.captures > 0
    plain = HFSampler(model, cuda_graphs="off", fused="off", **kw)
    assert plain.generate(PROMPTS, max_new_tokens=12, temperature=0) == [
        reference(model, p, 12) for p in PROMPTS
    ]
