"""A built-in task for real models, made in code (no download): sums, differences and products asked in
words ("What is 53 plus 36?", "What is 41 minus 17?", "What is 7 times 12?"), the answer the number.

``data=arithmetic`` trains on it and ``eval_data=arithmetic`` evaluates on its held-out split; with the
``math`` reward (the default with ``data=``) a completion scores 1 when its last number (or its ``\\boxed{}``
or ``####`` answer) is the result. The split is fixed (its own seed, whatever the run's), so every run of
the task evaluates on the same :data:`HELD_OUT` questions, none of which is trained on.
"""

from __future__ import annotations

import random

__all__ = ["HELD_OUT", "NAME", "rows"]

NAME = "arithmetic"
HELD_OUT = 256
SPLITS = ("train", "eval")
_SEED = 20261124


def _questions() -> list[list[dict[str, str]]]:
    """Every question, by operation: sums and differences of 2..60 (positive differences), products of
    2..25."""
    span = range(2, 61)
    sums = [(f"What is {a} plus {b}?", a + b) for a in span for b in span]
    diffs = [(f"What is {a} minus {b}?", a - b) for a in span for b in span if a > b]
    prods = [(f"What is {a} times {b}?", a * b) for a in range(2, 26) for b in range(2, 26)]
    return [[{"prompt": q, "answer": str(v)} for q, v in op] for op in (sums, diffs, prods)]


def rows(split: str) -> list[dict[str, str]]:
    """The ``"train"`` or ``"eval"`` split: ``{"prompt", "answer"}`` rows, the answer as text.

    The held-out split takes :data:`HELD_OUT` questions, as many of each operation as it can (86, 85, 85);
    training gets the rest (3,395 sums, 1,626 differences, 491 products), none of them held out.

    Raises:
        ValueError: ``split`` is not ``"train"`` or ``"eval"``.
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {', '.join(SPLITS)}; got {split!r}")
    rng = random.Random(_SEED)
    ops = _questions()
    for op in ops:
        rng.shuffle(op)
    per = [HELD_OUT // len(ops) + (i < HELD_OUT % len(ops)) for i in range(len(ops))]
    if split == "eval":
        return [r for op, n in zip(ops, per, strict=True) for r in op[:n]]
    out = [r for op, n in zip(ops, per, strict=True) for r in op[n:]]
    rng.shuffle(out)
    return out
