"""Plain PyTorch tensors in a TrainState: parameters, gradients, buffers and optimizer states, each copied
into a Region view and its holder rebound to it (``p.data``, ``p.grad``, ``module._buffers[name]``,
``optimizer.state[p][k]``). The last source: it adopts whatever the stacks before it left.

Gradients follow PyTorch's own conventions, so training is bit-for-bit what it would be without rlmem:

* A gradient that exists (``zero_grad(set_to_none=False)``, gradient accumulation) *is* the Region view;
  autograd accumulates into it in place and ``clip_grad_norm_`` scales it in place.
* ``zero_grad()`` (``set_to_none=True``, the default) leaves ``p.grad`` None, as usual. When backward next
  produces a gradient, a post-accumulate hook copies it into the Region view and rebinds ``p.grad`` to it
  (one device copy per parameter, the freshly made tensor goes back to the caching allocator). Users who
  want no copy at all call ``zero_grad(set_to_none=False)``.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from functools import partial
from typing import Any

import torch
from torch import nn

from ._adopted import Slot, empty_like, nbytes
from ._holders import Holder, put_param
from ._source import Source, StateItem

__all__ = ["PlainSource"]


class PlainSource(Source):
    """Parameters, gradients, buffers and optimizer states that are plain ``torch.Tensor``s."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self._grads: dict[int, Slot] = {}  # id(param) -> its gradient's slot
        self._with_grads: list[nn.Parameter] = []

    @staticmethod
    def unwrap(optimizer: Any) -> list[torch.optim.Optimizer] | None:
        return [optimizer] if isinstance(optimizer, torch.optim.Optimizer) else None

    def accepts(self, p: nn.Parameter) -> bool:
        return type(p.data) is torch.Tensor

    def adopt_params(self, params: list[nn.Parameter]) -> list[nn.Parameter]:
        # Distinct Parameter objects over the same memory must keep sharing it; overlaps that are not
        # identical views cannot be represented as separate contiguous views.
        keys: dict[tuple, int] = {}
        spans: dict[int, list[tuple[int, int, nn.Parameter]]] = defaultdict(list)
        unique: list[nn.Parameter] = []
        alias: dict[int, int] = {}
        for p in params:
            if p.numel() == 0:
                unique.append(p)
                continue
            key = (p.data_ptr(), tuple(p.shape), tuple(p.stride()), p.dtype, p.device)
            if key in keys:
                alias[id(p)] = keys[key]
                continue
            keys[key] = id(p)
            base = p.untyped_storage().data_ptr()
            start = p.data_ptr() - base
            spans[base].append((start, start + nbytes(p), p))
            unique.append(p)
        for lst in spans.values():
            lst.sort(key=lambda s: s[0])
            for (_, a1, pa), (b0, _, pb) in itertools.pairwise(lst):
                if b0 < a1:
                    raise ValueError(
                        f"two parameters (shapes {tuple(pa.shape)} and {tuple(pb.shape)}) overlap in memory "
                        "without being the same view; TrainState cannot give them separate storage"
                    )
        slots: dict[int, Slot] = {}
        for p, slot in zip(unique, self.kit.place("params", [p.data for p in unique]), strict=True):
            p.data = slot.view
            slots[id(p)] = slot
        for p in params:
            slot = slots[alias.get(id(p), id(p))]
            if id(p) in alias:
                p.data = slot.view
            slot.holders.append(Holder(lambda p=p: p, partial(put_param, p)))
        return []

    def adopt_grads(self, params: list[nn.Parameter]) -> list[nn.Parameter]:
        # One slot per trainable Parameter object: even parameters aliasing the same data are separate
        # autograd leaves with separate gradients.
        trainable = [p for p in params if p.requires_grad]
        regions = self.kit.new_regions("grads", ((p.device, nbytes(p)) for p in trainable))
        for p in trainable:
            region = regions[p.device]
            view = empty_like(region, p.data)
            g = p.grad
            if g is not None and g.shape == p.shape and g.dtype == p.dtype and g.layout == torch.strided:
                view.copy_(g)
                p.grad = view
            holder = Holder(lambda p=p: p.grad, partial(setattr, p, "grad"))
            self._grads[id(p)] = self.kit.add(Slot(region, view, [holder]))
            self._with_grads.append(p)
            self.kit.hooks.append(p.register_post_accumulate_grad_hook(self._after_accumulate))
        return []

    def adopt_buffers(self, root: nn.Module) -> None:
        entries: list[tuple[nn.Module, str, torch.Tensor]] = []
        for m in root.modules():
            for n, b in m._buffers.items():
                if b is not None and type(b) is torch.Tensor and not b.is_meta:
                    entries.append((m, n, b))
        uniq: dict[int, torch.Tensor] = {}
        for _, _, b in entries:
            uniq.setdefault(id(b), b)
        slots = dict(zip(uniq, self.kit.place("buffers", list(uniq.values())), strict=True))
        for m, n, b in entries:
            slot = slots[id(b)]
            m._buffers[n] = slot.view
            slot.holders.append(
                Holder(lambda m=m, n=n: m._buffers.get(n), partial(m._buffers.__setitem__, n))
            )

    def takes_state(self, value: torch.Tensor) -> torch.Tensor | None:
        return value if type(value) is torch.Tensor else None

    def adopt_states(self, items: list[StateItem]) -> None:
        for it, slot in zip(items, self.kit.place("optimizer", [it.value for it in items]), strict=True):
            opt, p, k = it.optimizer, it.param, it.name
            opt.state[p][k] = slot.view
            slot.holders.append(
                Holder(lambda p=p, k=k, opt=opt: opt.state.get(p, {}).get(k), partial(_put_state, opt, p, k))
            )
            self.kit.set_state(it.key, slot, slot.view.data_ptr())

    def before_offload(self, policies: dict[str, str], moving: list[str]) -> None:
        if policies["grads"] == "discard" and "grads" in moving:
            for p in self._with_grads:
                p.grad = None

    def _after_accumulate(self, p: nn.Parameter) -> None:
        slot = self._grads.get(id(p))
        g = p.grad
        if slot is None or g is None or g.data_ptr() == slot.view.data_ptr():
            return
        if self.kit.paused("grads"):
            raise RuntimeError(
                f"TrainState {self.kit.name!r}: backward produced gradients while they are offloaded; "
                "call reload() before training"
            )
        if g.shape != slot.view.shape or g.dtype != slot.view.dtype or g.layout != torch.strided:
            return  # not a gradient of the parameter's own kind: leave it to PyTorch
        slot.view.copy_(g)
        p.grad = slot.view


def _put_state(opt: torch.optim.Optimizer, p: nn.Parameter, key: str, t: torch.Tensor) -> None:
    st = opt.state.get(p)
    if st is not None:
        st[key] = t
