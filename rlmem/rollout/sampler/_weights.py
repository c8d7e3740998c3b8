"""The weights a rollout reads when they are not the model's own parameters.

- The rollout copy (``rollout_dtype``): every parameter in that dtype, in a Region of its own
  (:func:`rollout_copy`), refreshed from the model after each optimizer step (:func:`copy_parameters`). With
  a sharded model (FSDP2) it holds the full weights, gathered at each refresh, and the rollout runs the
  model's unsharded twin over them (:func:`twin`): no communication while sampling, and the weights the CUDA
  graphs read stay at the copy's addresses from one rollout to the next.
- Weights owned elsewhere (``weights=``: another process's, mapped here, updated in place by their owner):
  checked to cover the model (:func:`attached_state`).

The sampler runs the model over either with ``torch.func.functional_call``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from ..._dtensor import copy_full, is_dtensor
from ..._units import round_up
from ...memory.region import Region

__all__ = [
    "RolloutCopy",
    "attached_state",
    "check_rollout_dtype",
    "copy_parameters",
    "first_param",
    "rollout_copy",
    "sharded",
    "twin",
]


@dataclass
class RolloutCopy:
    """A model's parameters copied into a Region (``rollout_dtype``), and what the rollout runs over them."""

    region: Region
    tensors: dict[str, torch.Tensor]  # by parameter name, tied parameters once
    state: dict[str, torch.Tensor]  # what functional_call runs over: the copy (+ the buffers, sharded)
    runner: nn.Module  # the model itself, or a sharded model's unsharded twin


def check_rollout_dtype(rollout_dtype: torch.dtype | None) -> None:
    """Raises ``ValueError`` unless ``rollout_dtype`` is a floating ``torch.dtype`` or None."""
    if rollout_dtype is not None and not (
        isinstance(rollout_dtype, torch.dtype) and rollout_dtype.is_floating_point
    ):
        raise ValueError(f"rollout_dtype must be a floating torch.dtype or None, got {rollout_dtype!r}")


def rollout_copy(model: nn.Module, dtype: torch.dtype, device: torch.device, name: str) -> RolloutCopy:
    """Room for ``model``'s parameters in ``dtype`` (not yet filled: :func:`copy_parameters`), in a Region
    named ``{name}/weights``.

    Raises:
        ValueError: a sharded model whose twin cannot be built, or whose names do not cover the twin's.
    """
    named = dict(model.named_parameters())  # tied parameters once: functional_call ties them back
    buffers: dict[str, torch.Tensor] = {}
    runner = model
    if sharded(model):
        runner = twin(model)
        buffers = dict(model.named_buffers())
        _check_covers(runner, {**named, **buffers}, "rollout_dtype: the sharded model's")
    size = sum(round_up(p.numel() * dtype.itemsize, 256) for p in named.values())
    region = Region(size, device, name=f"{name}/weights")
    tensors = {n: region.empty(p.shape, dtype) for n, p in named.items()}
    return RolloutCopy(region, tensors, {**tensors, **buffers}, runner)


def copy_parameters(model: nn.Module, tensors: Mapping[str, torch.Tensor]) -> None:
    """Copy (and cast) ``model``'s parameters into ``tensors``. Sharded parameters (FSDP2's DTensors) are
    gathered whole, cast to the copy's dtype first, many in one all-gather (:func:`copy_full`): a collective,
    so every rank copies together."""
    copy_full((p, tensors[n]) for n, p in model.named_parameters())


def attached_state(model: nn.Module, weights: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What the rollout runs ``model`` over with ``weights`` (by parameter and buffer name): those, and the
    model's own buffers where ``weights`` has none.

    Raises:
        ValueError: a parameter or buffer missing, of another shape, or on the meta device.
    """
    if not isinstance(weights, Mapping) or not weights:
        raise ValueError("weights must be a non-empty mapping of name -> tensor")
    own = {n: b for n, b in model.named_buffers() if b.device.type != "meta"}
    state = {**own, **weights}
    _check_covers(model, state, "weights")
    meta = [n for n, t in state.items() if t.device.type == "meta"]
    if meta:
        raise ValueError(f"weights: {meta[0]!r} is on the meta device (it has no data)")
    return state


def first_param(model: nn.Module, weights: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The tensor ``weights`` holds for the model's first parameter (its device and dtype are the
    sampler's)."""
    if not isinstance(weights, Mapping):
        raise ValueError(f"weights must be a mapping of name -> tensor, got {type(weights).__name__}")
    name = next(n for n, _ in model.named_parameters())
    t = weights.get(name)
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"weights has no tensor for the model's parameter {name!r}")
    return t


def sharded(model: nn.Module) -> bool:
    """Whether FSDP2 wraps any of ``model``'s modules or any parameter is a DTensor (also while FSDP holds
    the parameters gathered, when they read as plain tensors)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a PyTorch built without distributed
        return False
    return any(isinstance(m, FSDPModule) for m in model.modules()) or any(
        is_dtensor(p) for p in model.parameters()
    )


def twin(model: nn.Module) -> nn.Module:
    """The same Hugging Face model as ``model``, without FSDP: built from its config on the meta device (no
    memory), in eval mode. The rollout runs it over the copy's full tensors, so FSDP's hooks (which would
    gather the sharded weights at every forward, through the communicators) never run, and the weights the
    CUDA graphs read stay at the copy's addresses from one rollout to the next.

    Raises:
        ValueError: the model has no Hugging Face ``config`` to build the twin from.
    """
    from torch.distributed.fsdp import FSDPModule

    cls = next(c for c in type(model).__mro__ if not issubclass(c, FSDPModule))
    config = getattr(model, "config", None)
    if config is None:
        raise ValueError(
            f"rollout_dtype with a sharded model needs a transformers model (a config to build its unsharded "
            f"twin from); {cls.__name__} has none: leave rollout_dtype=None"
        )
    with torch.device("meta"):
        out = cls(config)
    return out.eval()


def _check_covers(model: nn.Module, state: Mapping[str, torch.Tensor], what: str) -> None:
    """Every parameter and buffer of ``model`` is in ``state`` with its shape (anything else would stay on
    the meta device, with no data)."""
    for n, t in (*model.named_parameters(), *model.named_buffers()):
        got = state.get(n)
        if got is None or tuple(got.shape) != tuple(t.shape):
            raise ValueError(
                f"{what} {n!r} does not match the model's "
                f"({None if got is None else tuple(got.shape)} vs {tuple(t.shape)})"
            )
