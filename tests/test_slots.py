"""Batches kept full: the host's bookkeeping of rows and waiting sequences (``_slots.Slots``), and
HFSampler with more sequences than rows: a row whose sequence ended takes the next waiting one, every
sequence's greedy tokens those of the one-batch-at-a-time path, in fewer decode steps, reproducible when
sampled; on a GPU the same with CUDA graphs, captured once."""

from __future__ import annotations

import random

import pytest
import torch

transformers = pytest.importorskip("transformers")

from _models import grouped_model  # noqa: E402

from rlmem.rollout import HFSampler  # noqa: E402
from rlmem.rollout.sampler._slots import Slots  # noqa: E402


def test_rows_are_refilled_in_order_and_ended_sequences_kept():
    s = Slots(2, [[1, 2], [3], [4, 5, 6], [7]], max_new=3, eos=0)
    assert s.admit() == [(0, 0), (1, 1)] and s.length == [2, 1]
    assert s.steps_left() == 3
    # row 0 samples EOS at its second step (the token after it is not kept); row 1 goes on
    assert s.record([[9, 0, 8], [5, 6]]) == [0]
    assert s.results[0] == [9, 0] and s.seq == [None, 1] and s.length[1] == 3
    assert s.steps_left() == 1
    assert s.admit() == [(0, 2)] and s.length[0] == 3
    assert s.record([[4], [7]]) == [1]  # row 1's third token: its max_new
    assert s.results[1] == [5, 6, 7]
    assert s.admit() == [(1, 3)]
    assert s.record([[0, 1], [2, 2]]) == [0] and s.results[2] == [4, 0]
    assert not s.done and s.admit() == []
    s.record([[], [0]])
    assert s.done and s.outputs() == [[9, 0], [5, 6, 7], [4, 0], [2, 2, 0]]
    with pytest.raises(ValueError, match="positive"):
        Slots(0, [[1]], max_new=1, eos=0)


def test_rows_are_admitted_a_quarter_at_a_time_while_others_decode():
    s = Slots(8, [[1]] * 11, max_new=4, eos=0)
    assert s.admit_at == 2 and len(s.admit()) == 8  # all idle: every row at once
    assert s.record([[0]] + [[5]] * 7) == [0]
    assert s.admit() == []  # one idle row of eight, seven decoding: it waits for a second
    assert s.record([[]] + [[0]] + [[5]] * 6) == [1]
    assert s.admit() == [(0, 8), (1, 9)]
    assert s.record([[5], [5], [0]] + [[5]] * 5) == [2]
    assert s.admit() == [(2, 10)]  # one waits: no reason to wait for more idle rows
    for _ in range(4):
        s.record([[0]] * 8)
    assert s.done and len(s.outputs()) == 11
    assert Slots(3, [[1]], max_new=1, eos=0).admit_at == 1


def _prompts(n: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, 97) for _ in range(rng.randint(1, 8))] for _ in range(n)]


def _common_token(model: torch.nn.Module, prompts: list[list[int]]) -> int:
    """A token the model often samples: as EOS, it ends many sequences early (rows to refill)."""
    s = HFSampler(model, max_len=40, batch_size=len(prompts), pad_token_id=0, eos_token_id=-1, refill=False)
    out = s.generate(prompts, max_new_tokens=24, temperature=0)
    counts: dict[int, int] = {}
    for row in out:
        for t in row[:12]:
            counts[t] = counts.get(t, 0) + 1
    return max(counts, key=counts.get)


def _steps(s: HFSampler, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls = [0]
    real = s._decode

    def count(d, length):
        calls[0] += 1
        return real(d, length)

    monkeypatch.setattr(s, "_decode", count)
    return calls


def test_kept_full_batches_give_the_same_greedy_tokens_in_fewer_steps(device, monkeypatch):
    model = grouped_model("qwen2", device)
    prompts = _prompts(21)
    eos = _common_token(model, prompts)
    kw = dict(max_len=40, batch_size=4, pad_token_id=0, eos_token_id=eos)
    static = HFSampler(model, refill=False, **kw)
    full = HFSampler(model, **kw)
    n_static, n_full = _steps(static, monkeypatch), _steps(full, monkeypatch)
    want = static.generate(prompts, max_new_tokens=24, temperature=0)
    got = full.generate(prompts, max_new_tokens=24, temperature=0)
    assert got == want
    assert sum(len(w) < 24 for w in want) >= 3  # sequences did end early
    assert n_full[0] < n_static[0]
    assert full.tokens_generated == sum(len(g) for g in got)
    # Seeded sampling: the same for the same prompts, seed and rows; another seed differs.
    a = full.generate(prompts, max_new_tokens=24, temperature=1.0, top_p=0.9, seed=11)
    assert a == full.generate(prompts, max_new_tokens=24, temperature=1.0, top_p=0.9, seed=11)
    assert a != full.generate(prompts, max_new_tokens=24, temperature=1.0, top_p=0.9, seed=12)


@pytest.mark.cuda
def test_kept_full_graph_decode_is_eager_decode_and_captured_once():
    model = grouped_model("llama", "cuda").to(torch.bfloat16)
    prompts = _prompts(37)
    eos = _common_token(model, prompts)
    kw = dict(max_len=40, batch_size=8, pad_token_id=0, eos_token_id=eos, kv_block=8)
    eager = HFSampler(model, cuda_graphs="off", fused="on", **kw)
    graphs = HFSampler(model, cuda_graphs="on", **kw)
    static = HFSampler(model, cuda_graphs="on", refill=False, **kw)
    want = eager.generate(prompts, max_new_tokens=24, temperature=0)
    assert graphs.generate(prompts, max_new_tokens=24, temperature=0) == want
    assert static.generate(prompts, max_new_tokens=24, temperature=0) == want
    sampled = graphs.generate(prompts, max_new_tokens=24, temperature=1.0, seed=3)
    captured = graphs.captures  # sampled sequences may reach a length bucket the greedy ones did not
    assert graphs.generate(prompts, max_new_tokens=24, temperature=1.0, seed=3) == sampled
    graphs.sleep()
    graphs.wake()
    assert graphs.generate(prompts, max_new_tokens=24, temperature=0) == want
    assert graphs.captures == captured  # refills, sleeps and wakes re-capture nothing
