"""Activation checkpointing of chosen decoder layers, composable with activation offloading.

A checkpointed layer runs its forward pass without saving anything and keeps only its inputs; backward
runs the layer again (same RNG and autocast state) and backpropagates through it. The inputs are saved
with ``ctx.save_for_backward``, so when an :func:`rlmem.offload_activations` context is active they are
offloaded like any activation (the layer's own modules save nothing, so its names add nothing). That is
why this is a custom autograd function and not ``torch.utils.checkpoint``'s non-reentrant mode, which keeps
the inputs referenced from Python where no hook can move them. Like every reentrant checkpoint it supports
``loss.backward()``, not ``torch.autograd.grad``.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from . import offloader as activations
from .modmap import ModuleMap, find_module_map

__all__ = ["CheckpointHandle", "checkpoint"]

_SLOT = object()  # where a tensor output goes back
_CACHE_KWARGS = ("past_key_values", "past_key_value", "layer_past")


def _is_cache(key: str, value: Any) -> bool:
    """A KV cache passed to a layer: by one of the keywords transformers has used for it, or as ``cache``
    (its releases that renamed it) when the value is a cache object."""
    if value is None:
        return False
    return key in _CACHE_KWARGS or (key == "cache" and callable(getattr(value, "get_seq_length", None)))


_warned: list[bool] = []


class _CheckpointFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, run: Any, holder: dict, *tensors: torch.Tensor) -> Any:  # type: ignore[override]
        dev = next((t.device for t in tensors if t.device.type != "cpu"), torch.device("cpu"))
        ctx.run, ctx.dev = run, dev
        ctx.cpu_rng = torch.get_rng_state()
        ctx.dev_rng = torch.cuda.get_rng_state(dev) if dev.type == "cuda" else None
        ctx.autocast = {
            d: (torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in {"cpu", dev.type}
        }
        ctx.save_for_backward(*tensors)
        with torch.no_grad():
            out = run(*tensors)
        flat, spec = tree_flatten(out)
        holder["spec"] = spec
        holder["flat"] = [_SLOT if isinstance(x, torch.Tensor) else x for x in flat]
        outs = tuple(x for x in flat if isinstance(x, torch.Tensor))
        ctx.n_out = len(outs)
        return outs

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:  # type: ignore[override]
        saved = ctx.saved_tensors
        inputs = [t.detach().requires_grad_(t.requires_grad) for t in saved]
        devices = [ctx.dev.index or 0] if ctx.dev.type == "cuda" else []
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.random.fork_rng(devices=devices))
            torch.set_rng_state(ctx.cpu_rng)
            if ctx.dev_rng is not None:
                torch.cuda.set_rng_state(ctx.dev_rng, ctx.dev)
            for d, (on, dtype) in ctx.autocast.items():
                stack.enter_context(torch.autocast(d, dtype=dtype, enabled=on))
            with torch.enable_grad():
                out = ctx.run(*inputs)
        flat = [x for x in tree_flatten(out)[0] if isinstance(x, torch.Tensor)]
        pairs = [(o, g) for o, g in zip(flat, grads, strict=False) if o.requires_grad and g is not None]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        return (None, None, *[x.grad if x.requires_grad else None for x in inputs])


def _checkpointed(forward: Any, layer: nn.Module, index: int, args: tuple, kwargs: dict) -> Any:
    if not torch.is_grad_enabled() or torch._C._current_graph_task_id() != -1:
        return forward(*args, **kwargs)
    if any(_is_cache(k, v) for k, v in kwargs.items()) or kwargs.get("use_cache"):
        # The recomputation would update a KV cache a second time; training needs no cache.
        if not _warned:
            warnings.warn(
                "rlmem.checkpoint: a KV cache was passed to a checkpointed layer during training; the layer "
                "runs without it (use_cache=False), as a recomputation would update it twice",
                stacklevel=3,
            )
            _warned.append(True)
        kwargs = {k: (None if _is_cache(k, v) else v) for k, v in kwargs.items()}
        if "use_cache" in kwargs:
            kwargs["use_cache"] = False
    flat, spec = tree_flatten((args, kwargs))
    where = [i for i, x in enumerate(flat) if isinstance(x, torch.Tensor)]
    if not any(flat[i].requires_grad for i in where):
        # A reentrant checkpoint whose inputs need no gradient would cut the layer's parameters off the
        # graph (its output would not require grad): run the layer plainly.
        return forward(*args, **kwargs)

    inputs = [flat[i] for i in where]
    # The closure outlives the forward pass (backward replays it): it must not hold the input tensors,
    # or offloading the saved inputs would free nothing.
    skeleton = [None if isinstance(x, torch.Tensor) else x for x in flat]

    def run(*tensors: torch.Tensor) -> Any:
        full = list(skeleton)
        for i, t in zip(where, tensors, strict=False):
            full[i] = t
        a, k = tree_unflatten(full, spec)
        return forward(*a, **k)

    holder: dict = {}
    off = activations.current()
    scope = (
        off.scope(activations.CHECKPOINT_INPUT, index)
        if off is not None and off.owns_layer(layer)
        else contextlib.nullcontext()
    )
    with scope:
        outs = _CheckpointFn.apply(run, holder, *inputs)
    del inputs, flat
    it = iter(outs)
    full = [next(it) if x is _SLOT else x for x in holder["flat"]]
    return tree_unflatten(full, holder["spec"])


class CheckpointHandle:
    """What :func:`checkpoint` returns: the checkpointed layer indices, and :meth:`remove` to undo it."""

    def __init__(self, layers: list[tuple[int, nn.Module]]) -> None:
        self.layers = [i for i, _ in layers]
        self._patched = layers
        for i, layer in layers:
            forward = layer.forward

            def wrapped(
                *args: Any, _f: Any = forward, _l: nn.Module = layer, _i: int = i, **kwargs: Any
            ) -> Any:
                return _checkpointed(_f, _l, _i, args, kwargs)

            wrapped._rlmem_checkpoint = True  # type: ignore[attr-defined]
            layer.forward = wrapped  # type: ignore[method-assign]

    def remove(self) -> None:
        """Restore the layers' own forward."""
        for _, layer in self._patched:
            if getattr(layer.__dict__.get("forward"), "_rlmem_checkpoint", False):
                del layer.forward
        self._patched = []
        self.layers = []


def checkpoint(
    model: nn.Module,
    *,
    every: int | None = None,
    layers: Sequence[int] | None = None,
    module_map: ModuleMap | None = None,
    enabled: bool = True,
) -> CheckpointHandle:
    """Checkpoint decoder layers of ``model``: one in every ``every`` (0, every, 2 * every, ...) or the
    indices in ``layers``.

    Combined with :func:`rlmem.offload_activations` (its context active around forward and backward), the
    checkpointed layers' inputs are offloaded too.

    Args:
        model: the model (its decoder layers are found as in :func:`rlmem.offload_activations`).
        every: checkpoint layers 0, every, 2 * every, ...; ``every=1`` checkpoints all.
        layers: explicit layer indices (0-based).
        module_map: patterns for a model whose layout rlmem does not recognise.
        enabled: ``False`` changes nothing and returns an empty handle.

    Raises:
        ValueError: both or neither of ``every`` and ``layers``, ``every`` < 1, an index out of range or
            repeated, or no decoder layers found (naming the model class).

    Example:
        >>> ck = rlmem.checkpoint(model, every=2)  # doctest: +SKIP
        >>> ck.layers  # doctest: +SKIP
        [0, 2, 4]
    """
    if (every is None) == (layers is None):
        raise ValueError("checkpoint: pass exactly one of every= or layers=")
    found = find_module_map(model, module_map).layers
    n = len(found)
    if every is not None:
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"every must be an integer >= 1, got {every!r}")
        chosen = list(range(0, n, every))
    else:
        assert layers is not None
        chosen = list(layers)
        bad = [i for i in chosen if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < n]
        if bad:
            raise ValueError(f"layers: {bad} not layer indices of {type(model).__name__} (0..{n - 1})")
        if len(set(chosen)) != len(chosen):
            raise ValueError(f"layers: repeated indices in {chosen}")
    for i in chosen:
        if getattr(found[i][1].__dict__.get("forward"), "_rlmem_checkpoint", False):
            raise ValueError(f"layers: layer {i} of {type(model).__name__} is already checkpointed")
    if not enabled:
        return CheckpointHandle([])
    return CheckpointHandle([(i, found[i][1]) for i in sorted(chosen)])
