"""The decode loops of ``HFSampler.generate``: batches one at a time, or kept full.

- :func:`generate_batch`: up to ``batch_size`` prompts, left-padded to one width and prefilled together,
  then decoded in step until every row has ended (checked every ``sync_every`` tokens: one host sync then,
  not one per token) or ``max_new_tokens``; a last, partial batch decodes with the rows of its bucket.
- :func:`generate_full` (``refill``): more sequences than rows, the batch kept full: every row writes its
  own columns (``_slots``), and a waiting sequence's prompt is prefilled into the row of one that ended.
- :func:`shared_batch` and :func:`shared_full`: the same two over a shared layout (``_prefix``, with
  ``share_prompts``): groups of rows of one prompt, each prompt prefilled once into its group's place, a
  waiting group (kept full) taking the rows of a group whose rows have all ended.

Each step samples on the device (``_sampling``); the step itself is the sampler's (:attr:`Run.decode`: a
CUDA graph replay once captured), over the cache-length bucket that holds the step's column. Also here:
``generate``'s argument checks (:func:`check_request`) and the stream a generation runs on
(:class:`OwnStream`: the sampler's own, after one event, with ``order_after``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..._checks import check_sampling
from ._cache import Forward, RowViews
from ._graphs import Decode, DecodeGraphs
from ._prefix import Prefix, SharedDecode, SharedLayout
from ._sampling import sample
from ._slots import GroupSlots, Slots, WritePlan, decode_writes, slot_writes, step_index

__all__ = [
    "OwnStream",
    "Run",
    "check_request",
    "generate_batch",
    "generate_full",
    "shared_batch",
    "shared_full",
]


@dataclass(frozen=True)
class Run:
    """What one generation runs over, handed over by the sampler for the call (and dropped after it)."""

    cache: Any  # the static KV cache, its layers views of the Region
    graphs: DecodeGraphs  # the batch-size and cache-length buckets, the cache's shape and device
    forward: Forward  # a prefill: the model over whole prompts, into the cache
    decode: Callable[[Decode, int], torch.Tensor]  # one step from a Decode's buffers over a length bucket
    decoder: Callable[[int], Decode]  # the buffers of so many rows, the graphs following the weights first
    follow_weights: Callable[[], None]  # drop the graphs if the weights moved
    pad_token_id: int
    eos_token_id: int
    sync_every: int
    prefix: Prefix | None = None  # what a shared step's attention reads (``share_prompts``)
    # The buffers of a shared layout's bucket of so many groups, the graphs following the weights first.
    shared_decoder: Callable[[SharedLayout, int], SharedDecode] | None = None


class OwnStream:
    """Where the next generation runs: on the caller's stream, or, once given an event (``order_after``), on
    the sampler's own stream (made on first use) ordered after that event alone, the caller's stream ordered
    after the generation."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.after: Any = None  # the event the next generation waits for (used once)
        self.stream: Any = None

    def next_generation(self) -> contextlib.AbstractContextManager[None]:
        """The context the next generation runs in (the event, if any, is used up)."""
        after, self.after = self.after, None
        return contextlib.nullcontext() if after is None else self._after(after)

    @contextlib.contextmanager
    def _after(self, event: Any) -> Iterator[None]:
        """The block runs on the own stream, ordered after ``event`` alone; the caller's stream is ordered
        after the block."""
        caller = torch.cuda.current_stream(self.device)
        if self.stream is None:
            self.stream = torch.cuda.Stream(self.device)
        self.stream.wait_event(event)
        try:
            with torch.cuda.stream(self.stream):
                yield
        finally:
            caller.wait_stream(self.stream)


def check_request(
    prompts: Sequence[Sequence[int]], max_new_tokens: int, temperature: float, top_p: float, max_len: int
) -> None:
    """Raises ``ValueError`` for an argument of ``generate`` out of range, or a prompt that leaves no room
    for ``max_new_tokens`` in ``max_len``."""
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
    check_sampling(temperature, top_p)
    if any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    longest = max((len(p) for p in prompts), default=0)
    if longest + max_new_tokens > max_len:
        raise ValueError(
            f"a prompt of {longest} tokens plus max_new_tokens={max_new_tokens} exceeds max_len={max_len}"
        )


def generate_batch(
    run: Run,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    gen: torch.Generator,
) -> list[list[int]]:
    """Completions (up to and including EOS) of at most ``batch_size`` prompts decoded together."""
    graphs, decode = run.graphs, run.decode
    n, device = len(prompts), graphs.device
    rows = graphs.bucket(n)
    width = max(len(p) for p in prompts)
    ids = torch.full((n, width), run.pad_token_id, dtype=torch.long)
    mask = torch.zeros((n, width + max_new_tokens), dtype=torch.long)
    for i, p in enumerate(prompts):  # left padding: every row ends where sampling starts
        ids[i, width - len(p) :] = torch.tensor(list(p), dtype=torch.long)
        mask[i, width - len(p) : width] = 1
    ids, mask = ids.to(device), mask.to(device)
    pos = (mask[:, :width].cumsum(-1) - 1).clamp(min=0)
    views = RowViews(run.cache, graphs.batch_size, graphs.max_len)
    try:
        # A last, partial batch uses the first rows of the cache: n to prefill, its bucket to decode.
        views.use(n)
        run.cache.reset()
        logits = run.forward(ids, mask[:, :width], pos)
        done = torch.zeros(n, dtype=torch.bool, device=device)
        steps: list[torch.Tensor] = []
        views.use(rows)
        # Only now: the prefill may have moved the weights the graphs read (FSDP2 gathers them into
        # new storage on its first forward of a rollout), and the fingerprint must see where they are.
        d = run.decoder(rows)
        d.start(mask[:, :width], pos[:, -1], width)
        length = 0
        with decode_writes(views.layers, d.index, views.whole):
            for t in range(max_new_tokens):
                nxt = sample(logits[:n], temperature, top_p, gen)
                nxt = torch.where(done, run.pad_token_id, nxt)
                steps.append(nxt)
                done |= nxt == run.eos_token_id
                # One host sync every few tokens to stop early, instead of one per token.
                if t + 1 == max_new_tokens or ((t + 1) % run.sync_every == 0 and bool(done.all())):
                    break
                d.advance(nxt, width + t)
                need = graphs.length(width + t + 1)
                if need != length:  # the new column opens the next length bucket
                    length = need
                    views.use(rows, length)
                logits = decode(d, length)
    finally:
        views.use(None)
    out = []
    for row in torch.stack(steps, 1).tolist():
        if run.eos_token_id in row:
            row = row[: row.index(run.eos_token_id) + 1]
        out.append(row)
    return out


def generate_full(
    run: Run,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    gen: torch.Generator,
) -> list[list[int]]:
    """Every sequence through ``batch_size`` rows kept full (``refill``): each row writes its own columns
    (``_slots``), a waiting sequence's prompt is prefilled into the row of one that ended. Completions in
    the order given."""
    graphs, decode = run.graphs, run.decode
    rows, device = graphs.batch_size, graphs.device
    slots = Slots(rows, prompts, max_new_tokens, run.eos_token_id)
    plan = WritePlan()
    lengths = torch.zeros(rows, dtype=torch.long, device=device)  # columns each row fills
    active = torch.zeros(rows, dtype=torch.long, device=device)
    block = torch.zeros((rows, run.sync_every), dtype=torch.long, device=device)
    views = RowViews(run.cache, graphs.batch_size, graphs.max_len)
    cur: torch.Tensor | None = None  # the logits each row samples its next token from
    try:
        with slot_writes(views.layers, plan, views.whole):
            views.use(None)
            run.cache.reset()  # rows hold finite values wherever a mask hides them
            d = run.decoder(rows)
            d.start(d.mask[:0, 0, 0, :0], d.pos[:0, 0], 0)  # every row idle: attends to column 0
            while not slots.done:
                admitted = slots.admit()
                if admitted:
                    views.use(None)
                    first = cur is None
                    cur = _prefill_rows(run, admitted, slots, plan, d, lengths, active, cur)
                    if first:  # the first forward of the rollout may have moved the weights (FSDP2)
                        run.follow_weights()
                assert cur is not None
                n = min(run.sync_every, slots.steps_left())
                base = max(slots.length[r] for r, s in enumerate(slots.seq) if s is not None)
                for j in range(n):
                    nxt = sample(cur, temperature, top_p, gen)
                    block[:, j] = nxt
                    d.ids[:, 0] = nxt
                    d.pos[:, 0] = lengths
                    step_index(d.base, lengths, d.index)
                    d.mask[d.rows, 0, 0, lengths] = True
                    plan.decode(d.index)
                    length = graphs.length(base + j + 1)
                    views.use(rows, length)
                    cur = decode(d, length)
                    lengths.add_(active)
                ended = slots.record(block[:, :n].tolist())
                if ended:  # idle rows: nothing to write, column 0 to attend to (never an empty row)
                    idx = torch.tensor(ended, device=device)
                    active[idx] = 0
                    lengths[idx] = 0
                    d.mask[idx] = False
                    d.mask[idx, 0, 0, 0] = True
    finally:
        views.use(None)
    return slots.outputs()


def _prefill_rows(
    run: Run,
    admitted: list[tuple[int, int]],
    slots: Slots,
    plan: WritePlan,
    d: Decode,
    lengths: torch.Tensor,
    active: torch.Tensor,
    cur: torch.Tensor | None,
) -> torch.Tensor:
    """Prefill the admitted sequences into their rows, those of one prompt length together (no padding:
    each row's last column is its last token); their first logits go into ``cur``'s rows."""
    device, max_len = run.graphs.device, run.graphs.max_len
    by_len: dict[int, list[tuple[int, int]]] = {}
    for r, s in admitted:
        by_len.setdefault(len(slots.prompts[s]), []).append((r, s))
    for p, group in by_len.items():
        idx = torch.tensor([r for r, _ in group], device=device)
        ids = torch.tensor([slots.prompts[s] for _, s in group], dtype=torch.long, device=device)
        pos = torch.arange(p, device=device).expand(len(group), p)
        causal = torch.ones((p, max_len), dtype=torch.bool, device=device).tril()
        plan.prefill(idx)
        logits = run.forward(ids, causal.expand(len(group), 1, p, max_len), pos)
        if cur is None:
            cur = torch.zeros((run.graphs.batch_size, logits.shape[-1]), dtype=logits.dtype, device=device)
        cur[idx] = logits.to(cur.dtype)
        lengths[idx] = p
        active[idx] = 1
        d.mask[idx] = False
        d.mask[idx, 0, 0, :p] = True
    assert cur is not None
    return cur


def shared_batch(
    run: Run,
    layout: SharedLayout,
    prompts: Sequence[Sequence[int]],
    groups: Sequence[tuple[int, int]],
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    gen: torch.Generator,
) -> list[list[int]]:
    """Completions of the sequences of ``groups`` (``(first, count)`` of ``prompts`` each, one prompt, at
    most ``layout.groups`` of them), decoded together over a shared layout: each prompt prefilled once,
    group ``g``'s rows from ``g x layout.group`` on. Completions in the order given; each step samples the
    rows in that order, so seeded sampling draws as :func:`generate_batch` does for the same sequences."""
    graphs, decode, prefix = run.graphs, run.decode, run.prefix
    assert prefix is not None and run.shared_decoder is not None
    device, g = graphs.device, layout.group
    n_groups = len(groups)
    size = layout.bucket(n_groups, graphs.enabled)
    rows = size * g
    order = torch.tensor([i * g + m for i, (_, c) in enumerate(groups) for m in range(c)], device=device)
    lengths = [len(prompts[first]) for first, _ in groups]
    views = RowViews(run.cache, graphs.batch_size, graphs.max_len)
    pool = RowViews(run.cache, layout.groups, layout.prompt_cols, whole=layout.prompts)
    own = RowViews(run.cache, layout.rows, layout.own_cols, whole=layout.own)
    plan = WritePlan()
    steps: list[torch.Tensor] = []
    try:
        with slot_writes(views.layers, plan, layout.own):
            views.use(None)
            run.cache.reset()  # the whole Region: every column a mask hides holds finite values
            first = _prefill_prompts(run, pool, plan, [(i, prompts[f]) for i, (f, _) in enumerate(groups)])
            logits = first[order // g]
            d = run.shared_decoder(layout, size)
            d.idle()
            idx = torch.arange(n_groups, device=device)
            plen = torch.tensor(lengths, device=device)
            d.prompt(idx, plen)
            d.pos[order, 0] = plen[order // g] - 1
            prefix.use(layout, d, size, layout.prompt_length(max(lengths)))
            key = (layout.prompt_length(max(lengths)), 0)
            n = order.numel()
            done = torch.zeros(n, dtype=torch.bool, device=device)
            plan.decode(d.index)
            for t in range(max_new_tokens):
                nxt = sample(logits, temperature, top_p, gen)
                nxt = torch.where(done, run.pad_token_id, nxt)
                steps.append(nxt)
                done |= nxt == run.eos_token_id
                if t + 1 == max_new_tokens or ((t + 1) % run.sync_every == 0 and bool(done.all())):
                    break
                d.ids[order, 0] = nxt
                d.pos.add_(1)
                step_index(d.base, t, d.index)
                d.mask[:, 0, 0, t] = True
                need = layout.own_length(t + 1)
                if need != key[1]:  # the new column opens the next bucket of the rows' own columns
                    key = (key[0], need)
                    own.use(rows, need)
                logits = decode(d, key)[order]
    finally:
        prefix.clear()
        views.use(None)
    return _trimmed(steps, run.eos_token_id)


def shared_full(
    run: Run,
    layout: SharedLayout,
    prompts: Sequence[Sequence[int]],
    groups: Sequence[tuple[int, int]],
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    gen: torch.Generator,
) -> list[list[int]]:
    """Every group of ``groups`` through a shared layout kept full (``refill``): a waiting group takes the
    rows of a group whose rows have all ended, its prompt prefilled once into that group's place
    (``_slots.GroupSlots``). Completions in the order given."""
    graphs, decode, prefix = run.graphs, run.decode, run.prefix
    assert prefix is not None and run.shared_decoder is not None
    device, g, rows = graphs.device, layout.group, layout.rows
    slots = GroupSlots(layout.groups, g, prompts, groups, max_new_tokens, run.eos_token_id)
    plan = WritePlan()
    lengths = torch.zeros(rows, dtype=torch.long, device=device)  # own columns each row fills
    active = torch.zeros(rows, dtype=torch.long, device=device)
    starts = torch.zeros(
        rows, dtype=torch.long, device=device
    )  # each row's prompt length, its first position
    block = torch.zeros((rows, run.sync_every), dtype=torch.long, device=device)
    views = RowViews(run.cache, graphs.batch_size, graphs.max_len)
    pool = RowViews(run.cache, layout.groups, layout.prompt_cols, whole=layout.prompts)
    own = RowViews(run.cache, layout.rows, layout.own_cols, whole=layout.own)
    cols = layout.prompt_length(max(len(prompts[f]) for f, _ in groups))  # one bucket for the call
    cur: torch.Tensor | None = None
    try:
        with slot_writes(views.layers, plan, layout.own):
            views.use(None)
            run.cache.reset()
            d = run.shared_decoder(layout, layout.groups)
            d.idle()
            while not slots.done:
                admitted = slots.admit()
                if admitted:
                    prefix.clear()  # a prefill's attention is the model's own
                    heads = [(r // g, prompts[s]) for r, s in admitted if r % g == 0]
                    logits = _prefill_prompts(run, pool, plan, heads)
                    if cur is None:
                        cur = torch.zeros((rows, logits.shape[-1]), dtype=logits.dtype, device=device)
                        run.follow_weights()  # the first forward of the rollout may have moved them (FSDP2)
                    idx = torch.tensor([r for r, _ in admitted], device=device)
                    cur[idx] = logits[idx // g].to(cur.dtype)
                    lengths[idx] = 0
                    active[idx] = 1
                    starts[idx] = torch.tensor([len(prompts[s]) for _, s in admitted], device=device)
                    d.mask[idx] = False
                    which = torch.tensor([b for b, _ in heads], device=device)
                    d.prompt(which, torch.tensor([len(p) for _, p in heads], device=device))
                    prefix.use(layout, d, layout.groups, cols)
                assert cur is not None
                n = min(run.sync_every, slots.steps_left())
                base = max(len(slots.tokens[s]) for s in slots.seq if s is not None)
                for j in range(n):
                    nxt = sample(cur, temperature, top_p, gen)
                    block[:, j] = nxt
                    d.ids[:, 0] = nxt
                    d.pos[:, 0] = starts + lengths
                    step_index(d.base, lengths, d.index)
                    d.mask[d.rows, 0, 0, lengths] = True
                    plan.decode(d.index)
                    length = layout.own_length(base + j + 1)
                    own.use(rows, length)
                    cur = decode(d, (cols, length))
                    lengths.add_(active)
                ended = slots.record(block[:, :n].tolist())
                if ended:  # idle rows: nothing to write, column 0 to attend to (never an empty row)
                    idx = torch.tensor(ended, device=device)
                    active[idx] = 0
                    lengths[idx] = 0
                    d.mask[idx] = False
                    d.mask[idx, 0, 0, 0] = True
    finally:
        prefix.clear()
        views.use(None)
    return slots.outputs()


def _prefill_prompts(
    run: Run, pool: RowViews, plan: WritePlan, items: Sequence[tuple[int, Sequence[int]]]
) -> torch.Tensor:
    """Prefill each ``(group, prompt)`` of ``items`` into its group's place in a shared layout's prompts
    (``pool``), those of one length together; the last logits of each, by group ``(groups, vocab)``."""
    device, cols = run.graphs.device, pool.max_len
    pool.use(None)  # the layers write into the prompts, from column 0
    out: torch.Tensor | None = None
    by_len: dict[int, list[tuple[int, Sequence[int]]]] = {}
    for group, prompt in items:
        by_len.setdefault(len(prompt), []).append((group, prompt))
    for p, same in by_len.items():
        idx = torch.tensor([i for i, _ in same], device=device)
        ids = torch.tensor([list(q) for _, q in same], dtype=torch.long, device=device)
        pos = torch.arange(p, device=device).expand(len(same), p)
        causal = torch.ones((p, cols), dtype=torch.bool, device=device).tril()
        plan.prefill(idx)
        logits = run.forward(ids, causal.expand(len(same), 1, p, cols), pos)
        if out is None:
            out = torch.zeros((pool.batch_size, logits.shape[-1]), dtype=logits.dtype, device=device)
        out[idx] = logits.to(out.dtype)
    assert out is not None
    return out


def _trimmed(steps: list[torch.Tensor], eos: int) -> list[list[int]]:
    """Each row's tokens of ``steps`` (one tensor per step), up to and including its EOS."""
    out = []
    for row in torch.stack(steps, 1).tolist():
        if eos in row:
            row = row[: row.index(eos) + 1]
        out.append(row)
    return out
