"""The GRPO recipe's toy task: sort the digits of the prompt. A dense, verifiable reward made in code over the
tiny model's character tokenizer (:class:`rlmem.models.CharTokenizer`), so the loop needs no downloads.

A prompt is ``BOS d1 d2 ... dn =``; the answer is the digits in ascending order followed by EOS. The reward
is the fraction of answer positions right, the EOS position included, so partial progress is rewarded and
stopping at the right place matters.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .._lazy import moved_names

if TYPE_CHECKING:
    from ..models.tiny import CharTokenizer

__all__ = ["SortDigitsTask"]
# the tokenizer is the tiny model's (rlmem.models.tiny); its old name here keeps working for one release
__getattr__ = moved_names(__name__, {"CharTokenizer": "rlmem.models.tiny"})


@dataclass(frozen=True, kw_only=True)
class SortDigitsTask:
    """Prompts of ``min_digits``..``max_digits`` random digits; the answer is them sorted, then EOS.

    Raises:
        ValueError: ``min_digits`` < 1 or ``max_digits`` < ``min_digits``.
    """

    min_digits: int = 3
    max_digits: int = 6

    def __post_init__(self) -> None:
        if not isinstance(self.min_digits, int) or self.min_digits < 1:
            raise ValueError(f"SortDigitsTask.min_digits must be an int >= 1, got {self.min_digits!r}")
        if not isinstance(self.max_digits, int) or self.max_digits < self.min_digits:
            raise ValueError(
                f"SortDigitsTask.max_digits must be an int >= min_digits ({self.min_digits}), "
                f"got {self.max_digits!r}"
            )

    @property
    def max_answer_tokens(self) -> int:
        """Tokens a perfect answer takes: the digits and EOS."""
        return self.max_digits + 1

    def prompts(self, n: int, rng: random.Random) -> list[str]:
        """``n`` prompts like ``"5812="``, drawn from ``rng``."""
        out = []
        for _ in range(n):
            k = rng.randint(self.min_digits, self.max_digits)
            out.append("".join(rng.choice("0123456789") for _ in range(k)) + "=")
        return out

    @staticmethod
    def answer(prompt: str) -> str:
        return "".join(sorted(prompt.rstrip("=")))

    def reward(self, prompt: str, completion: Sequence[int], tok: CharTokenizer) -> float:
        """Fraction of the answer's positions (digits, then EOS) that ``completion`` gets right.

        Tokens after the first EOS are ignored; a completion longer than the answer before its EOS loses
        the EOS point and counts its extra tokens as wrong positions.
        """
        target = [*tok.encode(self.answer(prompt)), tok.EOS]
        got = []
        for t in completion:
            got.append(int(t))
            if int(t) == tok.EOS:
                break
        right = sum(1 for a, b in zip(got, target, strict=False) if a == b)
        return right / max(len(target), len(got))
