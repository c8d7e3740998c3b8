"""Megatron-Core's training state, found by its structure (megatron is never imported here).

Megatron's ``DistributedDataParallel`` keeps every parameter and its ``main_grad`` as views of a few
contiguous buffers (``_ParamAndGradBuffer.param_data`` with the distributed optimizer, and ``grad_data``),
and caches further views of them: one per bucket, and the per-rank shards its reduce-scatter and all-gather
use. Its optimizers (``ChainedOptimizer`` over ``DistributedOptimizer`` /
``Float16OptimizerWithFloat16Params`` / ``FP32Optimizer``) wrap a ``torch.optim`` optimizer whose
parameters are fp32 *main parameters*: clones the wrapper also records in its own groups and on
``model_param.main_param``.

Which views exist depends on the version and on what has run (the shard lists are made at the first
gradient sync), so none is named here: each buffer is adopted whole, as one storage, and *every* tensor
object over it is found (:func:`tensors_over`, through the garbage collector, which tracks every Python
tensor) and re-pointed together, as FSDP2's shards are. The storage's use count says whether tensors
exist that Python cannot see (held by C++ alone, e.g. by an unfinished asynchronous collective):
:func:`unseen` counts them, and an offload refuses to release memory they would still point at. Main
parameters are adopted the same way, one storage each; the inner optimizer's states are ordinary
``optimizer.state``. (PyTorch 2.12 can swap a storage's memory in place, ``_swap_data_ptr_``; 2.11, on the
GPU machine this was built on, cannot, so the one mechanism here works on both.)
"""

from __future__ import annotations

import gc
from dataclasses import dataclass, field

import torch
from torch import nn

__all__ = ["Found", "find", "is_wrapper", "others", "tensors_over", "torch_optimizers", "unseen"]


def is_wrapper(optimizer: object) -> bool:
    """True for a Megatron-style optimizer: not a ``torch.optim.Optimizer`` itself, but chaining others
    (``chained_optimizers``) or wrapping one (``.optimizer``)."""
    if optimizer is None or isinstance(optimizer, torch.optim.Optimizer):
        return False
    chained = getattr(optimizer, "chained_optimizers", None)
    if isinstance(chained, (list, tuple)):
        return True
    return isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer)


def torch_optimizers(optimizer: object) -> list[torch.optim.Optimizer]:
    """The ``torch.optim`` optimizers behind ``optimizer`` (itself when it is one), in order, each once."""
    if optimizer is None:
        return []
    if isinstance(optimizer, torch.optim.Optimizer):
        return [optimizer]
    out: list[torch.optim.Optimizer] = []
    chained = getattr(optimizer, "chained_optimizers", None)
    if isinstance(chained, (list, tuple)):
        for o in chained:
            out.extend(torch_optimizers(o))
    else:
        inner = getattr(optimizer, "optimizer", None)
        if isinstance(inner, torch.optim.Optimizer):
            out.append(inner)
    return list({id(o): o for o in out}.values())


def _buffers(m: nn.Module) -> list[object]:
    """The ``_ParamAndGradBuffer`` objects of a Megatron DDP module: the ``buffers`` and
    ``expert_parallel_buffers`` lists it sets on itself (shadowing ``nn.Module.buffers``); [] for others."""
    out: list[object] = []
    for attr in ("buffers", "expert_parallel_buffers"):
        lst = m.__dict__.get(attr)
        if isinstance(lst, list):
            out.extend(b for b in lst if isinstance(getattr(b, "grad_data", None), torch.Tensor))
    return out


def _key(t: torch.Tensor) -> int:
    """The storage itself (its address in memory), not where its data starts: two storages may start at one
    address (a Region's whole-range tensor and its first view)."""
    return t.untyped_storage()._cdata


@dataclass
class Found:
    """What a Megatron model and optimizer hold, by the storages rlmem adopts whole.

    ``param_storages`` / ``grad_storages``: one tensor per DDP buffer (any view of it; the storage is what
    counts). ``main_params``: optimizer-owned parameters (fp32 main params) in no model or buffer storage.
    ``covered``: storage keys of the buffers (a parameter whose data lies in one is not adopted on its own).
    ``grad_covered``: ids of parameters whose gradient is ``main_grad`` in a grad buffer.
    ``owners``: the DDP modules that hold the buffers (their ``zero_grad_buffer()`` zeroes them).
    """

    param_storages: list[torch.Tensor] = field(default_factory=list)
    grad_storages: list[torch.Tensor] = field(default_factory=list)
    main_params: list[torch.Tensor] = field(default_factory=list)
    covered: set[int] = field(default_factory=set)
    grad_covered: set[int] = field(default_factory=set)
    owners: list[nn.Module] = field(default_factory=list)


def find(
    root: nn.Module, params: list[nn.Parameter], optimizers: list[torch.optim.Optimizer], wrapper: bool
) -> Found:
    """Megatron's buffers in ``root`` and, when ``optimizer`` is a Megatron wrapper, its main parameters."""
    found = Found(owners=[m for m in root.modules() if _buffers(m)])
    for b in (b for m in found.owners for b in _buffers(m)):
        pd = getattr(b, "param_data", None)
        gd = b.grad_data  # type: ignore[attr-defined]
        if isinstance(pd, torch.Tensor) and pd.numel() and _key(pd) not in found.covered:
            found.covered.add(_key(pd))
            found.param_storages.append(pd)
        if gd.numel() and _key(gd) not in found.covered:  # one storage for both (MXFP8) counts as params
            found.covered.add(_key(gd))
            found.grad_storages.append(gd)
    grad_keys = {_key(g) for g in found.grad_storages} | {_key(p) for p in found.param_storages}
    for p in params:
        mg = getattr(p, "main_grad", None)
        if isinstance(mg, torch.Tensor) and _key(mg) in grad_keys:
            found.grad_covered.add(id(p))
    if wrapper:
        owned = {id(p) for p in params}
        seen = set(found.covered) | {_key(p) for p in params}
        for opt in optimizers:
            for group in opt.param_groups:
                for t in group["params"]:
                    if id(t) in owned or _key(t) in seen:
                        continue
                    seen.add(_key(t))
                    found.main_params.append(t)
    return found


def tensors_over(storages: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """For each tensor in ``storages``, every Python tensor object over the same storage (itself first).

    One pass over the garbage collector's objects: about 15 ms per 200,000 objects."""
    want = {_key(t): [t] for t in storages}
    ids = {k: {id(t)} for k, t in ((_key(t), t) for t in storages)}
    devices = {t.device for t in storages}
    kinds: dict[type, bool] = {}
    for o in gc.get_objects():
        cls = type(o)  # not isinstance: that asks some objects for __class__, which may warn or fail
        plain = kinds.get(cls)
        if plain is None:  # DTensors and placeholders hold no storage of ours
            plain = kinds[cls] = (
                issubclass(cls, torch.Tensor) and cls.__name__ != "DTensor" and not hasattr(cls, "_rlmem_why")
            )
        if not plain:
            continue
        try:
            if o.device not in devices or o.is_meta:
                continue
            key = _key(o)
        except (RuntimeError, NotImplementedError):
            continue
        seen = ids.get(key)
        if seen is not None and id(o) not in seen:
            seen.add(id(o))
            want[key].append(o)
    return [want[_key(t)] for t in storages]


def unseen(group: list[torch.Tensor], anchor: torch.Tensor) -> int:
    """How many tensors over ``anchor``'s storage are neither ``anchor`` (nor the base it is a view of) nor
    in ``group``: views made since the group was found, or tensors only C++ holds. Every tensor holds one
    use of its storage, and so does the storage object made to ask."""
    storage = anchor.untyped_storage()
    own = _own(anchor)
    mine = {id(t) for t in group if all(t is not o for o in own)}
    return torch._C._storage_Use_Count(storage._cdata) - 1 - len(own) - len(mine)


def _own(anchor: torch.Tensor) -> list[torch.Tensor]:
    base = anchor._base
    return [anchor] if base is None else [anchor, base]


def others(found: list[torch.Tensor], anchor: torch.Tensor) -> list[torch.Tensor]:
    """``found`` without ``anchor`` and the base it is a view of."""
    own = _own(anchor)
    return [t for t in found if all(t is not o for o in own)]
