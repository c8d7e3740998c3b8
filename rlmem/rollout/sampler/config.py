"""The sampler's settings as one typed config: built once by the recipe (or by ``rlmem serve``'s flags) and
passed whole to :class:`~rlmem.rollout.HFSampler` in this process or to ``rlmem serve`` as JSON, so every
setting reaches the server as it reaches the in-process sampler; and the one sizing of the KV batch."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from ..._checks import check_choice, check_flag, check_int
from ..._dtypes import DTYPE_NAMES, torch_dtype

__all__ = ["CUDA_GRAPHS", "SamplerConfig", "kv_batch"]

CUDA_GRAPHS = ("auto", "on", "off")  # cuda_graphs' values, here and in ``rlmem train`` and ``rlmem serve``


@dataclass(frozen=True, kw_only=True)
class SamplerConfig:
    """What :class:`~rlmem.rollout.HFSampler` is built with, other than the model and its weights.

    Args:
        max_len: prompt plus completion tokens per sequence (>= 2).
        batch_size: sequences the KV cache holds; None: as many as ``kv_budget_bytes`` affords.
        kv_budget_bytes: bytes the cache may take (with ``batch_size`` None).
        pad_token_id, eos_token_id: the tokenizer's ids.
        compute_dtype: ``"bf16"`` / ``"fp16"`` / ``"fp32"``: autocast to it (the cache takes it too); None:
            the weights' dtype.
        sync_every, cuda_graphs, fused, kv_block, gqa, refill, share_prompts: as
            :class:`~rlmem.rollout.HFSampler` takes them (its defaults).

    Raises:
        ValueError: a field out of range, named.

    Example:
        >>> cfg = SamplerConfig(max_len=64, batch_size=8, pad_token_id=0, eos_token_id=2)
        >>> SamplerConfig.from_json(cfg.to_json()) == cfg
        True
    """

    max_len: int
    batch_size: int | None = None
    kv_budget_bytes: int | None = None
    pad_token_id: int
    eos_token_id: int
    compute_dtype: str | None = None
    sync_every: int = 8
    cuda_graphs: str = "auto"
    fused: str = "auto"
    kv_block: int | None = None
    gqa: str = "auto"
    refill: bool = True
    share_prompts: bool = False

    def __post_init__(self) -> None:
        check_int("SamplerConfig.max_len", self.max_len, minimum=2)
        for name in ("batch_size", "kv_budget_bytes", "kv_block"):  # None: sized or chosen by the sampler
            if getattr(self, name) is not None:
                check_int(f"SamplerConfig.{name}", getattr(self, name))
        if self.batch_size is None and self.kv_budget_bytes is None:
            raise ValueError("SamplerConfig: give batch_size or kv_budget_bytes")
        check_int("SamplerConfig.pad_token_id", self.pad_token_id, minimum=0)
        check_int("SamplerConfig.eos_token_id", self.eos_token_id, minimum=0)
        check_int("SamplerConfig.sync_every", self.sync_every)
        if self.compute_dtype is not None:
            check_choice("compute_dtype", self.compute_dtype, tuple(DTYPE_NAMES))
        check_choice("cuda_graphs", self.cuda_graphs, CUDA_GRAPHS)
        check_choice("fused", self.fused, ("auto", "on", "off"))
        check_choice("gqa", self.gqa, ("auto", "off"))
        check_flag("refill", self.refill)
        check_flag("share_prompts", self.share_prompts)

    def sampler_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of :class:`~rlmem.rollout.HFSampler` (the dtype as torch's)."""
        kw = dataclasses.asdict(self)
        kw["compute_dtype"] = None if self.compute_dtype is None else torch_dtype(self.compute_dtype)
        return kw

    def to_json(self) -> str:
        """The config as JSON (what ``rlmem serve --sampler-config`` takes)."""
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> SamplerConfig:
        """The config of :meth:`to_json`'s text.

        Raises:
            ValueError: not a JSON object of this config's fields (the unknown ones named), or a field out
                of range.
        """
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"sampler config: not JSON ({e})") from None
        if not isinstance(d, dict):
            raise ValueError(f"sampler config: a JSON object of its fields, got {type(d).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(
                f"sampler config: unknown field(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}"
            )
        return cls(**d)


def kv_batch(
    per_seq_bytes: int,
    budget_bytes: int,
    cap: int | None = None,
    *,
    max_len: int,
    field: str = "kv_budget_bytes",
) -> int:
    """Sequences a KV cache of ``budget_bytes`` holds at ``per_seq_bytes`` each, at most ``cap``.

    Raises:
        ValueError: the budget holds less than one sequence of ``max_len`` tokens (naming ``field``, the
            argument the budget came from).
    """
    if not isinstance(budget_bytes, int) or budget_bytes < per_seq_bytes:
        raise ValueError(
            f"{field} must hold at least one sequence of max_len={max_len} ({per_seq_bytes} bytes); "
            f"got {budget_bytes!r}"
        )
    n = budget_bytes // per_seq_bytes
    return n if cap is None else min(cap, n)


def shared_layout(capacity: int, *, max_len: int, max_new_tokens: int, group_size: int) -> tuple[int, int]:
    """The groups a KV cache of ``capacity`` token columns (rows of ``max_len`` in the unshared layout, times
    ``max_len``) holds when each group's rows keep their prompt once (``share_prompts``): a group takes
    ``max_len - max_new_tokens`` columns for its prompt and ``max_new_tokens`` for each of its rows'
    completions.

    Returns:
        ``(groups, rows per group)``: ``group_size`` rows per group, fewer where a group of ``group_size``
        does not fit; ``(0, 0)`` where not even a group of two does (the unshared layout is used then).
    """
    prompt = max_len - max_new_tokens
    if max_new_tokens < 1 or prompt < 1 or group_size < 2:
        return 0, 0
    per = min(group_size, (capacity - prompt) // max_new_tokens)
    if per < 2:
        return 0, 0
    return capacity // (prompt + per * max_new_tokens), per


def kv_rows(
    per_token_bytes: int,
    budget_bytes: int,
    *,
    max_len: int,
    max_new_tokens: int,
    group_size: int = 1,
    field: str = "kv_budget_bytes",
) -> int:
    """Completions a KV cache of ``budget_bytes`` decodes at once, each of up to ``max_new_tokens`` after a
    prompt, in groups of ``group_size`` completions of one prompt.

    ``group_size`` 1, the unshared layout: ``kv_batch`` rows of ``max_len`` tokens each. ``group_size`` >= 2
    with ``share_prompts``: the same Region (``kv_batch`` rows of ``max_len``) holds each group's prompt once,
    ``prompts x (max_len - max_new_tokens) + rows x max_new_tokens`` token columns in all
    (:func:`shared_layout`); where that holds fewer rows than the unshared layout, the unshared one is used.

    Example:
        >>> kv_rows(1, 10 * 2304, max_len=2304, max_new_tokens=256)
        10
        >>> kv_rows(1, 10 * 2304, max_len=2304, max_new_tokens=256, group_size=16)
        48

    Raises:
        ValueError: the budget holds less than one sequence of ``max_len`` tokens.
    """
    batch = kv_batch(per_token_bytes * max_len, budget_bytes, max_len=max_len, field=field)
    groups, per = shared_layout(
        batch * max_len, max_len=max_len, max_new_tokens=max_new_tokens, group_size=group_size
    )
    return max(batch, groups * per)


def kv_batch_shared(rows: int, *, max_len: int, max_new_tokens: int, group_size: int) -> int:
    """The ``batch_size`` (rows of ``max_len`` tokens in the unshared layout) whose KV cache decodes ``rows``
    completions at once in groups of ``group_size`` sharing their prompt (``share_prompts``): what the
    sampler is sized with to hold those rows in ``ceil(rows / group_size) x (max_len - max_new_tokens) +
    rows x max_new_tokens`` token columns rather than ``rows x max_len``.

    Example:
        >>> kv_batch_shared(64, max_len=2304, max_new_tokens=256, group_size=16)
        11

    Raises:
        ValueError: a size is not positive, or ``max_new_tokens`` leaves no room for a prompt.
    """
    for name, v in (("rows", rows), ("max_new_tokens", max_new_tokens), ("group_size", group_size)):
        check_int(name, v)
    if max_new_tokens >= max_len:
        raise ValueError(f"max_new_tokens must be below max_len={max_len}, got {max_new_tokens}")
    groups = -(-rows // group_size)
    per = min(group_size, rows)
    cols = groups * (max_len - max_new_tokens + per * max_new_tokens)
    return -(-cols // max_len)
