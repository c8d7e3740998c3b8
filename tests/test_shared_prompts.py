"""Each GRPO group's prompt forwarded once (rlmem.recipes.shared_prompts) against the row-by-row path of the
recipe (``make_batch`` + ``token_logprobs``): the log-probs, the GRPO loss and KL, and the parameter
gradients agree within fp32 rounding, for grouped-query Llama, Qwen2, Qwen3 and Mistral models and GPT-2,
with gradient checkpointing, groups split in chunks, under FSDP2 on two ranks, and in the recipe itself.

Largest differences measured on the CPU (torch 2.13, transformers 5.24, fp32), against the bounds asserted:
log-probs 4.8e-7 (bound 5e-6), loss 3.6e-8 (bound 1e-6), summed KL 1.2e-7 (bound 2e-6), a gradient
element 7.1e-8 with gradients up to 0.26 (bound 2e-6); FSDP2 on two Gloo ranks: log-probs 9.5e-7, loss
2.2e-8, KL 2.4e-7, gradients 3.0e-8; the recipe's losses with prompts shared and not: 1.3e-6 relative
(bound 2e-5).
"""

from __future__ import annotations

import contextlib
import json
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("yaml")

from _helpers import run_launcher

from rlmem.recipes import shared_prompts as sp
from rlmem.recipes.grpo import GRPOConfig, group_micro_batches, grpo_loss, make_batch, run, token_logprobs
from rlmem.recipes.runtime import Runtime

V = 97
G = 4
PROMPT_LENS = (9, 1, 6)  # a one-token prompt: its packed row has no prefix token at all
COMP_LENS = ((3, 7, 0, 5), (6, 1, 4, 2), (7, 7, 3, 1))  # an empty completion: no target
KW = dict(clip_eps=0.2, kl_coef=0.1)


def _model(family: str, gc: bool = False) -> torch.nn.Module:
    """A tiny random model of ``family``, grouped-query (4 heads over 2) where the family has it, dropout
    0 (the equality needs the same arithmetic, not the same random draws), in training mode."""
    import transformers as tf

    torch.manual_seed(1)
    common = dict(
        hidden_size=64,
        num_hidden_layers=2,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        vocab_size=V,
    )
    if family == "gpt2":
        drop = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=1, eos_token_id=1)
        model = tf.GPT2LMHeadModel(
            tf.GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=128, vocab_size=V, **drop)
        )
    else:
        names = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3", "mistral": "Mistral"}[family]
        extra = {"head_dim": 16} if family == "qwen3" else {}
        model = getattr(tf, f"{names}ForCausalLM")(getattr(tf, f"{names}Config")(**common, **extra))
    model.train()
    if gc:  # Hugging Face's switch, renamed in transformers 5.x
        (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()
    return model


def _data(seed: int = 0) -> tuple[list[list[int]], list[list[int]], torch.Tensor]:
    """A prompt per row (``G`` rows a group) and a completion per row, and advantages."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, V, (n,), generator=g).tolist() for n in PROMPT_LENS]
    comps = [torch.randint(3, V, (n,), generator=g).tolist() for lens in COMP_LENS for n in lens]
    return [p for p in prompts for _ in range(G)], comps, torch.randn(len(comps), generator=g)


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for k, p in model.named_parameters():
        grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        out[k] = grad.detach().clone()
    model.zero_grad(set_to_none=True)
    return out


def _compare(
    model: torch.nn.Module, rows: int, seed: int = 0, autocast: Any = contextlib.nullcontext
) -> dict[str, float]:
    """The row-by-row and the shared paths on the same batch (old and reference log-probs perturbed from the
    model's, so the ratio clips and the KL is not zero): their largest differences."""
    device = next(model.parameters()).device
    prompts, comps, adv = _data(seed)
    b = make_batch([p + c for p, c in zip(prompts, comps, strict=True)], [len(p) for p in prompts], pad=0)
    b, adv = {k: v.to(device) for k, v in b.items()}, adv.to(device)
    width = b["ids"].shape[1]
    logp = token_logprobs(model, b["ids"], b["attn"], autocast)
    g = torch.Generator().manual_seed(5)
    old = logp.detach() + 0.05 * torch.randn(logp.shape, generator=g).to(device)
    ref = logp.detach() + 0.05 * torch.randn(logp.shape, generator=g).to(device)
    denom = b["resp"].sum().item()
    loss, kl = grpo_loss(logp, old, ref, adv, b["resp"], denom=denom, **KW)
    loss.backward()
    want = _grads(model)

    groups = sp.Groups.from_rows(prompts, comps, G, pad_id=0)
    got_logp = torch.full_like(logp, float("nan"))
    got_loss = got_kl = 0.0
    for chunks in sp.micro_batches(groups, range(groups.n_groups), rows):
        packed = groups.pack(chunks, width).to(device)
        r = packed.rows.to(device)
        with sp.packed_attention(model, packed):
            lp = sp.packed_logprobs(model, packed, autocast)
            part, part_kl = grpo_loss(lp, old[r], ref[r], adv[r], b["resp"][r], denom=denom, **KW)
            part.backward()
        got_logp[r] = lp.detach()
        got_loss += part.item()
        got_kl += part_kl.item()
    got = _grads(model)
    resp = b["resp"].bool()
    assert not got_logp.isnan().any()  # every row scored once
    assert (got_logp[~resp] == 0).all()  # zero off the completions
    return {
        "logp": (got_logp - logp.detach())[resp].abs().max().item(),
        "loss": abs(got_loss - loss.item()),
        "kl": abs(got_kl - kl.item()),
        "grad": max((got[k] - want[k]).abs().max().item() for k in want),
        "grad_max": max(want[k].abs().max().item() for k in want),
    }


@pytest.mark.parametrize("rows", [12, 3], ids=["whole-groups", "chunks"])
@pytest.mark.parametrize("gc", [False, True], ids=["plain", "checkpointed"])
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral", "gpt2"])
def test_shared_prompts_equal_row_by_row(family, gc, rows):
    model = _model(family, gc)
    assert sp.unsupported(model, 64) is None
    d = _compare(model, rows)
    assert d["logp"] < 5e-6 and d["loss"] < 1e-6 and d["kl"] < 2e-6, d
    assert d["grad"] < 2e-6 and d["grad_max"] > 0.01, d
    assert model.config._attn_implementation == "sdpa"  # given back after each block


@pytest.mark.cuda
@pytest.mark.parametrize("precision", ["fp32", "bf16-autocast"])
def test_shared_prompts_equal_row_by_row_on_cuda(precision):
    # SDPA's CUDA kernels (memory-efficient with the suffixes' mask, flash or cuDNN for the causal prefix)
    # in place of the CPU's. In fp32 the CPU's bounds; under bf16 autocast each path rounds its own way.
    model = _model("llama", gc=True).cuda()
    if precision == "fp32":
        d = _compare(model, rows=3)
        assert d["logp"] < 5e-6 and d["loss"] < 1e-6 and d["kl"] < 2e-6 and d["grad"] < 2e-6, d
    else:
        d = _compare(model, rows=3, autocast=lambda: torch.autocast("cuda", dtype=torch.bfloat16))
        # Under bf16 autocast on the CPU: log-probs equal, gradients 6.8e-4 apart (0.5% of the largest).
        assert d["logp"] < 0.05 and d["grad"] < 0.05 * d["grad_max"], d


def test_micro_batches_hold_whole_groups_or_chunks_of_one():
    prompts, comps, _ = _data()
    groups = sp.Groups.from_rows(prompts, comps, G, pad_id=0)
    order = [2, 0, 1]
    two = sp.micro_batches(groups, order, 8)
    assert [[(c.group, c.start, c.stop) for c in mb] for mb in two] == [[(2, 0, 4), (0, 0, 4)], [(1, 0, 4)]]
    three = sp.micro_batches(groups, order, 3)  # a group of 4 in chunks of 2 and 2, the prompt in each
    assert [(c.group, c.start, c.stop) for mb in three for c in mb] == [
        (g, a, a + 2) for g in order for a in (0, 2)
    ]
    assert groups.rows(three[1]).tolist() == [10, 11]
    assert groups.group_rows([1, 0]).tolist() == [4, 5, 6, 7, 0, 1, 2, 3]
    # rows 10 and 11: prompt of 6 tokens, completions of 3 and 1 -> [5 prompt tokens, padded to 12 (so that
    # prefix + suffix is a multiple of 16) | prompt[-1] + 3 tokens | prompt[-1] + 1 token, padded to 4]
    packed = groups.pack(three[1], 16)
    assert (packed.members, packed.suffix, packed.prefix) == (2, 4, 12)
    assert packed.ids[0, :5].tolist() == prompts[10][:-1] and packed.prefix_lens.tolist() == [5]
    assert packed.ids[0, 12:18].tolist() == [prompts[10][-1], *comps[10], prompts[10][-1], *comps[11]]
    assert packed.positions[0, 12:20].tolist() == [5, 6, 7, 8, 5, 6, 6, 6]  # a pad repeats the last one
    assert packed.keep.tolist() == [12, 13, 14, 16, 17, 18] and packed.targets[0, 3].item() == comps[11][0]
    with pytest.raises(ValueError, match="width"):
        groups.pack(three[0], 12)
    with pytest.raises(ValueError, match="differs from prompts"):
        sp.Groups.from_rows([[1, 2], [1, 3]], [[4], [5]], 2, pad_id=0)
    with pytest.raises(ValueError, match="multiple of group_size"):
        sp.Groups.from_rows([[1, 2]] * 3, [[4]] * 3, 2, pad_id=0)


def test_dynamic_micro_batches_cost_a_group_its_packed_length():
    prompts, comps, _ = _data()
    groups = sp.Groups.from_rows(prompts, comps, G, pad_id=0)
    # whole groups: prompt[:-1] + 4 x (longest completion + 1): 8 + 4 x 8, 0 + 4 x 7, 5 + 4 x 8
    assert [groups.packed_length(sp.Chunk(g, 0, G)) for g in range(3)] == [40, 28, 37]
    cfg = GRPOConfig(dynamic_batching=True, max_tokens_per_micro_batch=36)
    one_cpu = Runtime(torch.device("cpu"), 0, 1, "fp32", torch.float32, None, None)
    parts = group_micro_batches(cfg, groups, torch.tensor([0, 1, 2]), one_cpu)
    chunks = [c for mb in parts for c in mb]
    assert sorted(groups.rows(chunks).tolist()) == list(range(12))  # every row once
    assert sp.Chunk(1, 0, 4) in chunks  # fits whole; the other two are split in halves
    assert {c for c in chunks if c.group != 1} == {sp.Chunk(g, a, a + 2) for g in (0, 2) for a in (0, 2)}
    for mb in parts:
        assert len(mb) * max(groups.packed_length(c) for c in mb) <= 36

    class OtherRankNeedsSeven:  # the all-reduce's MAX as another rank would answer it
        def all_reduce(self, t, op=None):
            return torch.tensor([7])

    # Under FSDP every rank runs as many micro-batches: the groups that fit in one here are cut in 7 chunks.
    cfg = GRPOConfig(dynamic_batching=True, max_tokens_per_micro_batch=200)
    assert len(group_micro_batches(cfg, groups, torch.tensor([0, 1, 2]), one_cpu)) == 1
    parts = group_micro_batches(cfg, groups, torch.tensor([0, 1, 2]), OtherRankNeedsSeven())
    assert len(parts) == 7 and all(parts)
    assert sorted(groups.rows([c for mb in parts for c in mb]).tolist()) == list(range(12))


def test_unsupported_models_and_misuse():
    import transformers as tf

    common = dict(hidden_size=32, num_hidden_layers=1, intermediate_size=64, num_attention_heads=2)
    common.update(num_key_value_heads=1, vocab_size=V)
    mistral = tf.MistralForCausalLM(tf.MistralConfig(**common, sliding_window=16))
    assert "sliding_window=16" in sp.unsupported(mistral, 64)
    assert sp.unsupported(mistral, 16) is None  # no sequence longer than the window: nothing slides
    gpt2 = tf.GPT2LMHeadModel(tf.GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=V, eos_token_id=1))
    gpt2.config.reorder_and_upcast_attn = True
    assert "reorder_and_upcast_attn" in sp.unsupported(gpt2, 64)
    assert "not one of" in sp.unsupported(torch.nn.Linear(2, 2), 64)

    model = _model("llama")
    prompts, comps, _ = _data()
    groups = sp.Groups.from_rows(prompts, comps, G, pad_id=0)
    packed = groups.pack([sp.Chunk(0, 0, G)], 16)
    with pytest.raises(RuntimeError, match="inside packed_attention"):
        sp.packed_logprobs(model, packed)
    with (
        pytest.raises(ValueError, match="sliding_window=16"),
        sp.packed_attention(mistral, groups.pack([sp.Chunk(0, 0, G)], 40)),
    ):
        pass
    with pytest.raises(KeyError), sp.packed_attention(model, packed):
        with pytest.raises(RuntimeError, match="already in force"), sp.packed_attention(model, packed):
            pass
        raise KeyError("leaves the block")
    assert model.config._attn_implementation == "sdpa"  # restored on the way out of a failed block


def _fsdp_worker(rank: int, world: int, port: int, out: str) -> None:
    """Two ranks of FSDP2 (each decoder layer, then the root, as the recipe shards): each compares the
    shared path with the row-by-row one on data of its own, gradient checkpointing off and on."""
    from _helpers import rank_group
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    with rank_group("gloo", rank, world, port):
        res = {}
        for gc in (False, True):
            model = _model("llama", gc)
            mesh = init_device_mesh("cpu", (world,))
            for layer in model.model.layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
            model.set_reshard_after_forward(False, recurse=False)  # the recipe's setting for the root
            res[f"gc={gc}"] = _compare(model, rows=6, seed=rank)
        gathered = [None] * world
        torch.distributed.all_gather_object(gathered, res)
        if rank == 0:
            Path(out).write_text(json.dumps(gathered))


def test_fsdp2_two_gloo_ranks_equal_row_by_row(tmp_path):
    out = tmp_path / "fsdp.json"
    tests = Path(__file__).parent
    code = f"""
        import sys
        sys.path[:0] = [{str(tests)!r}, {str(tests.parent)!r}]
        from _helpers import spawn_ranks
        from test_shared_prompts import _fsdp_worker
        spawn_ranks(_fsdp_worker, 2, {str(out)!r})
    """
    proc = run_launcher([sys.executable, "-c", textwrap.dedent(code)], timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    ranks = json.loads(out.read_text())
    assert len(ranks) == 2
    for d in (d for r in ranks for d in r.values()):
        assert d["logp"] < 5e-6 and d["loss"] < 1e-6 and d["kl"] < 2e-6, d
        assert d["grad"] < 2e-6 and d["grad_max"] > 0.01, d


def test_recipe_same_losses_with_prompts_shared(tmp_path, monkeypatch):
    calls: list[tuple[bool, list[int]]] = []
    real = sp.packed_logprobs

    def recorded(model, packed, autocast=contextlib.nullcontext):
        calls.append((torch.is_grad_enabled(), packed.rows.tolist()))
        return real(model, packed, autocast)

    monkeypatch.setattr(sp, "packed_logprobs", recorded)
    kw = dict(steps=2, prompts_per_step=4, group_size=G, kl_coef=0.1, updates_per_step=1, micro_batch_size=2)
    kw.update(gradient_checkpointing=True, device="cpu", progress=False, plot=False)
    summaries = {}
    for share in (False, True):
        calls.clear()
        cfg = GRPOConfig(out_dir=str(tmp_path / f"share-{share}"), share_prompts=share, **kw)
        summaries[share] = run(cfg, echo=lambda *a, **k: None)
        assert bool(calls) == share  # the shared path ran exactly when asked for
    off, on = summaries[False], summaries[True]
    assert on["rewards"] == off["rewards"]  # the same rollouts
    assert on["losses"] == pytest.approx(off["losses"], rel=2e-5, abs=1e-9)
    # Per step: the policy's and the reference's scores in batch order, then the update's chunks, whole groups
    # in the order of the step's seeded permutation, each group in two chunks of micro_batch_size rows.
    per_step = 2 * 8 + 8
    assert len(calls) == 2 * per_step
    for step in range(2):
        mine = calls[step * per_step : (step + 1) * per_step]
        scored = [r for grad, rows in mine[:16] for r in rows if not grad]
        assert scored == list(range(16)) * 2
        order = torch.randperm(4, generator=torch.Generator().manual_seed(step)).tolist()
        assert [rows for grad, rows in mine[16:] if grad] == [
            [g * G + a, g * G + a + 1] for g in order for a in (0, 2)
        ]
