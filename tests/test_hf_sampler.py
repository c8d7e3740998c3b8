"""HFSampler: a Hugging Face model sampling into a static KV cache that lives in a Region."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from rlmem import OffloadConfig, PhaseManager  # noqa: E402
from rlmem.integrations.hf import HFSampler, kv_bytes_per_token  # noqa: E402

PROMPTS = [[1, 5, 6, 7, 3], [1, 8, 3], [1, 4, 9, 4, 12, 4, 3], [1, 9, 3], [1, 10, 11, 3]]


def tiny(device: str) -> torch.nn.Module:
    cfg = transformers.Qwen2Config(
        hidden_size=64,
        num_hidden_layers=2,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=14,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        initializer_range=0.5,  # wide random weights: completions differ from prompt to prompt
    )
    torch.manual_seed(0)
    return transformers.Qwen2ForCausalLM(cfg).to(device).eval()


def reference(model, prompt, n):
    out = model.generate(
        torch.tensor([prompt], device=model.device),
        max_new_tokens=n,
        do_sample=False,
        eos_token_id=2,
        pad_token_id=0,
    )[0, len(prompt) :].tolist()
    return out[: out.index(2) + 1] if 2 in out else out


def test_batched_greedy_matches_unbatched_generate(device):
    model = tiny(device)
    s = HFSampler(model, max_len=24, batch_size=4, pad_token_id=0, eos_token_id=2)
    got = s.generate(PROMPTS, max_new_tokens=10, temperature=0)
    assert got == [reference(model, p, 10) for p in PROMPTS]
    assert len({tuple(g) for g in got}) > 1  # not a degenerate model
    assert s.tokens_generated == sum(len(g) for g in got)


def test_cache_lives_in_the_region_and_sleeps(device):
    model = tiny(device)
    s = HFSampler(model, max_len=24, batch_size=2, pad_token_id=0, eos_token_id=2)
    r = s.region
    ptrs = [t.data_ptr() for layer in s.cache.layers for t in (layer.keys, layer.values)]
    assert all(r.data_ptr <= p < r.data_ptr + r.nbytes for p in ptrs)
    first = s.generate(PROMPTS, max_new_tokens=6, temperature=0)
    s.sleep()
    assert r.paused and r.resident_bytes == 0
    with pytest.raises(RuntimeError, match="asleep"):
        s.generate(PROMPTS, max_new_tokens=6)
    s.wake()
    assert [t.data_ptr() for layer in s.cache.layers for t in (layer.keys, layer.values)] == ptrs
    assert s.generate(PROMPTS, max_new_tokens=6, temperature=0) == first


def test_sampling_is_reproducible_with_a_seed(device):
    s = HFSampler(tiny(device), max_len=24, batch_size=3, pad_token_id=0, eos_token_id=2)
    a = s.generate(PROMPTS, max_new_tokens=8, temperature=1.0, top_p=0.9, generator_seed=3)
    b = s.generate(PROMPTS, max_new_tokens=8, temperature=1.0, top_p=0.9, generator_seed=3)
    assert a == b


def test_size_from_a_budget_and_bad_sizes():
    model = tiny("cpu")
    per_seq = kv_bytes_per_token(model.config, torch.float32) * 20
    assert per_seq == 2 * 2 * 2 * 16 * 4 * 20
    s = HFSampler(model, max_len=20, kv_budget_bytes=3 * per_seq + 7, pad_token_id=0, eos_token_id=2)
    assert s.batch_size == 3
    with pytest.raises(ValueError, match="kv_budget_bytes must hold at least one sequence"):
        HFSampler(model, max_len=20, kv_budget_bytes=per_seq - 1, pad_token_id=0, eos_token_id=2)
    with pytest.raises(ValueError, match="max_len"):
        HFSampler(model, max_len=1, batch_size=1, pad_token_id=0, eos_token_id=2)
    with pytest.raises(ValueError, match="exceeds max_len=20"):
        s.generate([[1] * 15], max_new_tokens=8)


def test_phase_manager_sleeps_it_in_train_and_wakes_it_for_rollout(device):
    model = tiny(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    pm = PhaseManager(model, opt, OffloadConfig(offload_during_rollout=True, params="keep"))
    s = HFSampler(model, max_len=24, batch_size=2, pad_token_id=0, eos_token_id=2)
    pm.add_engine(s)
    with pm.rollout():
        out = s.generate(PROMPTS[:2], max_new_tokens=4, temperature=0)
    with pm.train():
        assert s.region.paused and s.region.resident_bytes == 0
        ids = torch.tensor([PROMPTS[0] + out[0]], device=device)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
    with pm.rollout():
        assert not s.region.paused
        s.generate(PROMPTS[:2], max_new_tokens=4, temperature=0)
