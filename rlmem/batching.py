"""Dynamic token-budget batching: variable-length sequences packed into micro-batches under a token budget.

Fixed-size micro-batches of long-tailed lengths either waste the budget on short sequences or run out of
memory on long ones. :func:`token_budget_batches` fills each micro-batch up to ``max_tokens`` and balances
the work, with attention counted as growing with length squared, over micro-batches and data-parallel ranks.
Unlike balancing that only evens the work out, no micro-batch ever holds more than ``max_tokens``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["sequence_cost", "token_budget_batches"]


def sequence_cost(length: int, attn_tokens: float) -> float:
    """Relative compute of one sequence: linear layers grow with ``length``, attention with ``length**2``;
    ``attn_tokens`` is the length at which the two are equal (about 6 x hidden size for a decoder)."""
    return length * (1.0 + length / attn_tokens)


def _check(lengths: Sequence[int], max_tokens: int, dp_size: int, least: int, attn: float) -> None:
    def is_int(v: object) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    if not is_int(max_tokens) or max_tokens < 1:
        raise ValueError(f"max_tokens must be an int >= 1, got {max_tokens!r}")
    if not is_int(dp_size) or dp_size < 1:
        raise ValueError(f"dp_size must be an int >= 1, got {dp_size!r}")
    if not is_int(least) or least < 1:
        raise ValueError(f"min_micro_batches must be an int >= 1, got {least!r}")
    number = isinstance(attn, (int, float)) and not isinstance(attn, bool)
    if not (number and attn > 0 and math.isfinite(attn)):
        raise ValueError(f"attn_tokens must be a finite number > 0, got {attn!r}")
    if len(lengths) < dp_size:
        raise ValueError(f"lengths holds {len(lengths)} sequences, fewer than dp_size={dp_size} ranks")
    for i, n in enumerate(lengths):
        if not is_int(n) or n < 1:
            raise ValueError(f"lengths[{i}] must be an int >= 1, got {n!r}")
        if n > max_tokens:
            raise ValueError(f"sequence {i} has {n} tokens, more than max_tokens={max_tokens}")


def _pack(
    order: list[int], lengths: Sequence[int], bins: int, max_tokens: int, padded: bool, attn: float
) -> list[list[int]] | None:
    """Longest first, each into the least-loaded bin it fits in; None when one fits nowhere."""
    members: list[list[int]] = [[] for _ in range(bins)]
    tokens = [0] * bins
    longest = [0] * bins
    cost = [0.0] * bins
    for i in order:
        n = lengths[i]
        best = -1
        for b in range(bins):
            used = (len(members[b]) + 1) * max(longest[b], n) if padded else tokens[b] + n
            if used <= max_tokens and (best < 0 or cost[b] < cost[best]):
                best = b
        if best < 0:
            return None
        members[best].append(i)
        tokens[best] += n
        longest[best] = max(longest[best], n)
        cost[best] += sequence_cost(n, attn)
    return members


def token_budget_batches(
    lengths: Sequence[int],
    max_tokens: int,
    *,
    dp_size: int = 1,
    min_micro_batches: int = 1,
    padded: bool = False,
    attn_tokens: float = 12288.0,
) -> list[list[list[int]]]:
    """Split sequences into micro-batches of at most ``max_tokens`` tokens, the same number on every rank.

    Args:
        lengths: tokens of each sequence (ints >= 1).
        max_tokens: the budget of one micro-batch: the sum of its lengths, or with ``padded`` its sequences
            times its longest one (what a right-padded batch occupies).
        dp_size: data-parallel ranks to spread the sequences over.
        min_micro_batches: at least this many micro-batches per rank (e.g. the largest count any rank needs,
            so that ranks holding their own sequences run the same number of steps).
        padded: count a micro-batch as padded to its longest sequence.
        attn_tokens: length at which a sequence's attention work equals its linear work (cost
            ``L * (1 + L / attn_tokens)``); balancing evens this cost over ranks and micro-batches.

    Returns:
        ``result[rank][k]``: the sorted sequence indices of micro-batch ``k`` of ``rank``. Every index appears
        exactly once; every rank has the same number of micro-batches, the fewest for which every micro-batch
        fits the budget (and at least ``min_micro_batches``); none is empty while there are at least as many
        sequences as micro-batches. Deterministic for the same arguments.

    Raises:
        ValueError: a sequence is longer than ``max_tokens`` (names its index and length), a length is not an
            int >= 1, fewer sequences than ``dp_size``, or an argument is out of range (named).

    Example:
        >>> token_budget_batches([5, 3, 3, 2], 8)
        [[[0, 3], [1, 2]]]
    """
    _check(lengths, max_tokens, dp_size, min_micro_batches, attn_tokens)
    n = len(lengths)
    # Longest first; ties by index, so the result depends only on the arguments.
    order = sorted(range(n), key=lambda i: (-lengths[i], i))
    total = sum(lengths)
    k = max(min_micro_batches, math.ceil(total / (max_tokens * dp_size)))
    while True:
        members = _pack(order, lengths, dp_size * k, max_tokens, padded, attn_tokens)
        if members is not None:
            break
        k += 1  # terminates: with a bin per sequence every one fits
    costs = [sum(sequence_cost(lengths[i], attn_tokens) for i in m) for m in members]
    # Micro-batches to ranks: heaviest first, to the least-loaded rank that still has room for one.
    ranks: list[list[list[int]]] = [[] for _ in range(dp_size)]
    load = [0.0] * dp_size
    for b in sorted(range(len(members)), key=lambda b: (-costs[b], b)):
        r = min((r for r in range(dp_size) if len(ranks[r]) < k), key=lambda r: (load[r], r))
        ranks[r].append(sorted(members[b]))
        load[r] += costs[b]
    return ranks
