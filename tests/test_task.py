"""The GRPO recipe's toy task: tokenizer round trips and a reward that is dense, bounded and exact."""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rlmem.models import CharTokenizer
from rlmem.recipes.task import SortDigitsTask

TOK = CharTokenizer()
TASK = SortDigitsTask(min_digits=3, max_digits=6)


def ids(text: str, eos: bool = True) -> list[int]:
    return TOK.encode(text) + ([TOK.EOS] if eos else [])


def test_tokenizer_round_trip_and_specials():
    assert TOK.vocab_size == 14
    assert TOK.encode("301=", bos=True)[0] == TOK.BOS
    assert TOK.decode(TOK.encode("0123456789=")) == "0123456789="
    assert TOK.decode([TOK.BOS, *TOK.encode("12"), TOK.EOS, *TOK.encode("99")]) == "12"
    with pytest.raises(ValueError, match="character 'a' is not in the vocabulary"):
        TOK.encode("1a")


def test_prompts_are_seeded_and_in_range():
    a = TASK.prompts(50, random.Random(7))
    assert a == TASK.prompts(50, random.Random(7))
    assert all(p.endswith("=") and 3 <= len(p) - 1 <= 6 and p[:-1].isdigit() for p in a)


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        (ids("1258"), 1.0),  # right digits, then EOS
        (ids("1258", eos=False), 4 / 5),  # never stops: loses the EOS point
        (ids("1259"), 4 / 5),  # one digit wrong
        (ids("125"), 3 / 5),  # stops one early: EOS lands on the 4th digit's place
        (ids("12580"), 4 / 6),  # one digit too many: the extra one and the EOS are wrong
        ([TOK.EOS], 0.0),
        ([], 0.0),
        ([*ids("1258"), *ids("777")], 1.0),  # after EOS nothing counts
    ],
)
def test_reward_is_dense_and_exact(completion, expected):
    assert TASK.reward("5812=", completion, TOK) == pytest.approx(expected)


@given(st.text(alphabet="0123456789", min_size=1, max_size=8), st.lists(st.integers(0, 13), max_size=12))
def test_reward_is_bounded_and_maximal_only_for_the_answer(digits, completion):
    prompt = digits + "="
    task = SortDigitsTask(min_digits=1, max_digits=8)
    r = task.reward(prompt, completion, TOK)
    assert 0.0 <= r <= 1.0
    assert task.reward(prompt, ids(task.answer(prompt)), TOK) == 1.0
    if r == 1.0:
        assert TOK.decode(completion) == task.answer(prompt)


def test_task_config_is_validated():
    with pytest.raises(ValueError, match=r"SortDigitsTask\.min_digits"):
        SortDigitsTask(min_digits=0)
    with pytest.raises(ValueError, match=r"SortDigitsTask\.max_digits"):
        SortDigitsTask(min_digits=4, max_digits=3)
    with pytest.raises(TypeError):
        SortDigitsTask(3, 6)  # type: ignore[misc]
