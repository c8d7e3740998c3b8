"""Batches kept full: more sequences than rows, a waiting sequence taking the row of one that ended.

:class:`Slots` is the host's bookkeeping of a kept-full generation: which sequence each row of the cache
holds, the tokens each has produced, how many columns of its row it fills, and the queue of those still
waiting. It sees the sampled tokens in blocks (one device-to-host copy every few steps), decides which rows
ended (EOS or ``max_new`` tokens) and which waiting sequences take them, in order of arrival.

Every row keeps its own columns: a sequence's prompt fills columns ``0..p-1`` of its row and its ``i``-th
token goes to column ``p + i``, which is also its position. :func:`slot_writes` makes the static cache's
layers write that way for the duration of a block, instead of at one column shared by the batch: a decode
step writes row ``r``'s keys and values at column ``cols[r]`` (a device tensor, so the step is a CUDA graph
like any other), a prefill writes whole rows ``rows`` from column 0. A batch decoding in step (one batch at
a time, its prompts left-padded to one width) writes the same way, every ``cols[r]`` the same column: the
same graphs serve both, and a step writes with two kernels where the cache's own update launches five
(counters and indices in every layer). :class:`GroupSlots` keeps a shared layout full (``_prefix``): rows in
blocks of one prompt each, a waiting group taking a block whose rows have all ended.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Iterator, Sequence
from typing import Any

import torch

__all__ = ["GroupSlots", "Slots", "WritePlan", "decode_writes", "row_bases", "slot_writes", "step_index"]


class Slots:
    """Which sequence is in which row, and what each has produced.

    Args:
        rows: rows of the cache.
        prompts: every sequence's prompt (token ids), in the order they are admitted.
        max_new: tokens a sequence samples at most.
        eos: the id that ends a sequence (kept in its tokens).
        admit_at: idle rows it takes to admit waiting sequences while others still decode (fewer waiting:
            as many as wait). Each admission is a prefill, whose host time (an eager forward, ~60 ms on a
            2.5B model) the decode steps wait for: admitting rows a few at a time costs more than leaving a
            quarter of the rows idle for a while (``bench/NOTES.md``). None: ``rows // 4``, at least 1.
    """

    def __init__(
        self, rows: int, prompts: Sequence[Sequence[int]], max_new: int, eos: int, admit_at: int | None = None
    ) -> None:
        if rows < 1 or max_new < 1:
            raise ValueError(f"rows and max_new must be positive, got {rows} and {max_new}")
        self.rows, self.max_new, self.eos = rows, max_new, eos
        self.admit_at = max(1, rows // 4) if admit_at is None else admit_at
        self.prompts = [list(p) for p in prompts]
        self.waiting: deque[int] = deque(range(len(self.prompts)))
        self.seq: list[int | None] = [None] * rows  # the sequence in each row (None: idle)
        self.tokens: list[list[int]] = [[] for _ in self.prompts]
        self.length = [0] * rows  # columns of its row the sequence fills (prompt + tokens fed back)
        self.results: list[list[int] | None] = [None] * len(self.prompts)

    @property
    def done(self) -> bool:
        return not self.waiting and all(s is None for s in self.seq)

    def admit(self) -> list[tuple[int, int]]:
        """Waiting sequences into idle rows, lowest row first: ``(row, sequence)`` pairs; none while fewer
        than ``admit_at`` rows (or than wait) are idle and others decode."""
        idle = self.seq.count(None)
        if idle < self.rows and idle < min(self.admit_at, len(self.waiting)):
            return []
        out = []
        for r in range(self.rows):
            if self.seq[r] is None and self.waiting:
                s = self.waiting.popleft()
                self.seq[r], self.length[r] = s, len(self.prompts[s])
                out.append((r, s))
        return out

    def steps_left(self) -> int:
        """Steps until the first active row has sampled all its tokens (the latest a block may end)."""
        left = [self.max_new - len(self.tokens[s]) for s in self.seq if s is not None]
        return min(left) if left else 0

    def record(self, block: list[list[int]]) -> list[int]:
        """Take a block of sampled tokens (``block[r]``: row ``r``'s, one per step since the last block) and
        return the rows whose sequence ended in it (EOS, or its ``max_new``-th token); those rows are idle
        now. Tokens a row sampled after its end are not kept."""
        ended = []
        for r, s in enumerate(self.seq):
            if s is None:
                continue
            toks = self.tokens[s]
            for t in block[r]:
                toks.append(int(t))
                if t == self.eos or len(toks) == self.max_new:
                    break
            self.length[r] = len(self.prompts[s]) + len(toks)
            if toks and (toks[-1] == self.eos or len(toks) == self.max_new):
                self.results[s] = list(toks)
                self.seq[r] = None
                ended.append(r)
        return ended

    def outputs(self) -> list[list[int]]:
        assert all(r is not None for r in self.results), "not every sequence has ended"
        return [list(r) for r in self.results if r is not None]


class GroupSlots(Slots):
    """:class:`Slots` whose rows come in blocks of ``group``, one prompt per block (the shared layout of
    ``_prefix``: a block's rows read its prompt's keys and values): a waiting group, ``count`` sequences of
    one prompt from ``first`` on, takes a block whose rows are all idle, its rows from the block's first.

    Args:
        blocks: blocks of rows (prompts held at once).
        group: rows per block.
        prompts: every sequence's prompt.
        groups: ``(first, count)`` per group, ``count <= group``, in the order they are admitted.
        max_new, eos: as :class:`Slots`.
        admit_at: free blocks it takes to admit waiting groups while others decode; None: ``blocks // 4``,
            at least 1 (as :class:`Slots` waits for rows, each admission a prefill).
    """

    def __init__(
        self,
        blocks: int,
        group: int,
        prompts: Sequence[Sequence[int]],
        groups: Sequence[tuple[int, int]],
        max_new: int,
        eos: int,
        admit_at: int | None = None,
    ) -> None:
        super().__init__(blocks * group, prompts, max_new, eos)
        if any(not 1 <= count <= group for _, count in groups):
            raise ValueError(f"every group must have 1 to {group} sequences")
        self.blocks, self.group = blocks, group
        self.admit_at = max(1, blocks // 4) if admit_at is None else admit_at
        self.groups: deque[tuple[int, int]] = deque(groups)
        self.waiting = deque(s for first, count in groups for s in range(first, first + count))

    def admit(self) -> list[tuple[int, int]]:
        """Waiting groups into free blocks, lowest block first: ``(row, sequence)`` pairs, a group's rows
        together (row ``r`` is in block ``r // group``); none while fewer than ``admit_at`` blocks (or than
        groups wait) are free and others decode."""
        g = self.group
        free = [b for b in range(self.blocks) if all(s is None for s in self.seq[b * g : (b + 1) * g])]
        if len(free) < self.blocks and len(free) < min(self.admit_at, len(self.groups)):
            return []
        out = []
        for b in free:
            if not self.groups:
                break
            first, count = self.groups.popleft()
            for m in range(count):
                r, s = b * g + m, self.waiting.popleft()
                assert s == first + m
                self.seq[r], self.length[r] = s, len(self.prompts[s])
                out.append((r, s))
        return out


class WritePlan:
    """How :func:`slot_writes` makes the layers write: ``("decode", index)`` (row ``r``, head ``h`` of a
    step at ``index[r, h]`` of the layer's whole tensor seen as ``(-1, head_dim)`` rows: see
    :func:`step_index`) or ``("prefill", rows)`` (the given rows, from column 0)."""

    def __init__(self) -> None:
        self.mode = "decode"
        self.index: torch.Tensor | None = None

    def decode(self, index: torch.Tensor) -> None:
        self.mode, self.index = "decode", index

    def prefill(self, rows: torch.Tensor) -> None:
        self.mode, self.index = "prefill", rows


def step_index(base: torch.Tensor, cols: torch.Tensor | int, out: torch.Tensor) -> torch.Tensor:
    """Where a decode step writes (``WritePlan.decode``): ``base[r, h] + cols[r]`` into ``out``, ``base``
    being :func:`row_bases`. One kernel per step, shared by every layer, keys and values."""
    return torch.add(base, cols if isinstance(cols, int) else cols[:, None], out=out)


def row_bases(rows: int, heads: int, max_len: int, device: torch.device) -> torch.Tensor:
    """Row ``(r, h)`` of a cache tensor ``(rows, heads, max_len, head_dim)`` seen as ``(-1, head_dim)``
    rows, at column 0."""
    return (torch.arange(rows * heads, device=device) * max_len).view(rows, heads)


@contextlib.contextmanager
def slot_writes(
    layers: Sequence[Any], plan: WritePlan, whole: Sequence[tuple[torch.Tensor, torch.Tensor]]
) -> Iterator[None]:
    """Within the block, each cache layer's ``update`` writes per ``plan`` and returns what attention reads:
    the layer's tensors (decode: every row, up to the columns the layer's view spans) or the prefilled
    rows whole. ``whole``: each layer's keys and values whole (the layers may hold views of fewer rows and
    columns); a decode step writes through them, one indexed write of ``head_dim`` rows each."""

    def update(
        layer: Any, k_v: tuple[torch.Tensor, ...], key_states: torch.Tensor, value_states: torch.Tensor
    ) -> Any:
        idx = plan.index
        assert idx is not None
        if plan.mode == "decode":
            for t, new in zip(k_v, (key_states, value_states), strict=True):
                t.view(-1, t.shape[-1]).index_put_((idx,), new[:, :, 0])
            return layer.keys, layer.values
        n = key_states.shape[2]
        layer.keys[idx, :, :n] = key_states
        layer.values[idx, :, :n] = value_states
        return layer.keys[idx], layer.values[idx]

    for layer, kv in zip(layers, whole, strict=True):
        layer.update = lambda k, v, *a, _l=layer, _kv=kv, **kw: update(_l, _kv, k, v)
    try:
        yield
    finally:
        for layer in layers:
            del layer.update


def decode_writes(
    layers: Sequence[Any], index: torch.Tensor, whole: Sequence[tuple[torch.Tensor, torch.Tensor]]
) -> contextlib.AbstractContextManager[None]:
    """:func:`slot_writes` for decode steps alone, each row's keys and values written where ``index`` says
    (:func:`step_index`): a batch decoding in step and one kept full run the same graphs."""
    plan = WritePlan()
    plan.decode(index)
    return slot_writes(layers, plan, whole)
