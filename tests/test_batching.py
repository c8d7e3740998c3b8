"""rlmem.token_budget_batches: the budget holds, every sequence once, equal counts per rank, balance."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlmem import token_budget_batches
from rlmem.data import sequence_cost


def _tokens(mb: list[int], lengths: list[int], padded: bool) -> int:
    return len(mb) * max(lengths[i] for i in mb) if padded else sum(lengths[i] for i in mb)


@st.composite
def cases(draw):
    max_tokens = draw(st.integers(1, 4096))
    lengths = draw(st.lists(st.integers(1, max_tokens), min_size=1, max_size=200))
    dp = draw(st.integers(1, min(8, len(lengths))))
    return lengths, max_tokens, dp, draw(st.booleans()), draw(st.integers(1, 4))


@settings(max_examples=300, deadline=None)
@given(cases())
def test_budget_once_each_equal_counts(case):
    lengths, max_tokens, dp, padded, least = case
    out = token_budget_batches(lengths, max_tokens, dp_size=dp, padded=padded, min_micro_batches=least)
    assert len(out) == dp
    counts = {len(r) for r in out}
    assert len(counts) == 1 and counts.pop() >= least
    seen = sorted(i for r in out for mb in r for i in mb)
    assert seen == list(range(len(lengths)))
    for r in out:
        for mb in r:
            assert mb == sorted(mb)
            if mb:
                assert _tokens(mb, lengths, padded) <= max_tokens
    # Empty micro-batches only when there are fewer sequences than micro-batches.
    if len(lengths) >= dp * len(out[0]):
        assert all(mb for r in out for mb in r)
    # Deterministic.
    again = token_budget_batches(lengths, max_tokens, dp_size=dp, padded=padded, min_micro_batches=least)
    assert out == again


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(1, 512), min_size=1, max_size=100))
def test_fewest_micro_batches_for_the_budget(lengths):
    # Unpadded, the count is the token lower bound or close to it, never more than twice.
    out = token_budget_batches(lengths, 512)
    bound = -(-sum(lengths) // 512)
    assert bound <= len(out[0]) <= max(2 * bound, 1)


def test_long_sequence_is_named():
    with pytest.raises(ValueError, match=r"sequence 2 has 900 tokens, more than max_tokens=800"):
        token_budget_batches([10, 20, 900, 5], 800)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(lengths=[1, 2], max_tokens=0), "max_tokens must be"),
        (dict(lengths=[1, 2], max_tokens=8, dp_size=0), "dp_size must be"),
        (dict(lengths=[1, 2], max_tokens=8, dp_size=3), "fewer than dp_size=3"),
        (dict(lengths=[1, 0], max_tokens=8), r"lengths\[1\] must be an int >= 1"),
        (dict(lengths=[1, 2.5], max_tokens=8), r"lengths\[1\] must be"),
        (dict(lengths=[1, 2], max_tokens=8, min_micro_batches=0), "min_micro_batches must be"),
        (dict(lengths=[1, 2], max_tokens=8, attn_tokens=0), "attn_tokens must be"),
    ],
)
def test_bad_arguments_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        token_budget_batches(**kwargs)


def test_balanced_better_than_fixed_size_on_a_long_tail():
    # Long-tailed lengths (most short, a few near the budget) on 4 ranks: the heaviest rank's cost, which
    # sets the step time, is lower than with fixed-size micro-batches of the same count in arrival order.
    rng = random.Random(0)
    lengths = [min(8192, int(rng.paretovariate(1.2) * 200)) for _ in range(512)]
    out = token_budget_batches(lengths, 16384, dp_size=4)
    k = len(out[0])

    def cost(idx):
        return sum(sequence_cost(lengths[i], 12288.0) for i in idx)

    ours = max(cost([i for mb in r for i in mb]) for r in out)
    per_rank = len(lengths) // 4
    fixed = max(cost(range(r * per_rank, (r + 1) * per_rank)) for r in range(4))
    assert ours < fixed
    # Within a rank the micro-batches are even too: the heaviest within 1.5x the mean.
    for r in out:
        cs = [cost(mb) for mb in r]
        assert max(cs) <= 1.5 * sum(cs) / k


def test_padded_groups_similar_lengths():
    # Padded micro-batches waste less of the budget on padding than fixed-size ones that are safe for the
    # longest sequence, and need fewer micro-batches.
    rng = random.Random(1)
    lengths = [max(16, min(8192, int(rng.paretovariate(1.2) * 256))) for _ in range(255)] + [8192]
    out = token_budget_batches(lengths, 16384, padded=True)[0]
    fixed = [list(range(i, i + 2)) for i in range(0, 256, 2)]

    def padded_tokens(mbs):
        return sum(len(mb) * max(lengths[i] for i in mb) for mb in mbs)

    assert padded_tokens(out) < 0.8 * padded_tokens(fixed) and len(out) < len(fixed) / 2
