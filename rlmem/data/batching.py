"""Dynamic token-budget batching: variable-length sequences packed into micro-batches under a token budget.

Fixed-size micro-batches of long-tailed lengths either waste the budget on short sequences or run out of
memory on long ones. :func:`token_budget_batches` fills each micro-batch up to ``max_tokens`` and balances
the work, with attention counted as growing with length squared, over micro-batches and data-parallel ranks.
Packed sequences (no padding) are spread so every micro-batch carries a similar cost; padded ones are grouped
by length, so little of the budget goes to padding.
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


def _cost(members: list[int], lengths: Sequence[int], padded: bool, attn: float) -> float:
    if not members:
        return 0.0
    if padded:  # every row computes as long as the longest
        return len(members) * sequence_cost(max(lengths[i] for i in members), attn)
    return sum(sequence_cost(lengths[i], attn) for i in members)


def _pack(
    order: list[int], lengths: Sequence[int], bins: int, max_tokens: int, attn: float
) -> list[list[int]] | None:
    """Packed sequences (no padding): longest first, each into the least-loaded bin it fits in; None when
    one fits nowhere."""
    members: list[list[int]] = [[] for _ in range(bins)]
    tokens = [0] * bins
    cost = [0.0] * bins
    for i in order:
        n = lengths[i]
        best = -1
        for b in range(bins):
            if tokens[b] + n <= max_tokens and (best < 0 or cost[b] < cost[best]):
                best = b
        if best < 0:
            return None
        members[best].append(i)
        tokens[best] += n
        cost[best] += sequence_cost(n, attn)
    return members


def _runs(
    order: list[int], lengths: Sequence[int], max_tokens: int, dp_size: int, least: int, attn: float
) -> list[list[int]]:
    """Padded micro-batches: runs of similar lengths (consecutive in longest-first order, so little padding),
    each as full as the budget allows; then the costliest runs split in halves until every rank can have
    the same number, at least ``least``."""
    runs: list[list[int]] = []
    cur: list[int] = []
    for i in order:
        # Longest first: the run's first sequence is its longest.
        if cur and (len(cur) + 1) * lengths[cur[0]] > max_tokens:
            runs.append(cur)
            cur = []
        cur.append(i)
    runs.append(cur)
    want = dp_size * max(least, math.ceil(len(runs) / dp_size))
    while len(runs) < want:
        splittable = [r for r in range(len(runs)) if len(runs[r]) > 1]
        if not splittable:
            runs.append([])  # fewer sequences than micro-batches
            continue
        r = max(splittable, key=lambda r: (_cost(runs[r], lengths, True, attn), -r))
        half = len(runs[r]) // 2
        runs[r : r + 1] = [runs[r][:half], runs[r][half:]]
    return runs


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
    if padded:
        members = _runs(order, lengths, max_tokens, dp_size, min_micro_batches, attn_tokens)
        k = len(members) // dp_size
    else:
        k = max(min_micro_batches, math.ceil(sum(lengths) / (max_tokens * dp_size)))
        while True:
            packed = _pack(order, lengths, dp_size * k, max_tokens, attn_tokens)
            if packed is not None:
                members = packed
                break
            k += 1  # terminates: with a bin per sequence every one fits
    costs = [_cost(m, lengths, padded, attn_tokens) for m in members]
    # Micro-batches to ranks: heaviest first, to the least-loaded rank that still has room for one.
    ranks: list[list[list[int]]] = [[] for _ in range(dp_size)]
    load = [0.0] * dp_size
    for b in sorted(range(len(members)), key=lambda b: (-costs[b], b)):
        r = min((r for r in range(dp_size) if len(ranks[r]) < k), key=lambda r: (load[r], r))
        ranks[r].append(sorted(members[b]))
        load[r] += costs[b]
    return ranks
