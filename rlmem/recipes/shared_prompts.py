"""A GRPO group's prompt forwarded once in scoring and training, with its completions attending to it.

Every completion of a group repeats the group's prompt; scored row by row, the policy (and the reference)
runs the prompt through the model once per sample, forward and backward. Here a group (or a chunk of it)
is one packed row::

    [ prompt[:-1] | prompt[-1] + completion_1 | ... | prompt[-1] + completion_k ]

Each suffix starts with the prompt's last token, so each one predicts all of its completion's tokens and no
logits are made for the prompt. One forward runs the row with a registered attention function
(:data:`NAME`, swapped into the model's config by :func:`packed_attention`): the prefix attends causally to
itself; each suffix attends to the prefix's real tokens and causally to itself. There is no cache: the
prompt's keys and values are the layer's own activations, so the gradients of every completion reach them
once, under FSDP2 as without it, and gradient checkpointing recomputes the same attention (which is why the
backward pass must run inside the block as well).

:func:`packed_logprobs` returns the log-probabilities in the layout of the recipe's ``make_batch`` /
``token_logprobs`` (row ``r``'s completion token ``j`` at column ``len(prompt) - 1 + j``; zero elsewhere), so
``grpo_loss`` and the masks are unchanged. Equal to the row-by-row path within fp32 rounding (the attention's
sums are taken in another order), not bit for bit.

Models whose attention cannot be replaced this way fall back to the row-by-row path
(:func:`unsupported` says why): families not in :data:`FAMILIES`, sliding windows shorter than the
sequences, GPT-2's ``reorder_and_upcast_attn``.

Example::

    groups = Groups.from_rows(prompt_per_row, completions, group_size=8, pad_id=0)
    for chunks in micro_batches(groups, range(groups.n_groups), rows=16):
        packed = groups.pack(chunks, width).to(device)
        with packed_attention(model, packed):
            logp = packed_logprobs(model, packed)  # (rows, width - 1)
            loss = ...
            loss.backward()  # inside the block: a checkpoint's recompute runs the same attention
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .._attention import attending, register

__all__ = [
    "FAMILIES",
    "NAME",
    "Chunk",
    "Groups",
    "Packed",
    "micro_batches",
    "packed_attention",
    "packed_logprobs",
    "unsupported",
]

NAME = "rlmem_shared_prompts"
# Families whose attention modules call transformers' attention interface with (query, key, value) of the
# whole row and read nothing else of the mask: the ones measured equal to the row-by-row path.
FAMILIES = ("gpt2", "llama", "mistral", "qwen2", "qwen3")
# The suffixes' key length (prefix + suffix) is rounded up to this: SDPA's memory-efficient CUDA path copies
# (pads) a mask whose rows are not a multiple of 16 elements (8 in some releases), in every layer.
_ALIGN = 16

# The layout a forward runs with, by id(config): kept in a plain dict (not a context variable) because
# autograd runs a checkpoint's recompute on its own device threads.
_ACTIVE: dict[int, _Layout] = {}


def unsupported(model: nn.Module, max_len: int | None = None) -> str | None:
    """Why ``model`` cannot score packed groups (None when it can), for sequences of up to ``max_len``
    tokens (None: unknown, so any sliding window counts)."""
    cfg = getattr(model, "config", None)
    family = getattr(cfg, "model_type", None)
    if family not in FAMILIES:
        return f"model family {family!r} is not one of {', '.join(FAMILIES)}"
    if getattr(cfg, "reorder_and_upcast_attn", False):
        return "reorder_and_upcast_attn=True (GPT-2's own attention path)"
    window = getattr(cfg, "sliding_window", None)
    sliding = family == "mistral" or "sliding_attention" in (getattr(cfg, "layer_types", None) or ())
    if window is not None and sliding and (max_len is None or window < max_len):
        return f"sliding_window={window} is shorter than the sequences ({max_len} tokens)"
    return None


@dataclasses.dataclass(frozen=True)
class Chunk:
    """Members ``start`` to ``stop - 1`` of group ``group``: one packed row, carrying the prompt once."""

    group: int
    start: int
    stop: int


@dataclasses.dataclass
class Packed:
    """Packed rows of a micro-batch (made by :meth:`Groups.pack`).

    Attributes:
        ids, positions: (units, prefix + members x suffix) token ids and position ids.
        keep: the columns whose logits are needed (each suffix but its last position).
        targets: (units, members x (suffix - 1)) the token each kept column predicts.
        prefix_lens: (units,) real prefix tokens of each row (the prompt but its last token).
        prefix, members, suffix: the layout's sizes.
        rows: the batch rows of the output, in order (those of the chunks, one after another).
        width: the output is (len(rows), width - 1), as ``make_batch`` lays out sequences of width tokens.
        src, out_rows, out_cols: where each completion token's log-prob comes from and goes.
    """

    ids: torch.Tensor
    positions: torch.Tensor
    keep: torch.Tensor
    targets: torch.Tensor
    prefix_lens: torch.Tensor
    prefix: int
    members: int
    suffix: int
    rows: torch.Tensor
    width: int
    src: torch.Tensor
    out_rows: torch.Tensor
    out_cols: torch.Tensor

    def to(self, device: torch.device | str) -> Packed:
        """The same layout on ``device`` (but ``rows``: it indexes the batch, on the host)."""
        moved = {
            f.name: getattr(self, f.name).to(device)
            for f in dataclasses.fields(self)
            if isinstance(getattr(self, f.name), torch.Tensor) and f.name != "rows"
        }
        return dataclasses.replace(self, **moved)

    @property
    def tokens(self) -> int:
        """Tokens the forward runs (padding included)."""
        return self.ids.numel()


@dataclasses.dataclass(frozen=True)
class Groups:
    """A batch of GRPO groups: group ``g``'s prompt is ``prompts[g]`` and its completions are
    ``completions[g * group_size : (g + 1) * group_size]`` (the rows of ``make_batch``, in order)."""

    prompts: list[list[int]]
    completions: list[list[int]]
    group_size: int
    pad_id: int

    @classmethod
    def from_rows(
        cls,
        prompts: Sequence[Sequence[int]],
        completions: Sequence[Sequence[int]],
        group_size: int,
        pad_id: int,
    ) -> Groups:
        """The groups of rows given as the recipe holds them: a prompt and a completion per row, the
        ``group_size`` rows of a group next to each other.

        Raises:
            ValueError: ``group_size`` below 1, lengths that do not match, an empty prompt, or rows of one
                group with different prompts.
        """
        if not isinstance(group_size, int) or group_size < 1:
            raise ValueError(f"group_size must be an int >= 1, got {group_size!r}")
        if len(prompts) != len(completions) or len(prompts) % group_size:
            raise ValueError(
                f"prompts ({len(prompts)}) and completions ({len(completions)}) must be as many, a multiple "
                f"of group_size={group_size}"
            )
        heads = []
        for g in range(0, len(prompts), group_size):
            head = list(prompts[g])
            if not head:
                raise ValueError(f"prompts[{g}] is empty: a completion needs a prompt token to follow")
            for r in range(g + 1, g + group_size):
                if list(prompts[r]) != head:
                    raise ValueError(f"prompts[{r}] differs from prompts[{g}], the first row of its group")
            heads.append(head)
        return cls(heads, [list(c) for c in completions], group_size, pad_id)

    @property
    def n_groups(self) -> int:
        return len(self.prompts)

    def rows(self, chunks: Sequence[Chunk]) -> torch.Tensor:
        """The batch rows of ``chunks``, one chunk after another."""
        g = self.group_size
        return torch.cat([torch.arange(c.group * g + c.start, c.group * g + c.stop) for c in chunks])

    def group_rows(self, groups: Sequence[int]) -> torch.Tensor:
        """The batch rows of whole ``groups``, one group after another."""
        return self.rows([Chunk(int(g), 0, self.group_size) for g in groups])

    def split(self, groups: Sequence[int], members: int) -> list[Chunk]:
        """Each group of ``groups`` in the fewest chunks of at most ``members`` rows, as even as can be."""
        return [c for g in groups for c in self._even(int(g), math.ceil(self.group_size / members))]

    def fit(self, groups: Sequence[int], max_tokens: int) -> list[Chunk]:
        """Each group of ``groups`` in the fewest even chunks whose :meth:`packed_length` is at most
        ``max_tokens`` (single rows where none is)."""
        out = []
        for g in (int(g) for g in groups):
            for n in range(1, self.group_size + 1):
                parts = self._even(g, n)
                if n == self.group_size or all(self.packed_length(c) <= max_tokens for c in parts):
                    out += parts
                    break
        return out

    def divide(self, chunks: Sequence[Chunk], count: int) -> list[Chunk]:
        """``chunks`` with the largest halved until there are ``count`` (or each is one row): a rank with
        fewer chunks than another rank has micro-batches can then run as many."""
        out = list(chunks)
        while len(out) < count:
            i = max(range(len(out)), key=lambda i: out[i].stop - out[i].start)
            c = out[i]
            if c.stop - c.start < 2:
                break
            mid = (c.start + c.stop + 1) // 2
            out[i : i + 1] = [Chunk(c.group, c.start, mid), Chunk(c.group, mid, c.stop)]
        return out

    def _even(self, g: int, n: int) -> list[Chunk]:
        size, extra = divmod(self.group_size, n)
        starts = [i * size + min(i, extra) for i in range(n + 1)]
        return [Chunk(g, starts[i], starts[i + 1]) for i in range(n)]

    def packed_length(self, chunk: Chunk) -> int:
        """Tokens of ``chunk`` packed alone: the prompt but its last token, then per member its longest
        completion plus one (a single member: exactly its sequence's length)."""
        base = chunk.group * self.group_size
        longest = max(len(self.completions[base + i]) for i in range(chunk.start, chunk.stop))
        return len(self.prompts[chunk.group]) - 1 + (chunk.stop - chunk.start) * (longest + 1)

    def pack(self, chunks: Sequence[Chunk], width: int) -> Packed:
        """One packed row per chunk (every row as long as the longest prefix plus the most members times the
        longest suffix; prefixes and suffixes right-padded), for an output of ``width - 1`` columns.

        Raises:
            ValueError: no chunks, or a sequence longer than ``width``.
        """
        if not chunks:
            raise ValueError("chunks is empty")
        g_size = self.group_size
        members = max(c.stop - c.start for c in chunks)
        n = [len(self.prompts[c.group]) - 1 for c in chunks]
        comps = [[self.completions[c.group * g_size + i] for i in range(c.start, c.stop)] for c in chunks]
        suffix = max(2, max(len(s) + 1 for cs in comps for s in cs))
        prefix = max(1, *n)
        prefix += -(prefix + suffix) % _ALIGN
        units, length = len(chunks), prefix + members * suffix
        ids = torch.full((units, length), self.pad_id, dtype=torch.long)
        pos = torch.zeros((units, length), dtype=torch.long)
        cols = torch.arange(max(prefix, suffix))
        src, out_rows, out_cols = [], [], []
        row = 0
        for u, (c, cs) in enumerate(zip(chunks, comps, strict=True)):
            p = self.prompts[c.group]
            if n[u]:
                ids[u, : n[u]] = torch.tensor(p[:-1])
            # A pad's position repeats the last real one: never past what the sequences themselves reach.
            pos[u, :prefix] = cols[:prefix].clamp(max=max(n[u] - 1, 0))
            for i, s in enumerate(cs):
                if len(p) + len(s) > width:
                    r = c.group * g_size + c.start + i
                    raise ValueError(f"row {r} has {len(p) + len(s)} tokens, more than width={width}")
                a = prefix + i * suffix
                ids[u, a] = p[-1]
                if s:
                    ids[u, a + 1 : a + 1 + len(s)] = torch.tensor(s)
                pos[u, a : a + suffix] = n[u] + cols[:suffix].clamp(max=len(s))
                first = u * members * (suffix - 1) + i * (suffix - 1)
                src += range(first, first + len(s))
                out_rows += [row] * len(s)
                out_cols += range(len(p) - 1, len(p) - 1 + len(s))
                row += 1
        keep = (prefix + torch.arange(members)[:, None] * suffix + torch.arange(suffix - 1)).reshape(-1)
        targets = ids[:, prefix:].reshape(units, members, suffix)[:, :, 1:].reshape(units, -1)
        return Packed(
            ids=ids,
            positions=pos,
            keep=keep,
            targets=targets,
            prefix_lens=torch.tensor(n),
            prefix=prefix,
            members=members,
            suffix=suffix,
            rows=self.rows(chunks),
            width=width,
            src=torch.tensor(src, dtype=torch.long),
            out_rows=torch.tensor(out_rows, dtype=torch.long),
            out_cols=torch.tensor(out_cols, dtype=torch.long),
        )


def micro_batches(groups: Groups, order: Sequence[int], rows: int) -> list[list[Chunk]]:
    """Micro-batches of at most ``rows`` rows in ``order``: ``rows // group_size`` whole groups each, or, for
    groups larger than ``rows``, one chunk of a group each (every chunk carrying the prompt once)."""
    if rows < 1:
        raise ValueError(f"rows must be an int >= 1, got {rows!r}")
    order = [int(g) for g in order]
    per = rows // groups.group_size
    if per:
        return [
            [Chunk(g, 0, groups.group_size) for g in order[i : i + per]] for i in range(0, len(order), per)
        ]
    return [[c] for c in groups.split(order, rows)]


class _Layout:
    """What the attention function reads during one packed forward (and its recompute): the sizes, the
    prefixes' real lengths, and the suffixes' mask, made once per dtype and device and shared by the
    layers."""

    def __init__(self, packed: Packed) -> None:
        self.packed = packed
        self._masks: dict[tuple[Any, ...], torch.Tensor] = {}

    def mask(self, grouped: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """(units x members, 1, grouped x suffix, prefix + suffix): 0 where a suffix query may look (its
        prefix's real tokens, its own earlier tokens), -inf elsewhere; rows repeat for ``grouped`` query
        heads packed as positions."""
        key = (grouped, dtype, device)
        if key not in self._masks:
            p = self.packed
            n = p.prefix_lens.to(device)
            units, members, prefix, suffix = len(n), p.members, p.prefix, p.suffix
            # One mask for every row where the prefixes are equally long: a broadcast view, not a copy.
            same = units == 1 or bool((n == n[0]).all())
            distinct = 1 if same else units
            col = torch.arange(prefix, device=device)
            ok_prefix = (col[None] < n[:distinct, None])[:, None, :].expand(distinct, suffix, prefix)
            own = torch.ones(suffix, suffix, dtype=torch.bool, device=device).tril()
            ok = torch.cat([ok_prefix, own.expand(distinct, suffix, suffix)], 2).repeat(1, grouped, 1)
            bias = torch.zeros(ok.shape, dtype=dtype, device=device).masked_fill_(~ok, float("-inf"))
            bias = bias[:, None]
            if same:
                bias = bias.expand(units * members, *bias.shape[1:])
            else:
                bias = bias.repeat_interleave(members, 0)
            self._masks[key] = bias
        return self._masks[key]


def _attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    layout = _ACTIVE.get(id(getattr(module, "config", None)))
    if layout is None:
        raise RuntimeError(f"attention {NAME!r} runs only inside packed_attention() for its model")
    p = layout.packed
    if kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None:
        raise ValueError(f"{NAME}: attention with softcap or sinks cannot be packed")
    window = kwargs.get("sliding_window")
    if window is not None and window < p.width:
        raise ValueError(f"{NAME}: sliding_window={window} is shorter than the sequences ({p.width} tokens)")
    b, heads, _, d = query.shape
    kv_heads, dv = key.shape[1], value.shape[-1]
    grouped = heads // kv_heads
    prefix, members, suffix = p.prefix, p.members, p.suffix
    # The prefix: causal over itself. Right-padded, so a real query sees only real keys.
    out_prefix = F.scaled_dot_product_attention(
        query[:, :, :prefix],
        key[:, :, :prefix],
        value[:, :, :prefix],
        dropout_p=dropout,
        is_causal=True,
        scale=scaling,
        enable_gqa=grouped > 1,
    )

    def rows(t: torch.Tensor) -> torch.Tensor:  # (b, h, members x suffix, e) -> (b x members, h, suffix, e)
        h, e = t.shape[1], t.shape[-1]
        return (
            t[:, :, prefix:]
            .reshape(b, h, members, suffix, e)
            .transpose(1, 2)
            .reshape(b * members, h, suffix, e)
        )

    # Each suffix: its prefix's keys then its own. The query heads of one KV head become query positions of
    # that head, so no key is repeated per query head.
    k = torch.cat([key[:, :, :prefix].repeat_interleave(members, 0), rows(key)], 2)
    v = torch.cat([value[:, :, :prefix].repeat_interleave(members, 0), rows(value)], 2)
    q = rows(query).reshape(b * members, kv_heads, grouped * suffix, d)
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=layout.mask(grouped, q.dtype, q.device), dropout_p=dropout, scale=scaling
    )
    out = out.reshape(b, members, heads, suffix, dv).transpose(1, 2).reshape(b, heads, members * suffix, dv)
    # transformers' attention functions return (batch, length, heads, head_dim)
    return torch.cat([out_prefix, out], 2).transpose(1, 2).contiguous(), None


@contextlib.contextmanager
def packed_attention(model: nn.Module, packed: Packed) -> Iterator[None]:
    """Within the block ``model`` attends by ``packed``'s layout (:func:`packed_logprobs`), and so does a
    gradient checkpoint's recompute: run the backward pass inside it too.

    Raises:
        ValueError: ``model`` is not supported (:func:`unsupported`).
        RuntimeError: already inside a block for this model.
    """
    why = unsupported(model, packed.width)
    if why is not None:
        raise ValueError(f"model: cannot score packed groups: {why}")
    cfg = model.config
    if id(cfg) in _ACTIVE:
        raise RuntimeError("packed_attention is already in force for this model")
    # no mask function under NAME: the model then builds no mask (the layout is the mask)
    register(NAME, _attention, sdpa_mask=False)
    _ACTIVE[id(cfg)] = _Layout(packed)
    try:
        with attending(cfg, NAME):
            yield
    finally:
        del _ACTIVE[id(cfg)]


def packed_logprobs(
    model: nn.Module, packed: Packed, autocast: Callable[[], Any] = contextlib.nullcontext
) -> torch.Tensor:
    """log p(completion token | prompt, earlier completion tokens) of ``packed``'s rows, in fp32, laid out
    as the recipe's ``token_logprobs`` over ``make_batch`` rows of ``packed.width`` columns: (rows,
    width - 1), row ``r``'s completion token ``j`` at column ``len(prompt) - 1 + j``, zero elsewhere.

    Raises:
        RuntimeError: not inside :func:`packed_attention` with this ``packed``.
    """
    layout = _ACTIVE.get(id(model.config))
    if layout is None or layout.packed is not packed:
        raise RuntimeError("packed_logprobs runs inside packed_attention(model, packed) with the same packed")
    with autocast():
        logits = model(
            input_ids=packed.ids, position_ids=packed.positions, logits_to_keep=packed.keep, use_cache=False
        ).logits
    logits = logits.float()
    logp = logits.gather(-1, packed.targets[..., None])[..., 0] - torch.logsumexp(logits, -1)
    out = logp.new_zeros(len(packed.rows), packed.width - 1)
    return out.index_put((packed.out_rows, packed.out_cols), logp.reshape(-1)[packed.src])
