"""A group's prompt held once in the KV cache: the shared layout and its decode attention.

GRPO samples several completions of each prompt, passed to ``generate`` as runs of one prompt repeated
(the recipe's ``group_size``, a server's ``n``, TRL's ``num_generations``). In the unshared layout every row
keeps its own copy of its prompt's keys and values. In the shared layout (``share_prompts``) the same Region
is seen as two parts per layer (:class:`SharedLayout`): a pool of prompts, ``(groups, kv_heads, P, head_dim)``
with ``P = max_len - max_new_tokens``, and the rows' own completions, ``(groups x G, kv_heads, R, head_dim)``
with ``R = max_new_tokens``. Rows ``g x G .. g x G + G - 1`` are group ``g``'s, so the cache holds
``groups x P + rows x R`` token columns instead of ``rows x max_len``, and the same bytes decode more rows
(``config.shared_layout``). Each prompt is prefilled once, into its group's place in the pool.

A decode step's attention (:func:`_attention`, registered with transformers' attention interface under
:data:`NAME` and put in place by :meth:`Prefix.swap`, as ``_gqa`` does) attends over the group's prompt and
the row's own completion in two parts merged by their log-sum-exp: the query heads of a group's ``G`` rows
read its prompt once, as ``G x`` query positions of each KV head (one kernel per layer over every group),
and each row reads its own completion as ``_gqa`` reads the cache. Each part is the attention kernel
PyTorch's SDPA runs itself, called for its log-sum-exp (memory-efficient attention on CUDA, the flash
kernel on the host), or the same arithmetic in fp32 where it is not there. Every shape is fixed by the
layout and every index lives on the device, so the step is captured into CUDA graphs like any other, keyed
by the layout and the prompt and completion column buckets. The merge is not SDPA's single reduction: the
result equals the unshared step's within rounding (fp32: ~1e-7; bf16: one rounding of the output).

Prefill, and any step of more than one token, runs the model's own attention; so does every step of a
sampler whose model the shared step cannot serve (:meth:`Prefix.verdict`: attention not routed through the
interface for every layer, a logit softcap, attention sinks, a sliding window shorter than ``max_len``, key
and value heads of other sizes than the queries'), which keeps the unshared layout.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..._attention import attending, register
from ..._units import round_up
from ._gqa import NAME as GROUPED
from ._graphs import Decode

__all__ = ["NAME", "Prefix", "SharedDecode", "SharedLayout", "groups_of"]

NAME = "rlmem_shared_prefix"
# The sampler's holder of each model config in a swap, by id: what the registered function reads.
_HOLDERS: dict[int, Prefix] = {}
# The attention implementations the shared step stands in for (their arithmetic is SDPA's).
_SDPA = ("sdpa", GROUPED)
# Whether PyTorch's attention kernels returning a log-sum-exp may be called, by device type: False once
# one refused its arguments (the fp32 arithmetic then serves, with a warning once).
_KERNELS: dict[str, bool] = {}


def groups_of(prompts: Sequence[Sequence[int]], most: int) -> list[tuple[int, int]]:
    """Runs of one prompt repeated, consecutive, as ``(first, count)``, each at most ``most`` long (a longer
    run is split)."""
    out: list[tuple[int, int]] = []
    i = 0
    while i < len(prompts):
        j = i + 1
        while j < len(prompts) and j - i < most and list(prompts[j]) == list(prompts[i]):
            j += 1
        out.append((i, j - i))
        i = j
    return out


def longest_run(prompts: Sequence[Sequence[int]]) -> int:
    """The longest run of one prompt repeated, consecutive."""
    best = run = 0
    for i, p in enumerate(prompts):
        run = run + 1 if i and list(p) == list(prompts[i - 1]) else 1
        best = max(best, run)
    return best


class SharedLayout:
    """A shared layout of the cache's Region: each layer's whole keys and values (``whole``: rows of
    ``max_len`` columns) seen as ``groups`` prompts of ``max_len - max_new_tokens`` columns followed by
    ``groups x group`` rows of ``max_new_tokens``; the Region's bytes, seen another way.

    Args:
        whole: each layer's keys and values in the unshared layout, contiguous.
        groups, group: prompts held at once, rows per prompt.
        max_len, max_new_tokens: the cache's columns per row, and the completions' own.
        block: granularity of the column buckets a step reads (``kv_block``).
    """

    def __init__(
        self,
        whole: Sequence[tuple[torch.Tensor, torch.Tensor]],
        *,
        groups: int,
        group: int,
        max_len: int,
        max_new_tokens: int,
        block: int,
    ) -> None:
        self.groups, self.group, self.block = groups, group, block
        self.prompt_cols, self.own_cols = max_len - max_new_tokens, max_new_tokens
        self.prompts: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.own: list[tuple[torch.Tensor, torch.Tensor]] = []
        for k, v in whole:
            _, heads, _, dim = k.shape
            pool = (groups, heads, self.prompt_cols, dim)
            rows = (self.rows, heads, self.own_cols, dim)
            n = math.prod(pool)
            if n + math.prod(rows) > k.numel():
                raise ValueError("the shared layout does not fit the cache")
            p, o = [], []
            for t in (k, v):
                flat = t.view(-1)
                p.append(flat[:n].view(pool))
                o.append(flat[n : n + math.prod(rows)].view(rows))
            self.prompts.append((p[0], p[1]))
            self.own.append((o[0], o[1]))

    @property
    def rows(self) -> int:
        return self.groups * self.group

    def nbytes(self) -> int:
        """Bytes of the cache the layout addresses (its prompts and rows, every layer, keys and values)."""
        return sum(t.numel() * t.element_size() for pair in (*self.prompts, *self.own) for t in pair)

    def buckets(self) -> list[int]:
        """Groups a step decodes with: powers of two below ``groups``, and ``groups``."""
        sizes = [1 << k for k in range(self.groups.bit_length()) if 1 << k < self.groups]
        return [*sizes, self.groups]

    def bucket(self, n: int, graphs: bool) -> int:
        """The groups a batch of ``n`` groups decodes with: its bucket with graphs, ``n`` without."""
        return next(b for b in self.buckets() if b >= n) if graphs else n

    def prompt_length(self, n: int) -> int:
        """The prompt columns bucket that holds ``n`` columns."""
        return min(self.prompt_cols, round_up(n, self.block))

    def own_length(self, n: int) -> int:
        """The completion columns bucket that holds ``n`` columns."""
        return min(self.own_cols, round_up(n, self.block))


class SharedDecode(Decode):
    """:class:`~._graphs.Decode`'s buffers for ``groups x group`` rows of a shared layout: ids, positions,
    the rows' mask over their own columns, their write index there; and each group's prompt mask, additive
    in ``dtype`` (its columns padded to 16 for the attention kernels). Graphs are keyed by the pair of
    column buckets ``(prompt, own)``."""

    def __init__(
        self,
        groups: int,
        group: int,
        layout: SharedLayout,
        heads: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__(groups * group, layout.own_cols, heads, device)
        self.groups, self.group = groups, group
        cols = round_up(layout.prompt_cols, 16)
        self.bias = torch.zeros((groups, 1, 1, cols), dtype=dtype, device=device)
        self._cols = torch.arange(cols, device=device)

    def step_mask(self, length: Any) -> torch.Tensor:
        return self.mask[..., : length[1]]

    def idle(self) -> None:
        """Every row idle: each attends to column 0 of its own columns and of its group's prompt (a row with
        nothing to attend to would be NaN)."""
        self.ids.zero_()
        self.pos.zero_()
        self.mask.zero_()
        self.mask[..., 0] = True
        self.bias.fill_(float("-inf"))
        self.bias[..., 0] = 0

    def prompt(self, groups: torch.Tensor, lengths: torch.Tensor) -> None:
        """Groups ``groups`` attend to the first ``lengths`` columns of their prompts."""
        keep = self._cols[None] < lengths[:, None]
        fill = torch.zeros((), dtype=self.bias.dtype, device=self.bias.device)
        self.bias[groups] = torch.where(keep, fill, float("-inf"))[:, None, None]


class Prefix:
    """What a shared decode step's attention reads beside the cache's layers (which hold the rows' own
    columns): each layer's prompts, the groups' prompt mask, the rows per group. Held by the sampler; its
    :meth:`swap` puts :data:`NAME` in place for a forward pass."""

    def __init__(self) -> None:
        self.layers: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self.bias: torch.Tensor | None = None
        self.group = 1
        self.inner = "sdpa"  # the attention in force before the swap: what every other call runs
        self.seen: dict[str, Any] | None = None  # while recording
        self._recorded: dict[str, Any] = {}
        self.max_len = 0  # while recording: a sliding window at least this long changes nothing

    @property
    def engaged(self) -> bool:
        """Whether a forward pass needs the swap now: a shared step, or recording."""
        return self.layers is not None or self.seen is not None

    def use(self, layout: SharedLayout, d: SharedDecode, groups: int, cols: int) -> None:
        """Shared steps from now on, over the first ``groups`` groups and ``cols`` prompt columns."""
        self.layers = [(k[:groups, :, :cols], v[:groups, :, :cols]) for k, v in layout.prompts]
        self.bias = d.bias[:groups, :, :, :cols]
        self.group = layout.group

    def clear(self) -> None:
        """No shared step until :meth:`use` (a prefill: every attention the model's own)."""
        self.layers = self.bias = None

    @contextlib.contextmanager
    def swap(self, model: nn.Module) -> Iterator[None]:
        """Within the block, ``model``'s attention goes through :func:`_attention`, which runs the attention
        in force before (``_gqa``'s, SDPA) for everything but a shared step."""
        cfg = model.config
        self.inner = cfg._attn_implementation
        if self.inner not in _SDPA:  # not SDPA's arithmetic: nothing to stand in for (``verdict`` says so)
            yield
            return
        register(NAME, _attention)
        _HOLDERS[id(cfg)] = self
        try:
            with attending(cfg, NAME):
                yield
        finally:
            _HOLDERS.pop(id(cfg), None)

    @contextlib.contextmanager
    def recording(self, max_len: int) -> Iterator[None]:
        """Within the block, every attention call of the model (of sequences up to ``max_len``) is recorded
        for :meth:`verdict`, and runs as before."""
        self.seen, self.max_len = {"layers": [], "problems": []}, max_len
        try:
            yield
        finally:
            self._recorded, self.seen = self.seen, None

    def verdict(self, n_layers: int) -> str | None:
        """Why the shared step cannot serve the model whose pass was recorded last (a cache of ``n_layers``
        layers); None if it can."""
        seen = self._recorded
        if self.inner not in _SDPA:
            return f"its attention is {self.inner!r}, not SDPA"
        if seen.get("problems"):
            return seen["problems"][0]
        if sorted(seen.get("layers", ())) != list(range(n_layers)):
            return "its attention does not go through transformers' attention interface in every layer"
        return None

    def record(
        self, module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kw: Any
    ) -> None:
        assert self.seen is not None
        problems = self.seen["problems"]
        idx = getattr(module, "layer_idx", None)
        if not isinstance(idx, int):
            problems.append(f"{type(module).__name__} has no layer_idx")
        else:
            self.seen["layers"].append(idx)
        if kw.get("softcap") is not None:
            problems.append("it caps its attention logits (softcap)")
        if kw.get("s_aux") is not None or kw.get("sinks") is not None:
            problems.append("its attention has sinks")
        window = kw.get("sliding_window")
        if window is not None and window < self.max_len:
            problems.append(f"it attends over a sliding window of {window} < max_len={self.max_len}")
        if not query.shape[-1] == key.shape[-1] == value.shape[-1] or query.shape[1] % key.shape[1]:
            problems.append("its keys and values are not grouped query heads of one size")

    def attend(
        self,
        module: nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        mask: torch.Tensor,
        scaling: float | None,
    ) -> torch.Tensor:
        """One shared step's attention: ``query`` ``(rows, heads, 1, dim)``, ``key``/``value`` the rows' own
        columns, ``mask`` their additive mask ``(rows, 1, 1, own)``; the layer's prompts from :meth:`use`.
        Returns ``(rows, 1, heads, dim)`` in the cache's dtype (the compute dtype: what SDPA under autocast
        computes in, whatever dtype the rotary embedding left the queries in)."""
        assert self.layers is not None and self.bias is not None
        dtype = key.dtype
        b, h, _, d = query.shape
        kv = key.shape[1]
        grp, g = h // kv, self.group
        groups = b // g
        scale = d**-0.5 if scaling is None else scaling
        pk, pv = self.layers[module.layer_idx]  # type: ignore[index]
        # A row's query heads by KV head, then a group's rows' heads as query positions of each KV head.
        q = query.to(dtype).reshape(b, kv, grp, d)
        qp = q.reshape(groups, g, kv, grp, d).transpose(1, 2).reshape(groups, kv, g * grp, d)
        o1, l1 = _part(qp, pk, pv, self.bias, scale)
        o2, l2 = _part(q, key, value, mask, scale)
        o1 = o1.reshape(groups, kv, g, grp, d).transpose(1, 2).reshape(b, kv, grp, d)
        l1 = l1.reshape(groups, kv, g, grp).transpose(1, 2).reshape(b, kv, grp)
        lse = torch.logaddexp(l1, l2)
        out = o1 * (l1 - lse).exp()[..., None] + o2 * (l2 - lse).exp()[..., None]
        return out.to(dtype).reshape(b, h, 1, d).transpose(1, 2)


def _part(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``q`` over ``k``/``v`` with an additive ``bias`` (broadcast over heads and queries), and
    its log-sum-exp in fp32 ``(batch, heads, queries)``."""
    kind = q.device.type
    if _KERNELS.get(kind, True):
        try:
            if kind == "cuda":
                # What SDPA runs for a masked step, its mask made as SDPA makes it (aligned, then expanded
                # to every head and query); its log-sum-exp is padded to 32 queries.
                full = _aligned(bias.to(q.dtype)).expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
                out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(
                    q, k, v, full, True, scale=scale
                )[:2]
                return out, lse[..., : q.shape[2]]
            if kind == "cpu":
                out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                    q, k, v, attn_mask=bias.to(q.dtype), scale=scale
                )
                return out, lse
        except (RuntimeError, AttributeError, TypeError) as e:
            _KERNELS[kind] = False
            warnings.warn(
                f"HFSampler's shared prompts: PyTorch's attention kernel on {kind} refused the step "
                f"({type(e).__name__}: {e}); its attention runs in fp32 operations from now on",
                RuntimeWarning,
                stacklevel=2,
            )
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale + bias.float()
    lse = torch.logsumexp(s, -1)
    return torch.matmul(torch.softmax(s, -1), v.float()).to(q.dtype), lse


def _aligned(bias: torch.Tensor) -> torch.Tensor:
    """``bias`` with every stride but the last a multiple of 16 elements, as the memory-efficient kernel
    reads it (what SDPA does to a mask: padded, then sliced back)."""
    n = bias.shape[-1]
    if bias.stride(-1) == 1 and all(s % 16 == 0 for s in bias.stride()[:-1]):
        return bias
    return F.pad(bias, (0, -n % 16))[..., :n]


def _attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    p = _HOLDERS.get(id(getattr(module, "config", None)))
    if p is not None and p.seen is not None:
        p.record(module, query, key, value, kwargs)
    shared = p is not None and p.layers is not None and query.shape[2] == 1 and attention_mask is not None
    if not shared:
        inner = ALL_ATTENTION_FUNCTIONS["sdpa" if p is None else p.inner]
        return inner(
            module,
            query,
            key,
            value,
            attention_mask,
            dropout=dropout,
            scaling=scaling,
            is_causal=is_causal,
            **kwargs,
        )
    assert p is not None and attention_mask is not None
    return p.attend(module, query, key, value, attention_mask, scaling), None
