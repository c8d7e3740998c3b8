"""Megatron-Core with rlmem (``pip install rlmem[megatron]``).

:class:`rlmem.PhaseManager` and :class:`rlmem.TrainState` take a Megatron trainer as it is built: the model
(one module, or the list of virtual-pipeline chunks) wrapped in Megatron's ``DistributedDataParallel``, and
the optimizer ``get_megatron_optimizer`` returns (``ChainedOptimizer`` over ``DistributedOptimizer``,
``Float16OptimizerWithFloat16Params`` or ``FP32Optimizer``)::

    model = DistributedDataParallel(config, ddp_config, gpt_model)
    optimizer = get_megatron_optimizer(opt_config, [model])
    pm = rlmem.PhaseManager(model, optimizer, rlmem.OffloadConfig(offload_during_rollout=True))
    with pm.rollout():
        ...   # parameters, gradient buffers, fp32 main parameters and optimizer states are in host memory
    pm.prefetch()  # optional: start bringing them back while rewards are computed
    with pm.train():
        model.zero_grad_buffer(); optimizer.zero_grad(); ...; optimizer.step()

What moves: each DDP buffer (``param_data`` with the distributed optimizer, ``grad_data``) as one Region, its
views (every parameter, ``main_grad``, the buckets and Megatron's per-rank shard views) keeping their
addresses; each fp32 main parameter; the inner optimizer's states. ``grads="discard"`` (the default) is
``zero_grad_buffer()``: nothing is copied, and the buffer comes back zeroed (while it is away its views read
a zeroed stand-in in pinned host memory, the buffer's size). ``params="discard"`` and
``optimizer="discard"`` are refused: the buffers' views cannot be placeholders, and the main parameters are
the weights of record. Every rank adopts its own buffers and shards, so tensor, pipeline and data
parallelism need nothing more; with ``overlap_param_gather`` finish the parameter all-gather (a forward or
``model.start_param_sync(force_sync=True)``) before entering rollout.

:func:`state_bytes` says what a Megatron trainer holds on this rank, counted from Megatron's own objects,
and :func:`offload_activations` / :func:`checkpoint` recognise Megatron's ``TransformerLayer`` by itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .._results import Result
from ..train import _megatron as _mc

__all__ = ["MegatronStateBytes", "main_params", "state_bytes"]


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@dataclass(frozen=True)
class MegatronStateBytes(Result):
    """What a Megatron trainer holds on this rank's device, by kind.

    Attributes:
        param_buffers: the DDP parameter buffers (``param_data``; distributed optimizer only).
        params_outside: parameters not in a buffer (all of them without the distributed optimizer).
        grad_buffers: the DDP gradient buffers (``grad_data``, where ``main_grad`` lives).
        main_params: fp32 main parameters (copies the optimizer owns).
        optimizer_states: the inner optimizers' state tensors on the device.
        total: the sum.
    """

    param_buffers: int
    params_outside: int
    grad_buffers: int
    main_params: int
    optimizer_states: int
    total: int


def state_bytes(model: nn.Module | list[nn.Module], optimizer: Any = None) -> MegatronStateBytes:
    """Count a Megatron trainer's device state from Megatron's own objects (independently of rlmem).

    Args:
        model: the DDP-wrapped model or its list of chunks.
        optimizer: what ``get_megatron_optimizer`` returned (or a ``torch.optim`` optimizer, or None).
    """
    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    root = nn.ModuleList(chunks)
    params = list(root.parameters())
    opts = _mc.torch_optimizers(optimizer)
    found = _mc.find(root, params, opts, _mc.is_wrapper(optimizer))
    seen: set[int] = set()

    def once(ts: list[torch.Tensor], whole: bool) -> int:
        n = 0
        for t in ts:
            key = _mc.storage_key(t)
            if t.device.type != "cuda" or key in seen:
                continue
            seen.add(key)
            n += t.untyped_storage().nbytes() if whole else _nbytes(t)
        return n

    pbuf = once(found.param_storages, True)
    gbuf = once(found.grad_storages, True)
    outside = once(params, False)
    main = once(found.main_params, True)
    states = once(
        [v for o in opts for st in o.state.values() for v in st.values() if isinstance(v, torch.Tensor)], True
    )
    return MegatronStateBytes(
        param_buffers=pbuf,
        params_outside=outside,
        grad_buffers=gbuf,
        main_params=main,
        optimizer_states=states,
        total=pbuf + outside + gbuf + main + states,
    )


def main_params(optimizer: Any) -> list[torch.Tensor]:
    """The tensors ``optimizer`` updates, in its order: Megatron's fp32 main parameters (this rank's shards
    under the distributed optimizer) behind a ``ChainedOptimizer`` or a mixed-precision one; a
    ``torch.optim`` optimizer's own parameters."""
    return [p for o in _mc.torch_optimizers(optimizer) for g in o.param_groups for p in g["params"]]
