"""The KV cache: a ``transformers.StaticCache`` whose layers' keys and values are views of one Region.

The cache is made (:func:`static_cache`) and its layers initialised by one decode step of a single sequence
(:func:`probe`: shapes, dtype, device, through the public path, which holds across transformers releases),
then each layer's tensors are replaced by views of the full batch in the Region (:func:`into_region`):
probing at the full batch would hold the whole cache twice. The Region's pause gives the whole cache back
to the device and its resume takes it again at the same addresses, which the CUDA graphs keep reading.
While a generation runs, :class:`RowViews` narrows the layers to the rows and columns a step reads. Its
size: :func:`kv_bytes_per_token` of the model's config, and the rows a byte budget holds
(:func:`batch_size_for`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from ...memory.region import Region
from ...plan.shapes import kv_bytes_per_token as _kv_bytes
from .config import kv_batch

__all__ = [
    "Forward",
    "RowViews",
    "batch_size_for",
    "into_region",
    "kv_bytes_per_token",
    "probe",
    "static_cache",
]

# The sampler's step of the model: token ids, attention mask, positions -> last-position logits, the keys and
# values written into the cache on the way.
Forward = Callable[[torch.Tensor, torch.Tensor | None, torch.Tensor | None], torch.Tensor]


def _kv_shape(config: Any) -> tuple[int, int, int]:
    layers = config.num_hidden_layers
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return layers, kv_heads, head_dim


def kv_bytes_per_token(config: Any, dtype: torch.dtype) -> int:
    """Bytes of KV cache one token of a ``transformers`` config takes across all layers (keys and values)."""
    layers, kv_heads, head_dim = _kv_shape(config)
    return _kv_bytes(layers, kv_heads, head_dim, torch.empty((), dtype=dtype).element_size())


def batch_size_for(
    config: Any, dtype: torch.dtype, max_len: int, batch_size: int | None, kv_budget_bytes: int | None
) -> int:
    """``batch_size`` checked, or as many sequences of ``max_len`` as ``kv_budget_bytes`` holds."""
    per_seq = kv_bytes_per_token(config, dtype) * max_len
    if batch_size is None:  # the one sizing of a KV batch by bytes, the recipe's too
        batch_size = kv_batch(per_seq, kv_budget_bytes, max_len=max_len)  # type: ignore[arg-type]
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    return batch_size


def static_cache(config: Any, max_len: int, dtype: torch.dtype) -> Any:
    """``transformers.StaticCache`` whose layers take keys and values in ``dtype``, the compute dtype.

    A static cache allocates its layers in the dtype of the first keys (or keys and values) written to it,
    and later writes must match. Under autocast over fp32 weights they need not: Qwen3 normalises its keys
    with an RMSNorm whose fp32 weight times the bf16 projection gives fp32 keys, while its values leave
    ``v_proj`` in bf16, so the cache was made fp32 and the first bf16 write failed (``index_copy_``), or,
    where transformers sizes values apart, kept fp32 keys at twice the bytes. Attention casts its inputs to
    the autocast dtype either way, so storing them in it changes no result. ``.to`` is a no-op where the
    dtype already matches (every family whose keys and values leave their projections as they are).
    """
    from transformers import StaticCache

    class _Cache(StaticCache):
        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kw: Any) -> Any:
            return super().update(key_states.to(dtype), value_states.to(dtype), *args, **kw)

    return _Cache(config=config, max_cache_len=max_len)


@torch.no_grad()
def probe(cache: Any, forward: Forward, ids: torch.Tensor, name: str) -> None:
    """One decode step of one sequence (``forward`` of ``ids``) into ``cache``, which initialises its layers;
    raises ``ValueError`` naming why if the model (``name``) cannot be sampled this way. A model the sampler
    cannot serve fails here, at start, not in the middle of a rollout."""
    try:
        forward(ids, None, None)
    except torch.OutOfMemoryError:
        raise
    except (RuntimeError, TypeError, ValueError, AttributeError, NotImplementedError) as e:
        raise ValueError(
            f"HFSampler cannot sample from {name}: one decode step into a static KV cache failed "
            f"({type(e).__name__}: {e})"
        ) from e
    for i, layer in enumerate(cache.layers):
        kv = (getattr(layer, "keys", None), getattr(layer, "values", None))
        if not all(isinstance(t, torch.Tensor) and t.dim() == 4 and t.numel() for t in kv):
            raise ValueError(
                f"HFSampler cannot sample from {name}: its layer {i} wrote no keys and values into the "
                f"static KV cache (a model must call Cache.update from its attention)"
            )


def into_region(
    cache: Any,
    batch_size: int,
    extra: list[tuple[tuple[int, ...], torch.dtype]],
    device: torch.device,
    name: str,
    paused: bool,
) -> tuple[Region, int, int, list[torch.Tensor]]:
    """A Region for ``cache``'s layers at ``batch_size`` rows and, after them, ``extra`` tensors (shape and
    dtype each: what lives and sleeps with the cache), each layer's keys and values re-pointed at their
    views there. ``paused``: the addresses reserved, no memory taken until the Region resumes.

    Returns:
        The Region, the cache's bytes, the extra tensors' bytes, and the extra tensors.
    """
    layers = cache.layers
    shapes = [((batch_size, *t.shape[1:]), t.dtype) for layer in layers for t in (layer.keys, layer.values)]
    nbytes = [math.prod(s) * torch.empty((), dtype=d).element_size() for s, d in (*shapes, *extra)]
    region = Region(sum(nbytes) + 256 * len(nbytes), device, name=name, paused=paused)
    views = [region.empty(s, d) for s, d in shapes]
    tensors = [region.empty(s, d) for s, d in extra]
    for i, layer in enumerate(layers):
        layer.keys, layer.values = views[2 * i], views[2 * i + 1]
        if hasattr(layer, "batch_size"):
            layer.batch_size = batch_size
    return region, sum(nbytes[: len(shapes)]), sum(nbytes[len(shapes) :]), tensors


class RowViews:
    """The cache's layers and the Region's whole keys and values behind them, taken as a generation starts
    (the layers hold the whole tensors then): :meth:`use` points the layers at the rows and columns a step
    reads, and the whole tensors are where per-row writes go (``_slots``). ``whole``: other tensors of each
    layer to narrow instead (a shared layout's prompts or completions, ``_prefix``)."""

    def __init__(
        self,
        cache: Any,
        batch_size: int,
        max_len: int,
        whole: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
    ) -> None:
        self.layers = cache.layers
        self.whole = whole if whole is not None else [(layer.keys, layer.values) for layer in self.layers]
        self.batch_size = batch_size
        self.max_len = max_len

    def use(self, n: int | None, length: int | None = None) -> None:
        """Point the cache's layers at the first ``n`` rows and ``length`` columns of the Region's tensors
        (None: all of them)."""
        whole = (n is None or n == self.batch_size) and (length is None or length == self.max_len)
        for layer, (k, v) in zip(self.layers, self.whole, strict=True):
            layer.keys, layer.values = (k, v) if whole else (k[:n, :, :length], v[:n, :, :length])
