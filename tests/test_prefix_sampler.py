"""HFSampler with ``share_prompts``: a group's prompt is prefilled once and held once in the KV cache, and its
rows decode over it and their own completions; outputs as without it, in less of the cache."""

from __future__ import annotations

import copy
import functools
import types
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

from rlmem.rollout.sampler import HFSampler, kv_bytes_per_token  # noqa: E402
from rlmem.rollout.sampler._prefix import _KERNELS, Prefix, _part, groups_of  # noqa: E402
from rlmem.rollout.sampler._slots import GroupSlots  # noqa: E402
from rlmem.rollout.sampler.config import (  # noqa: E402
    SamplerConfig,
    kv_batch_shared,
    kv_rows,
    shared_layout,
)

BASE = [[1, 5, 6, 7, 3], [1, 8, 3], [1, 4, 9, 4, 12, 4, 3], [1, 9, 3], [1, 10, 11, 3]]
FAMILIES = ["llama", "qwen3", "gpt2"]


@functools.cache
def family(name: str, device: str = "cpu") -> torch.nn.Module:
    """A small random model of ``name`` with dropout 0 (GQA for Llama and Qwen3: 8 query heads over 2 KV
    heads), its weights scaled up so that greedy choices are far from ties, in eval mode. Made once (tests
    leave it as they found it)."""
    if name == "gpt2":
        config = transformers.GPT2Config(
            vocab_size=97, n_embd=64, n_layer=2, n_head=4, n_positions=64, bos_token_id=1, eos_token_id=2
        )
        config.resid_pdrop = config.embd_pdrop = config.attn_pdrop = 0.0
        cls = transformers.GPT2LMHeadModel
    else:
        cfg_cls, cls = {
            "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
            "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        }[name]
        config = cfg_cls(
            vocab_size=97,
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=8,
            num_key_value_heads=2,
            head_dim=16,
            max_position_embeddings=64,
            attention_dropout=0.0,
        )
    torch.manual_seed(0)
    with torch.device(device):
        model = cls(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(4.0)
    return model.eval()


def grouped(g: int, base: list[list[int]] = BASE) -> list[list[int]]:
    """Each prompt ``g`` times in a row, as GRPO passes a group."""
    return [p for p in base for _ in range(g)]


def recorded(s: HFSampler) -> list[torch.Tensor]:
    """The logits of each decode step of ``s`` (one token per row) from now on, as computed (eager)."""
    out: list[torch.Tensor] = []
    step = s._forward

    def forward(ids, mask, pos):
        logits = step(ids, mask, pos)
        if ids.shape[1] == 1:
            out.append(logits.detach().float().clone())
        return logits

    s._forward = forward
    return out


KW = dict(max_len=24, pad_token_id=0, eos_token_id=2)


@pytest.mark.parametrize("name", FAMILIES)
def test_greedy_tokens_and_logits_equal_the_unshared_layout(name):
    model = family(name)
    prompts = grouped(4)
    n = len(prompts)
    off = HFSampler(model, batch_size=n, **KW)
    on = HFSampler(model, batch_size=n, share_prompts=True, **KW)
    assert on.share_blocked is None
    want_logits, got_logits = recorded(off), recorded(on)
    want = off.generate(prompts, max_new_tokens=12, temperature=0)
    got = on.generate(prompts, max_new_tokens=12, temperature=0)
    assert on.last_layout == "shared" and off.last_layout == "unshared"
    assert got == want
    assert len({tuple(w) for w in want}) > 1  # not a degenerate model
    # Logits within fp32 rounding at every step, and the greedy choice clear of that: the equal tokens mean
    # the same arithmetic, not a lucky tie.
    assert len(got_logits) == len(want_logits) > 0
    for a, b in zip(want_logits, got_logits, strict=True):
        diff = (a[:n] - b[:n]).abs().max().item()
        top2 = a[:n].topk(2).values
        assert diff < 2e-5, diff
        assert (top2[:, 0] - top2[:, 1]).min().item() > 10 * diff


def test_the_two_part_attention_is_sdpa_over_the_whole_row():
    """Prompt and own columns merged by log-sum-exp against one SDPA over each row's own copy of both
    (the unshared layout's arithmetic): fp32 within 1e-6; bf16 within the bf16 SDPA's own distance from
    fp32 plus one rounding of the output; the fp32 fallback the same as the kernel."""
    torch.manual_seed(0)
    groups, g, kv, grp, d, p_cols, own_cols = 3, 4, 2, 4, 16, 40, 12
    rows = groups * g
    for dtype in (torch.float32, torch.bfloat16):
        q = torch.randn(rows, kv * grp, 1, d, dtype=dtype)
        pk, pv = (torch.randn(groups, kv, p_cols, d, dtype=dtype) for _ in range(2))
        ok, ov = (torch.randn(rows, kv, own_cols, d, dtype=dtype) for _ in range(2))
        plen = torch.tensor([40, 7, 1])
        olen = torch.randint(1, own_cols + 1, (rows,))
        pmask = torch.arange(p_cols)[None] < plen[:, None]
        omask = torch.arange(own_cols)[None] < olen[:, None]

        def additive(m, dtype=dtype):
            return torch.zeros(m.shape, dtype=dtype).masked_fill(~m, float("-inf"))[:, None, None]

        holder = Prefix()
        holder.layers, holder.bias, holder.group = [(pk, pv)], additive(pmask), g
        module = types.SimpleNamespace(layer_idx=0)
        got = holder.attend(module, q, ok, ov, additive(omask), None)[:, 0]  # (rows, heads, d)
        slot = torch.arange(rows) // g
        k, v = torch.cat([pk[slot], ok], 2), torch.cat([pv[slot], ov], 2)
        m = torch.cat([pmask[slot], omask], 1)[:, None, None]
        qg = q.reshape(rows, kv, grp, d)
        want = torch.nn.functional.scaled_dot_product_attention(qg, k, v, attn_mask=m).reshape(rows, -1, d)
        exact = torch.nn.functional.scaled_dot_product_attention(
            *(t.double() for t in (qg, k, v)), attn_mask=m
        )
        exact = exact.reshape(rows, -1, d)
        diff = (got.double() - want.double()).abs().max().item()
        if dtype == torch.float32:
            assert diff < 1e-6, diff
        else:
            own_error = (want.double() - exact).abs().max().item()
            ulp = 2**-8 * exact.abs().max().item()
            assert diff <= own_error + ulp, (diff, own_error)
        # The fp32 arithmetic that serves where PyTorch's kernel is not there.
        bias = holder.bias
        qp = q.reshape(groups, g, kv, grp, d).transpose(1, 2).reshape(groups, kv, g * grp, d)
        kernel = _part(qp, pk, pv, bias, d**-0.5)
        plain = _part(qp.float(), pk.float(), pv.float(), bias.float(), d**-0.5)
        with pytest.MonkeyPatch.context() as mp:
            mp.setitem(_KERNELS, "cpu", False)
            fallback = _part(qp.float(), pk.float(), pv.float(), bias.float(), d**-0.5)
        assert (fallback[0] - plain[0]).abs().max() < 1e-6 and (fallback[1] - plain[1]).abs().max() < 1e-5
        assert (kernel[1] - plain[1]).abs().max() < (1e-5 if dtype == torch.float32 else 0.05)


@pytest.mark.parametrize("top_p", [1.0, 0.8])
def test_seeded_sampling_equals_the_unshared_layout_in_one_batch(top_p):
    # Every row samples in the same order from the same logits (within rounding): the same draws.
    model = family("llama")
    prompts = grouped(4)
    off = HFSampler(model, batch_size=len(prompts), **KW)
    on = HFSampler(model, batch_size=len(prompts), share_prompts=True, **KW)
    want = off.generate(prompts, max_new_tokens=10, temperature=1.0, top_p=top_p, seed=7)
    got = on.generate(prompts, max_new_tokens=10, temperature=1.0, top_p=top_p, seed=7)
    assert on.last_layout == "shared" and got == want
    assert len({tuple(w) for w in want[:4]}) > 1  # a group's rows sample apart
    assert got != on.generate(prompts, max_new_tokens=10, temperature=1.0, top_p=top_p, seed=8)


@pytest.mark.parametrize("name", FAMILIES)
def test_kept_full_groups_give_the_greedy_tokens(name):
    """More groups than the cache holds, kept full (``refill``): a waiting prompt takes the rows of a group
    whose rows have all ended; completions of varied lengths (EOS) in the order given."""
    model = family(name)
    eos = 2
    # The EOS of this test: the token a row samples most after some prompt, so rows end at varied steps.
    prompts = grouped(3)
    want_s = HFSampler(model, batch_size=len(prompts), **KW)
    free = want_s.generate(prompts, max_new_tokens=12, temperature=0)
    eos = max(set(t for r in free for t in r[1:6]), key=lambda t: sum(r.count(t) for r in free))
    kw = {**KW, "eos_token_id": eos}
    want = HFSampler(model, batch_size=len(prompts), **kw).generate(prompts, max_new_tokens=12, temperature=0)
    assert len({len(w) for w in want}) > 1  # rows end at different steps
    on = HFSampler(model, batch_size=4, share_prompts=True, **kw)
    assert on.rows_for(3, 12) < len(prompts)  # so kept full
    got = on.generate(prompts, max_new_tokens=12, temperature=0)
    assert on.last_layout == "shared" and on.last_rows == on.rows_for(3, 12)
    assert got == want
    # Without refill: batches of whole groups, the same tokens.
    batches = HFSampler(model, batch_size=4, share_prompts=True, refill=False, **kw)
    assert batches.generate(prompts, max_new_tokens=12, temperature=0) == want


def test_runs_of_other_lengths_and_runs_split_across_groups():
    model = family("qwen3")
    prompts = [*grouped(5, BASE[:1]), BASE[1], *grouped(2, BASE[2:3]), *grouped(4, BASE[3:])]
    kw = {**KW, "max_len": 20}
    want = HFSampler(model, batch_size=len(prompts), **kw).generate(prompts, max_new_tokens=6, temperature=0)
    # 40 columns hold one group of 4 rows at most (14 + 4 x 6): the run of 5 is split, its prompt held twice.
    on = HFSampler(model, batch_size=2, share_prompts=True, **kw)
    assert on.rows_for(5, 6) == 4
    assert groups_of(prompts, 4) == [(0, 4), (4, 1), (5, 1), (6, 2), (8, 4), (12, 4)]
    assert on.generate(prompts, max_new_tokens=6, temperature=0) == want
    assert on.last_layout == "shared"


def test_unrepeated_prompts_take_the_unshared_layout():
    model = family("llama")
    off = HFSampler(model, batch_size=4, **KW)
    on = HFSampler(model, batch_size=4, share_prompts=True, **KW)
    want = off.generate(BASE, max_new_tokens=8, temperature=0)
    assert on.generate(BASE, max_new_tokens=8, temperature=0) == want
    assert on.last_layout == "unshared" and on.last_rows == 4
    assert not on._graphs.shared and not on._layouts  # nothing of the shared layout was made
    # Groups that would take more of the cache than rows of their own (a run of 2 among long completions
    # in a short cache) also run unshared.
    mixed = [BASE[0], *BASE]
    want = off.generate(mixed, max_new_tokens=16, temperature=0)
    assert on.generate(mixed, max_new_tokens=16, temperature=0) == want
    assert on.last_layout == "unshared"


def test_the_cache_for_so_many_rows_drops_as_the_formula_says():
    """``kv_batch_shared`` sizes a cache that decodes as many rows in one batch as the unshared layout's
    ``rows x max_len`` cache; the bytes ``memory()`` reports are ``groups x P + rows x R`` token columns,
    rounded up to a row of ``max_len``."""
    model = family("llama")
    g, new, max_len = 8, 6, 24
    prompts = grouped(g, BASE[:4])  # 32 rows, 4 prompts
    rows = len(prompts)
    off = HFSampler(model, batch_size=rows, **KW)
    batch = kv_batch_shared(rows, max_len=max_len, max_new_tokens=new, group_size=g)
    on = HFSampler(model, batch_size=batch, share_prompts=True, **KW)
    per_token = kv_bytes_per_token(model.config, torch.float32)
    cols = 4 * (max_len - new) + rows * new
    assert on.kv_bytes == -(-cols // max_len) * max_len * per_token
    assert off.kv_bytes == rows * max_len * per_token
    padding = off.memory()["kv_cache"] - off.kv_bytes
    assert on.memory()["kv_cache"] == on.kv_bytes + padding  # the same Region bookkeeping, fewer bytes
    assert on.memory()["kv_cache"] / off.memory()["kv_cache"] < (cols + max_len) / (rows * max_len)
    assert on.generate(prompts, max_new_tokens=new, temperature=0) == off.generate(
        prompts, max_new_tokens=new, temperature=0
    )
    assert on.last_rows == rows  # in one batch


def test_more_rows_fit_the_same_budget():
    model = family("gpt2")
    per_token = kv_bytes_per_token(model.config, torch.float32)
    budget = 6 * 24 * per_token
    off = HFSampler(model, kv_budget_bytes=budget, **KW)
    on = HFSampler(model, kv_budget_bytes=budget, share_prompts=True, **KW)
    assert on.batch_size == off.batch_size == 6 and on.kv_bytes == off.kv_bytes
    fits = on.rows_for(4, 4)
    assert fits == kv_rows(per_token, budget, max_len=24, max_new_tokens=4, group_size=4) == 16
    assert off.rows_for(4, 4) == 6
    prompts = grouped(4, BASE[:4])
    want = off.generate(prompts, max_new_tokens=4, temperature=0)
    assert off.last_rows == 6
    assert on.generate(prompts, max_new_tokens=4, temperature=0) == want and on.last_rows == fits


def test_families_it_cannot_serve_keep_the_unshared_layout():
    kw = {**KW, "batch_size": 8}
    prompts = grouped(4, BASE[:2])
    eager = copy.deepcopy(family("gpt2"))
    eager.config._attn_implementation = "eager"
    mistral = transformers.MistralForCausalLM(
        transformers.MistralConfig(
            vocab_size=97,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            sliding_window=8,
        )
    ).eval()
    on = HFSampler(eager, share_prompts=True, **kw)
    assert "'eager', not SDPA" in on.share_blocked  # softcap families (Gemma2) run eager too
    assert on.rows_for(4, 8) == on.batch_size
    want = HFSampler(eager, **kw).generate(prompts, max_new_tokens=8, temperature=0)
    assert on.generate(prompts, max_new_tokens=8, temperature=0) == want
    assert on.last_layout == "unshared"
    # A window shorter than max_len (the unshared layout's static cache gives such layers the window's
    # columns alone, so neither layout generates here); a long enough one changes nothing.
    assert "sliding window of 8 < max_len=24" in HFSampler(mistral, share_prompts=True, **kw).share_blocked
    mistral.config.sliding_window = 24
    assert HFSampler(mistral, share_prompts=True, **kw).share_blocked is None


def test_bad_share_prompts_values_are_refused():
    model = family("llama")
    for bad in ("yes", 1, None):
        with pytest.raises(ValueError, match="share_prompts must be True or False"):
            HFSampler(model, batch_size=2, share_prompts=bad, **KW)
        with pytest.raises(ValueError, match="share_prompts must be True or False"):
            SamplerConfig(batch_size=2, share_prompts=bad, **KW)
    cfg = SamplerConfig(batch_size=2, share_prompts=True, **KW)
    assert SamplerConfig.from_json(cfg.to_json()) == cfg and cfg.sampler_kwargs()["share_prompts"] is True
    s = HFSampler(model, batch_size=2, **KW)
    assert s._prefix is None and s.share_blocked is None  # off: nothing of it is made
    with pytest.raises(ValueError, match="group_size"):
        s.rows_for(0, 4)
    with pytest.raises(ValueError, match="max_new_tokens must be below max_len"):
        s.rows_for(2, 24)


def test_the_sizing_functions():
    # P=2048, G=16, R=256: 6144 columns per group where the unshared layout takes 16 x 2304.
    assert shared_layout(16 * 2304, max_len=2304, max_new_tokens=256, group_size=16) == (6, 16)
    assert shared_layout(3000, max_len=2304, max_new_tokens=256, group_size=16) == (1, 3)
    assert shared_layout(2304, max_len=2304, max_new_tokens=256, group_size=16) == (0, 0)
    assert shared_layout(16 * 2304, max_len=2304, max_new_tokens=256, group_size=1) == (0, 0)
    assert kv_rows(2, 2 * 10 * 2304, max_len=2304, max_new_tokens=256) == 10
    assert kv_rows(2, 2 * 10 * 2304, max_len=2304, max_new_tokens=256, group_size=16) == 48
    batch = kv_batch_shared(256, max_len=2304, max_new_tokens=256, group_size=16)
    assert batch == 43 and batch * 2304 / (256 * 2304) < 0.18  # the floor: (128 + 256) / 2304 = 0.167
    assert shared_layout(batch * 2304, max_len=2304, max_new_tokens=256, group_size=16) == (16, 16)
    with pytest.raises(ValueError, match="kv_budget_bytes must hold at least one sequence"):
        kv_rows(2, 100, max_len=2304, max_new_tokens=256, group_size=16)
    with pytest.raises(ValueError, match="max_new_tokens must be below max_len"):
        kv_batch_shared(8, max_len=64, max_new_tokens=64, group_size=4)


def test_group_slots_admit_whole_groups_into_free_blocks():
    prompts = [[1, 2]] * 3 + [[3]] * 2 + [[4, 5, 6]]
    slots = GroupSlots(2, 3, prompts, [(0, 3), (3, 2), (5, 1)], max_new=2, eos=9)
    assert slots.admit() == [(0, 0), (1, 1), (2, 2), (3, 3), (4, 4)]
    # Rows 0 and 3 end; neither block is free until all its rows have ended.
    assert slots.record([[9], [7], [7], [9], [7], [7]]) == [0, 3]
    assert slots.admit() == []
    assert slots.record([[7], [9], [9], [7], [9], [7]]) == [1, 2, 4]
    assert slots.admit() == [(0, 5)]  # block 0 free, block 1 still has no decoding row: the last group
    assert slots.seq == [5, None, None, None, None, None]


@pytest.mark.cuda
@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cuda_graphs_shared_decode_matches_the_unshared_layout(name, dtype):
    """Both layouts under CUDA graphs (one batch, then kept full): greedy tokens equal wherever the
    top-2 margin of the model's own forward is clear of the rounding, up to a row's first unclear step
    (fp32: 1e-3; bf16: 0.5: the decode's bf16 logits, ~4 in magnitude, differ from the full forward's in
    either layout, and at 0.1 the H200 let through a Llama step where the two layouts took different
    tokens); in fp32 at least one row is compared whole; a second call captures nothing more and repeats the
    first."""
    model = family(name, "cuda")
    compute = None if dtype == torch.float32 else dtype
    prompts = grouped(4)
    kw = {**KW, "compute_dtype": compute, "cuda_graphs": "on"}
    tol = 1e-3 if dtype == torch.float32 else 0.5
    off = HFSampler(model, batch_size=len(prompts), **kw)
    want = off.generate(prompts, max_new_tokens=12, temperature=0)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        on = HFSampler(model, batch_size=len(prompts), share_prompts=True, **kw)
        got = on.generate(prompts, max_new_tokens=12, temperature=0)
        captures = on.captures
        again = on.generate(prompts, max_new_tokens=12, temperature=0)
        small = HFSampler(model, batch_size=6, share_prompts=True, **kw)  # kept full: 2 groups at once
        full = small.generate(prompts, max_new_tokens=12, temperature=0)
    assert not [w for w in seen if "shared prompts" in str(w.message) or "captured" in str(w.message)]
    assert on.last_layout == small.last_layout == "shared" and on.cuda_graphs and small.cuda_graphs
    assert captures > 0 and on.captures == captures and again == got
    assert small.last_rows == 8 and len(prompts) > 8
    autocast = torch.autocast("cuda", dtype=dtype) if compute else torch.autocast("cuda", enabled=False)
    whole = 0
    for prompt, w, outs in zip(prompts, want, zip(got, full, strict=True), strict=True):
        with torch.no_grad(), autocast:
            logits = model(torch.tensor([prompt + w], device="cuda")).logits[0, len(prompt) - 1 : -1].float()
        top2 = logits.topk(2).values
        clear = (top2[:, 0] - top2[:, 1] > tol).tolist()
        upto = clear.index(False) + 1 if False in clear else len(w)
        whole += upto == len(w)
        for out in outs:
            assert out[:upto] == w[:upto]
    # fp32: a row compared whole; bf16: the first token of every row at least (a random model's margins are
    # rarely clear of bf16's rounding for long)
    assert whole >= 1 or dtype == torch.bfloat16
