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
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ._adopted import CATEGORIES, Group
from ._source import Source

__all__ = [
    "Found",
    "MegatronSource",
    "find",
    "is_wrapper",
    "others",
    "storage_key",
    "tensors_over",
    "torch_optimizers",
    "unseen",
]


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


def storage_key(t: torch.Tensor) -> int:
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
        if isinstance(pd, torch.Tensor) and pd.numel() and storage_key(pd) not in found.covered:
            found.covered.add(storage_key(pd))
            found.param_storages.append(pd)
        if (
            gd.numel() and storage_key(gd) not in found.covered
        ):  # one storage for both (MXFP8) counts as params
            found.covered.add(storage_key(gd))
            found.grad_storages.append(gd)
    grad_keys = {storage_key(g) for g in found.grad_storages} | {storage_key(p) for p in found.param_storages}
    for p in params:
        mg = getattr(p, "main_grad", None)
        if isinstance(mg, torch.Tensor) and storage_key(mg) in grad_keys:
            found.grad_covered.add(id(p))
    if wrapper:
        owned = {id(p) for p in params}
        seen = set(found.covered) | {storage_key(p) for p in params}
        for opt in optimizers:
            for group in opt.param_groups:
                for t in group["params"]:
                    if id(t) in owned or storage_key(t) in seen:
                        continue
                    seen.add(storage_key(t))
                    found.main_params.append(t)
    return found


def tensors_over(storages: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """For each tensor in ``storages``, every Python tensor object over the same storage (itself first).

    One pass over the garbage collector's objects: about 15 ms per 200,000 objects."""
    want = {storage_key(t): [t] for t in storages}
    ids = {k: {id(t)} for k, t in ((storage_key(t), t) for t in storages)}
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
            key = storage_key(o)
        except (RuntimeError, NotImplementedError):
            continue
        seen = ids.get(key)
        if seen is not None and id(o) not in seen:
            seen.add(id(o))
            want[key].append(o)
    return [want[storage_key(t)] for t in storages]


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


class MegatronSource(Source):
    """Megatron-Core's DDP buffers (parameters and gradients) and its optimizers' main parameters, each
    storage adopted whole; the inner optimizers' states are plain ones (the next sources adopt them).

    A discarded grad buffer is not copied: its views, which cannot be placeholders (bucket and shard views
    of one storage), read a zeroed backup as a stand-in, as after ``zero_grad_buffer()``, until it comes
    back, zeroed by Megatron's own ``zero_grad_buffer()``."""

    def __init__(
        self,
        kit: Any,
        root: nn.Module,
        params: list[nn.Parameter],
        optimizers: list[torch.optim.Optimizer],
        optimizer: Any,
    ) -> None:
        super().__init__(kit, root, params, optimizers, optimizer)
        self._found = find(root, params, optimizers, is_wrapper(optimizer))
        self._params = params
        self._main = {id(t) for t in self._found.main_params}
        self._groups: list[tuple[str, Group]] = []
        self._zero_on_return = False

    @staticmethod
    def unwrap(optimizer: Any) -> list[torch.optim.Optimizer] | None:
        return torch_optimizers(optimizer) if is_wrapper(optimizer) else None

    def owns(self, t: torch.Tensor) -> bool:
        return id(t) in self._main or storage_key(t) in self._found.covered

    def adopt_params(self, params: list[nn.Parameter]) -> list[nn.Parameter]:
        rest = [p for p in params if storage_key(p) not in self._found.covered]  # before they move
        self._whole("params", self._found.param_storages)
        # The main parameters, the optimizer's weights of record, with the optimizer states.
        self._whole("optimizer", self._found.main_params)
        return rest

    def adopt_grads(self, params: list[nn.Parameter]) -> list[nn.Parameter]:
        self._whole("grads", self._found.grad_storages, zeroed_on_discard=True)
        return [p for p in params if id(p) not in self._found.grad_covered]

    def _whole(self, category: str, tensors: list[torch.Tensor], *, zeroed_on_discard: bool = False) -> None:
        """Adopt each tensor's whole storage, re-pointing every tensor object over it."""
        if tensors:
            groups = self.kit.repoint(category, tensors_over(tensors), zeroed_on_discard=zeroed_on_discard)
            self._groups += [(category, g) for g in groups]

    def check(self, policies: dict[str, str]) -> None:
        name = self.kit.name
        if policies["params"] == "discard" and self._found.param_storages:
            raise ValueError(
                f"params='discard' is not available for TrainState {name!r}: its parameters live in "
                "Megatron-Core's contiguous parameter buffers, whose views cannot be placeholders; use "
                "params='offload' (or 'keep')"
            )
        if policies["optimizer"] == "discard" and self._found.main_params:
            raise ValueError(
                f"optimizer='discard' is not available for TrainState {name!r}: its optimizer holds "
                "Megatron-Core's fp32 main parameters, the weights of record, which cannot be forgotten; "
                "use optimizer='offload' (or 'keep')"
            )

    def before_offload(self, policies: dict[str, str], moving: list[str]) -> None:
        if policies["grads"] != "keep" and self._found.grad_storages:
            # Megatron's optimizers set .grad of the main parameters (or, with FP32Optimizer, of the model's)
            # to views of the grad buffer, remade at every step: drop them as optimizer.zero_grad() does,
            # rather than chase them.
            buffers = {storage_key(g.flat) for c, g in self._groups if c == "grads"}
            for t in (*self._found.main_params, *self._params):
                if t.grad is not None and storage_key(t.grad) in buffers:
                    t.grad = None
            if policies["grads"] == "discard" and "grads" in moving:
                self._zero_on_return = True
        self._refresh(moving, strict=True)

    def on_return(self, category: str) -> None:
        if category == "grads" and self._zero_on_return:
            # Megatron's own, on the current stream once their memory is mapped (it also resets the buckets
            # and per-parameter flags).
            self._zero_on_return = False
            for m in self._found.owners:
                m.zero_grad_buffer()

    def before_close(self) -> None:
        self._refresh(CATEGORIES, strict=False)

    def _refresh(self, categories: Iterable[str], *, strict: bool) -> None:
        """Add to each storage's group the tensors made over it since it was adopted (Megatron makes its
        shard views at the first gradient sync). ``strict``: raise, before anything is released, if tensors
        Python cannot see still use one."""
        cats = set(categories)
        stale = [g for c, g in self._groups if c in cats and unseen(g.tensors, g.flat)]
        if not stale:
            return
        for g, found in zip(stale, tensors_over([g.flat for g in stale]), strict=True):
            g.tensors[:] = others(found, g.flat)
        left = sum(unseen(g.tensors, g.flat) for g in stale)
        if left and strict:
            raise RuntimeError(
                f"rlmem TrainState {self.kit.name!r}: {left} tensor(s) over Megatron's buffers or main "
                "parameters are held outside Python (by an unfinished asynchronous collective, or a CUDA "
                "graph), so offloading now would leave them pointing at released memory; finish the "
                "gradient and parameter syncs (model.finish_grad_sync(), optimizer.step()) before "
                "entering rollout. Nothing was released."
            )
