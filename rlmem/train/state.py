"""TrainState: a model's parameters, gradients and optimizer states adopted into Regions, by category.

Adoption moves each tensor into a :class:`rlmem.Region` of its category (``params``, ``grads``,
``optimizer``, ``buffers``) and device, and rebinds the original holders to the new views (``p.data``,
``p.grad``, ``optimizer.state[p][k]``, ``module._buffers[name]``). The user's references (the Parameter
objects, the optimizer, the model) keep working, and every address stays fixed across offload and reload.

Gradients follow PyTorch's own conventions, so training is bit-for-bit what it would be without rlmem:

* A gradient that exists (``zero_grad(set_to_none=False)``, gradient accumulation) *is* the Region view;
  autograd accumulates into it in place and ``clip_grad_norm_`` scales it in place.
* ``zero_grad()`` (``set_to_none=True``, the default) leaves ``p.grad`` None, as usual. When backward next
  produces a gradient, a post-accumulate hook copies it into the Region view and rebinds ``p.grad`` to it
  (one device copy per parameter, the freshly made tensor goes back to the caching allocator). Users who
  want no copy at all call ``zero_grad(set_to_none=False)``.
* Offloading gradients with ``"discard"`` sets ``p.grad`` to None, exactly like ``zero_grad()``.

Optimizer states that ``step()`` creates lazily are adopted after the step that creates them (and at every
offload, which also catches states replaced by ``load_state_dict``). Host-side scalars of CUDA parameters
(the ``step`` counter of non-fused Adam/AdamW) stay where they are.

While a category is offloaded its holders point at its bytes in the host backup, so reading the model or the
optimizer (``state_dict()``, ``torch.save``, ``save_pretrained``, norms) gives exactly what training resumes
from, and writes are what reload brings back. On a GPU they stay tensors of the same device and dtype, over
the pinned backup mapped into the device's address space: moving ``p.data`` to another device would make
autograd drop the parameter's gradient accumulator, on which DistributedDataParallel (and Megatron-Core's DDP)
hook their gradient reduction. Discarded parameters and buffers point at placeholders of the same device,
dtype and shape that hold no memory and raise an error naming rlmem on any use of their values.

Why one module of ~850 lines: adoption, offload, reload and close share the slots, the Regions and the
re-pointed holders, and each must undo the others exactly (bit-identical training after any sequence of
them). The holders' mechanics are in ``_holders.py``, FSDP2's in ``_dtensor.py``.
"""

from __future__ import annotations

import itertools
import time
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import nn

from .._checks import check_choice, check_flag
from .._results import Result
from ..memory.region import Handle, Region, _round_up
from . import _dtensor as _dt
from . import _holders
from . import _megatron as _mc
from ._holders import Entry, Holder

__all__ = ["CATEGORIES", "POLICIES", "CategoryStats", "SwitchRecord", "TrainState", "TrainStateStats"]

CATEGORIES = ("params", "buffers", "grads", "optimizer")  # also the reload order
POLICIES = ("keep", "offload", "discard")
_ALIGN = 256


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _dense_strides(t: torch.Tensor) -> bool:
    """True if ``t`` covers exactly ``numel`` elements with no gaps (a permuted contiguous layout)."""
    expected = 1
    dims = sorted(((st, s) for s, st in zip(t.shape, t.stride(), strict=True) if s != 1))
    for stride, size in dims:
        if stride != expected:
            return False
        expected *= size
    return True


def _empty_like(region: Region, t: torch.Tensor) -> torch.Tensor:
    """A view in ``region`` shaped like ``t``, with ``t``'s strides when they are dense (so layout-sensitive
    kernels, and the gradients autograd lays out like their parameter, round exactly as before), else
    contiguous."""
    if t.is_contiguous() or not _dense_strides(t):
        return region.empty(t.shape, t.dtype, align=_ALIGN)
    flat = region.empty(t.numel(), t.dtype, align=_ALIGN)
    return flat.as_strided(t.shape, t.stride())


def check_policy(name: str, value: object) -> str:
    return check_choice(name, value, POLICIES)


@dataclass
class _Slot:
    """One adopted tensor: its Region view and how to put a view back into its holder."""

    view: torch.Tensor
    region: Region


@dataclass(frozen=True)
class CategoryStats(Result):
    """One category of a :class:`TrainState` (``params``, ``grads``, ``optimizer``, ``buffers``).

    Attributes:
        bytes: bytes of the adopted tensors.
        reserved_bytes: device addresses reserved for them (rounded up to the allocation granularity).
        resident_bytes: bytes backed by device memory now (0 while offloaded or discarded).
        backup_bytes: pinned host backup held for them.
        policy: ``"keep"``, ``"offload"`` or ``"discard"``: what the last offload did to them.
        regions: how many Regions hold them.
    """

    bytes: int
    reserved_bytes: int
    resident_bytes: int
    backup_bytes: int
    policy: str
    regions: int


@dataclass(frozen=True)
class SwitchRecord(Result):
    """The last offload and reload: seconds (None when it was non-blocking), bytes copied, and the rate."""

    offload_s: float | None
    offload_bytes: int
    offload_gbps: float | None
    reload_s: float | None
    reload_bytes: int
    reload_gbps: float | None


@dataclass(frozen=True)
class TrainStateStats(Result):
    """What :meth:`TrainState.stats` returns: ``categories[name]`` and the ``last`` switch."""

    categories: dict[str, CategoryStats]
    last: SwitchRecord


class TrainState:
    """Parameters, gradients and optimizer states of a model, adopted into Regions so they can be offloaded.

    Args:
        model: any ``nn.Module`` (or a list of them: Megatron's virtual-pipeline chunks), DDP- or
            FSDP2-wrapped too (DTensor parameters: each rank adopts its own shards, and FSDP's sharded
            storage is re-pointed so FSDP keeps working unchanged; gradients FSDP makes are adopted when
            offloaded), or wrapped in Megatron-Core's ``DistributedDataParallel`` (its contiguous parameter
            and gradient buffers are adopted whole, one storage each, and every view of them, ``main_grad``
            and the buckets' included, stays valid). Tied parameters keep one storage; frozen parameters
            count as params;
            parameters with dense non-contiguous strides (a transposed weight) keep them, and the rare ones
            with gaps between elements become contiguous. Parameters may live on several devices
            (one Region per category and device) or on the CPU (host backend).
        optimizer: any ``torch.optim.Optimizer`` over parameters of ``model``, an optimizer that
            Megatron-Core's ``get_megatron_optimizer`` returns (its fp32 main parameters are adopted with
            the optimizer states), or None.
        buffers: also adopt the model's buffers (category ``"buffers"``).
        name: a label for Regions, errors and stats.

    Raises:
        ValueError: the optimizer holds a parameter the model does not own, two parameters overlap in
            memory without being the same tensor, or a parameter is of a kind that cannot be adopted.

    Example:
        >>> model = torch.nn.Linear(4, 4)
        >>> opt = torch.optim.AdamW(model.parameters())
        >>> state = TrainState(model, opt)
        >>> model(torch.ones(2, 4)).sum().backward(); opt.step()
        >>> state.offload(params="offload", grads="discard", optimizer="offload", blocking=True)
        >>> state.reload(blocking=True)
    """

    def __init__(
        self,
        model: nn.Module | list[nn.Module],
        optimizer: Any = None,
        *,
        buffers: bool = False,
        name: str = "train",
    ) -> None:
        if isinstance(model, (list, tuple)) and model and all(isinstance(m, nn.Module) for m in model):
            root: nn.Module = nn.ModuleList(model)  # a view of the chunks; they stay as they are
        elif isinstance(model, nn.Module):
            root = model
        else:
            raise ValueError(
                "model must be a torch.nn.Module or a non-empty list of them (model chunks), got "
                f"{type(model).__name__}"
            )
        wrapper = _mc.is_wrapper(optimizer)
        if optimizer is not None and not wrapper and not isinstance(optimizer, torch.optim.Optimizer):
            raise ValueError(
                "optimizer must be a torch.optim.Optimizer, a Megatron-Core optimizer (one with an inner "
                f"torch optimizer, or chained ones) or None, got {type(optimizer).__name__}"
            )
        check_flag("buffers", buffers)
        self.model = model
        self.optimizer = optimizer
        self._root = root
        self._opts = _mc.torch_optimizers(optimizer)
        self.name = name
        self._regions: dict[str, list[Region]] = {c: [] for c in CATEGORIES}
        self._params: list[nn.Parameter] = []
        self._param_slots: dict[int, _Slot] = {}
        self._grad_slots: dict[int, _Slot] = {}
        self._buffer_slots: list[tuple[nn.Module, str, _Slot]] = []
        self._repointed: list[tuple[str, Region, torch.Tensor, list[torch.Tensor]]] = []
        self._state_slots: dict[tuple[int, str], _Slot] = {}
        self._opt_of: dict[int, torch.optim.Optimizer] = {}  # parameter id -> the optimizer holding its state
        self._hooks: list[Any] = []
        self._policy: dict[str, str] = dict.fromkeys(CATEGORIES, "keep")
        self._pending: dict[str, list[Handle]] = {c: [] for c in CATEGORIES}
        # Holders pointed away from each category's Regions while they are paused (or until a non-blocking
        # reload has been waited for).
        self._away: dict[str, list[Entry]] = {c: [] for c in CATEGORIES}
        # Holders by (region, with DTensor groups): the same every cycle until the adopted state changes.
        self._entry_cache: dict[tuple[int, bool], list[Entry]] = {}
        self._last: dict[str, Any] = {
            "offload_s": None,
            "reload_s": None,
            "offload_bytes": 0,
            "reload_bytes": 0,
        }
        self._closed = False
        # Megatron-Core: storages adopted whole (their flats' ids), the Regions whose discard points at a
        # zeroed stand-in, and the Regions to zero when they come back.
        self._whole: set[int] = set()
        self._standin: set[int] = set()
        self._standin_dirty: set[int] = set()
        self._zero_grads_on_return = False

        params = list(root.parameters())
        self._mc = _mc.find(root, params, self._opts, wrapper)
        params = self._collect_params(params)
        self._adopt_params(params)
        self._adopt_grads(params)
        self._adopt_whole("optimizer", self._mc.main_params)
        for t in self._mc.main_params:
            self._param_by_id[id(t)] = t  # type: ignore[assignment]
        if buffers:
            self._adopt_buffers(root)
        for opt in self._opts:
            self._hooks.append(opt.register_step_pre_hook(self._before_step))
            self._hooks.append(
                opt.register_state_dict_pre_hook(lambda *_: self._drain(("optimizer",), host=True))
            )
            self._hooks.append(opt.register_step_post_hook(lambda *_: self.adopt_optimizer_states()))
        self.adopt_optimizer_states()
        for m in root.modules():
            if m._parameters or (buffers and m._buffers):
                # prepend: run before FSDP's own pre-forward all-gather reads the sharded parameters
                self._hooks.append(m.register_forward_pre_hook(self._before_forward, prepend=True))
                self._hooks.append(m.register_state_dict_pre_hook(self._before_state_dict))
        if any(t.device.type == "cuda" for t in params):
            torch.cuda.empty_cache()  # the tensors adopted from the caching allocator are free now

    # -- adoption ------------------------------------------------------------------------------------
    def _collect_params(self, params: list[nn.Parameter]) -> list[nn.Parameter]:
        for p in params:
            plain = type(p.data) is torch.Tensor or _dt.is_dtensor(p.data)
            if not plain or p.is_sparse or p.is_quantized or p.is_meta or _dt.local(p.data).is_meta:
                raise ValueError(
                    "TrainState adopts dense, materialised parameters (plain tensors or DTensors); got a "
                    f"{type(p.data).__name__} {'meta ' if p.is_meta else ''}parameter of shape "
                    f"{tuple(p.shape)}"
                )
        owned = {id(p) for p in params} | {id(t) for t in self._mc.main_params}
        for opt in self._opts:
            for gi, group in enumerate(opt.param_groups):
                for p in group["params"]:
                    if id(p) not in owned and _mc._key(p) not in self._mc.covered:
                        raise ValueError(
                            f"optimizer param_groups[{gi}] holds a parameter of shape {tuple(p.shape)} "
                            "that is not in the model; TrainState needs a model that owns every optimized "
                            "parameter"
                        )
        self._params = params
        self._param_by_id = {id(p): p for p in params}
        return params

    def _new_regions(self, category: str, tensors: Iterable[torch.Tensor]) -> dict[torch.device, Region]:
        return self._new_regions_for(category, ((t.device, _nbytes(t)) for t in tensors))

    def _new_regions_for(
        self, category: str, sizes_in: Iterable[tuple[torch.device, int]]
    ) -> dict[torch.device, Region]:
        self._entry_cache.clear()
        sizes: dict[torch.device, int] = defaultdict(int)
        for dev, n in sizes_in:
            sizes[dev] += _round_up(max(n, 1), _ALIGN)
        out = {}
        for dev, size in sizes.items():
            region = Region(size, dev, name=f"{self.name}/{category}/{dev}")
            self._regions[category].append(region)
            out[dev] = region
        return out

    @staticmethod
    def _place(region: Region, t: torch.Tensor) -> torch.Tensor:
        view = _empty_like(region, t)
        view.copy_(t)
        return view

    def _repoint(self, category: str, groups: list[list[torch.Tensor]]) -> None:
        """Copy each group's storage into a Region of ``category`` and re-point the group's tensors."""
        if not groups:
            return
        regions = self._new_regions_for(category, ((g[0].device, _dt.storage_bytes(g[0])) for g in groups))
        for g in groups:
            region = regions[g[0].device]
            flat = region.empty(_dt.storage_bytes(g[0]), torch.uint8, align=_ALIGN)
            _dt.copy_storage(g[0], flat)
            _dt.repoint(g, flat)
            self._repointed.append((category, region, flat, g))

    def _adopt_whole(self, category: str, tensors: list[torch.Tensor]) -> None:
        """Adopt each tensor's whole storage, re-pointing every tensor object over it (Megatron's buffers and
        main parameters, see ``_megatron.py``)."""
        if not tensors:
            return
        before = len(self._repointed)
        self._repoint(category, _mc.tensors_over(tensors))
        for _, region, flat, _ in self._repointed[before:]:
            self._whole.add(id(flat))
            if category == "grads":
                self._standin.add(id(region))

    def _refresh_whole(self, categories: Iterable[str], *, strict: bool) -> None:
        """Add to each whole storage's group the tensors made over it since it was adopted (Megatron makes
        its shard views at the first gradient sync). ``strict``: raise, before anything is released, if
        tensors Python cannot see still use one."""
        cats = set(categories)
        stale = [
            (flat, g)
            for c, _, flat, g in self._repointed
            if c in cats and id(flat) in self._whole and _mc.unseen(g, flat)
        ]
        if not stale:
            return
        for (flat, g), found in zip(stale, _mc.tensors_over([f for f, _ in stale]), strict=True):
            g[:] = _mc.others(found, flat)
        left = sum(_mc.unseen(g, flat) for flat, g in stale)
        if left and strict:
            raise RuntimeError(
                f"rlmem TrainState {self.name!r}: {left} tensor(s) over Megatron's buffers or main "
                "parameters are held outside Python (by an unfinished asynchronous collective, or a CUDA "
                "graph), so offloading now would leave them pointing at released memory; finish the "
                "gradient and parameter syncs (model.finish_grad_sync(), optimizer.step()) before "
                "entering rollout. Nothing was released."
            )

    def _adopt_params(self, params: list[nn.Parameter]) -> None:
        params = [p for p in params if _mc._key(p) not in self._mc.covered]  # before they move
        self._adopt_whole("params", self._mc.param_storages)
        sharded = [p for p in params if _dt.is_dtensor(p.data)]
        if sharded:
            holders = _dt.fsdp_holders(self._root)
            self._repoint(
                "params", _dt.storage_groups([(_dt.local(p.data), holders.get(id(p), [])) for p in sharded])
            )
            params = [p for p in params if not _dt.is_dtensor(p.data)]
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
            spans[base].append((start, start + _nbytes(p), p))
            unique.append(p)
        for lst in spans.values():
            lst.sort(key=lambda s: s[0])
            for (_, a1, pa), (b0, _, pb) in itertools.pairwise(lst):
                if b0 < a1:
                    raise ValueError(
                        f"two parameters (shapes {tuple(pa.shape)} and {tuple(pb.shape)}) overlap in memory "
                        "without being the same view; TrainState cannot give them separate storage"
                    )
        regions = self._new_regions("params", unique)
        for p in unique:
            view = self._place(regions[p.device], p.data)
            p.data = view
            self._param_slots[id(p)] = _Slot(view, regions[p.device])
        by_id = {id(p): p for p in params}
        for pid, target in alias.items():
            slot = self._param_slots[target]
            by_id[pid].data = slot.view
            self._param_slots[pid] = slot

    def _adopt_grads(self, params: list[nn.Parameter]) -> None:
        # One slot per trainable Parameter object: even parameters aliasing the same data are separate
        # autograd leaves with separate gradients.
        # Sharded (DTensor) gradients are made by FSDP's reduce-scatter, not accumulated by autograd: they
        # are adopted when offloaded (see offload()).
        self._adopt_whole("grads", self._mc.grad_storages)
        trainable = [
            p
            for p in params
            if p.requires_grad and not _dt.is_dtensor(p.data) and id(p) not in self._mc.grad_covered
        ]
        regions = self._new_regions("grads", trainable)
        for p in trainable:
            region = regions[p.device]
            view = _empty_like(region, p.data)
            g = p.grad
            if g is not None and g.shape == p.shape and g.dtype == p.dtype and g.layout == torch.strided:
                view.copy_(g)
                p.grad = view
            self._grad_slots[id(p)] = _Slot(view, region)
            self._hooks.append(p.register_post_accumulate_grad_hook(self._after_accumulate))

    def _adopt_buffers(self, model: nn.Module) -> None:
        entries: list[tuple[nn.Module, str, torch.Tensor]] = []
        for m in model.modules():
            for n, b in m._buffers.items():
                if b is not None and type(b) is torch.Tensor and not b.is_meta:
                    entries.append((m, n, b))
        uniq: dict[int, torch.Tensor] = {}
        for _, _, b in entries:
            uniq.setdefault(id(b), b)
        regions = self._new_regions("buffers", uniq.values())
        views: dict[int, _Slot] = {}
        for bid, b in uniq.items():
            views[bid] = _Slot(self._place(regions[b.device], b), regions[b.device])
        for m, n, b in entries:
            slot = views[id(b)]
            m._buffers[n] = slot.view
            self._buffer_slots.append((m, n, slot))

    def adopt_optimizer_states(self) -> int:
        """Adopt optimizer state tensors not adopted yet (new, or replaced by ``load_state_dict``).

        Called after every ``optimizer.step()`` and at every offload; returns the number of tensors adopted.
        """
        if not self._opts or self._closed or self.paused("optimizer"):
            return 0
        self._drain(("optimizer",), host=False)  # states still pointing at the backup are not new ones
        todo: list[tuple[int, str, dict, torch.Tensor]] = []
        sharded: list[tuple[int, str, torch.Tensor]] = []
        live: set[tuple[int, str]] = set()
        for opt, p, st in ((o, p, st) for o in self._opts for p, st in o.state.items()):
            self._opt_of[id(p)] = opt
            pdev = p.device
            for k, v in st.items():
                dt = _dt.is_dtensor(v)
                if (type(v) is not torch.Tensor and not dt) or v.device != pdev:
                    continue  # host scalars of device parameters (Adam's step) stay where they are
                key = (id(p), k)
                live.add(key)
                slot = self._state_slots.get(key)
                if slot is not None and _dt.local(v).data_ptr() == slot.view.data_ptr():
                    continue
                if dt:
                    sharded.append((id(p), k, _dt.local(v)))
                else:
                    todo.append((id(p), k, st, v))
        if sharded:
            before = len(self._repointed)
            self._repoint("optimizer", [[t] for *_, t in sharded])
            for (pid, k, t), (_, region, _, _) in zip(sharded, self._repointed[before:], strict=True):
                self._state_slots[(pid, k)] = _Slot(t, region)
        if todo:
            regions = self._new_regions("optimizer", (v for *_, v in todo))
            for pid, k, st, v in todo:
                region = regions[v.device]
                view = self._place(region, v)
                st[k] = view
                self._state_slots[(pid, k)] = _Slot(view, region)
        # A Region whose every view was replaced (load_state_dict) holds nothing live: give it back.
        for key in [k for k in self._state_slots if k not in live]:
            del self._state_slots[key]
            self._entry_cache.clear()
        used = {id(s.region) for s in self._state_slots.values()}
        used |= {id(r) for c, r, flat, _ in self._repointed if c == "optimizer" and id(flat) in self._whole}
        for region in [r for r in self._regions["optimizer"] if id(r) not in used]:
            self._drop_region("optimizer", region)
        adopted = len(todo) + len(sharded)
        if adopted and any(r.device.type == "cuda" for r in self._regions["optimizer"]):
            torch.cuda.empty_cache()
        return adopted

    def _drop_region(self, category: str, region: Region) -> None:
        self._entry_cache.clear()
        region.close()
        self._regions[category].remove(region)
        self._repointed = [r for r in self._repointed if r[1] is not region]

    def _adopt_sharded_grads(self) -> None:
        """Move FSDP-made gradients into a Region (before offloading them), closing gradient Regions that no
        gradient lives in any more."""
        grads = [_dt.local(p.grad) for p in self._params if _dt.is_dtensor(p) and p.grad is not None]
        inside = {t.data_ptr() for cat, _, _, g in self._repointed if cat == "grads" for t in g}
        self._repoint("grads", _dt.storage_groups([(g, []) for g in grads if g.data_ptr() not in inside]))
        live = {g.data_ptr() for g in grads}
        for cat, region, flat, g in list(self._repointed):
            if cat == "grads" and id(flat) not in self._whole and not any(t.data_ptr() in live for t in g):
                self._drop_region("grads", region)

    # -- hooks ---------------------------------------------------------------------------------------
    def _before_state_dict(self, module: nn.Module, prefix: str, keep_vars: bool) -> None:
        for cat in ("params", "buffers"):
            if self._policy[cat] == "discard":
                raise RuntimeError(
                    f"rlmem TrainState {self.name!r}: state_dict() was called while the {cat} are discarded "
                    f"(offload({cat}='discard')), so there are no values to save until reload() and the "
                    f"caller's own reload of them; offload with {cat}='offload' to keep them readable"
                )

    def _before_forward(self, module: nn.Module, args: Any) -> None:
        if self.paused("params"):
            raise RuntimeError(
                f"rlmem TrainState {self.name!r}: the model was called while its parameters are offloaded "
                f"(params={self._policy['params']!r}); call reload() first, or offload with params='keep' "
                "if the rollout runs on the training model"
            )
        if self.paused("grads") and torch.is_grad_enabled() and (self._grad_slots or self._mc.grad_storages):
            raise RuntimeError(
                f"rlmem TrainState {self.name!r}: the model was called with autograd on while its gradients "
                "are offloaded; run the rollout under torch.no_grad() / torch.inference_mode(), or reload() "
                "first"
            )
        if self.paused("buffers"):
            raise RuntimeError(
                f"rlmem TrainState {self.name!r}: the model was called while its buffers are offloaded; "
                "call reload() first, or offload with buffers='keep'"
            )

    def _after_accumulate(self, p: nn.Parameter) -> None:
        slot = self._grad_slots.get(id(p))
        g = p.grad
        if slot is None or g is None or g.data_ptr() == slot.view.data_ptr():
            return
        if self.paused("grads"):
            raise RuntimeError(
                f"TrainState {self.name!r}: backward produced gradients while they are offloaded; "
                "call reload() before training"
            )
        if g.shape != slot.view.shape or g.dtype != slot.view.dtype or g.layout != torch.strided:
            return  # not a gradient of the parameter's own kind: leave it to PyTorch
        slot.view.copy_(g)
        p.grad = slot.view

    def _before_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        for cat in ("params", "grads", "optimizer"):
            if self.paused(cat):
                raise RuntimeError(
                    f"TrainState {self.name!r}: optimizer.step() was called while {cat} are offloaded; "
                    "call reload() first"
                )
        self._drain(("grads", "optimizer"), host=False)

    def _drain(self, categories: Iterable[str], *, host: bool) -> None:
        """Finish the operations in flight of ``categories``: ordered on the current stream, or with the
        host blocked (``host=True``; a checkpoint must read the states, not memory a reload is filling)."""
        for cat in categories:
            back = bool(self._away[cat]) and not self.paused(cat)
            if back and host:
                # The host waits below before anything can read them: re-point while the copies run.
                self._attach(cat)
            for h in self._pending[cat]:
                h.synchronize() if host else h.wait()
            self._pending[cat] = []
            if back and not host:
                # Stream-ordered: work queued from now on sees the reloaded bytes.
                self._attach(cat)
            if back and cat == "grads" and self._zero_grads_on_return:
                self._zero_returned_grads()

    def _attach(self, cat: str) -> None:
        _holders.attach(self._away[cat])
        self._away[cat] = []

    def _zero_returned_grads(self) -> None:
        """Discarded Megatron grad buffers come back as after ``zero_grad_buffer()``: Megatron's own, on the
        current stream once their memory is mapped (it also resets the buckets and per-parameter flags)."""
        self._zero_grads_on_return = False
        for m in self._mc.owners:
            m.zero_grad_buffer()

    def _zero_standin(self, region: Region) -> None:
        if id(region) in self._standin_dirty:  # it held offloaded gradients: not a zeroed stand-in any more
            backup = region._backup
            assert backup is not None and backup.tensor is not None
            backup.tensor[: region.used_bytes].zero_()
            self._standin_dirty.discard(id(region))

    # -- offload / reload ----------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        """The device of its Regions (of the first, should they span several); the CPU without any."""
        for c in CATEGORIES:
            for r in self._regions[c]:
                return r.device
        return torch.device("cpu")

    def _in_flight(self) -> list[Handle]:
        """Offloads and reloads not waited for yet."""
        return [h for c in CATEGORIES for h in self._pending[c]]

    def paused(self, category: str) -> bool:
        """True while ``category``'s memory is released (offloaded or discarded)."""
        return self._policy[category] != "keep"

    def regions(self, category: str | None = None) -> list[Region]:
        """The Regions of one category (or all of them)."""
        if category is None:
            return [r for c in CATEGORIES for r in self._regions[c]]
        return list(self._regions[category])

    def offload(
        self,
        *,
        params: str = "offload",
        grads: str = "discard",
        optimizer: str = "offload",
        buffers: str = "keep",
        blocking: bool = False,
    ) -> None:
        """Release device memory per category: ``"offload"`` (to pinned host memory), ``"discard"`` or
        ``"keep"``. Categories already offloaded are left as they are.

        While a category is offloaded, the model's and optimizer's references to it (``p.data``, a kept
        ``p.grad``, ``optimizer.state[p][k]``, buffers, FSDP2's shards) point at its bytes in the host
        backup: reading them, ``state_dict()``, ``torch.save`` and ``save_pretrained`` give exactly what
        training resumes from, and writes made meanwhile are what ``reload()`` brings back. On a GPU these
        are tensors of the same device over the pinned backup mapped into its address space (a kernel reads
        them over the link, at PCIe speed); on the host backend, CPU tensors over the backup. Calling the
        model or ``optimizer.step()`` meanwhile is refused with a clear error.

        Args:
            params, grads, optimizer, buffers: the policy of each category. Discarded parameters and
                buffers become placeholders (same device, dtype and shape, no memory; any use of their
                values raises an error naming rlmem) until ``reload()``, which brings them back
                uninitialised (for weights the caller reloads itself; ``state_dict()`` meanwhile is
                refused); discarded
                gradients become None (as after ``zero_grad()``); discarded optimizer states are forgotten
                (``step()`` starts from fresh state, as a new optimizer would).
            blocking: return once the memory is released; otherwise release continues in the background
                (``reload()``, ``synchronize()`` and the next ``offload()`` wait for it). Either way the
                references are re-pointed before the call returns, and on a GPU the current stream is
                ordered after the copies (without blocking the host): work queued on it reads the kept
                bytes, and work that does not touch the state waits for the copies too (run it on another
                stream to overlap it with them).

        Raises:
            ValueError: a policy is not one of "keep", "offload", "discard", or ``params="discard"`` is
                asked for FSDP2 parameters (see :meth:`check_policies`).
            HostOutOfMemoryError: a backup could not be allocated; nothing has been released.
        """
        policies = self.check_policies(params=params, grads=grads, optimizer=optimizer, buffers=buffers)
        check_flag("blocking", blocking)
        self._check_open()
        self._drain(CATEGORIES, host=False)
        self.adopt_optimizer_states()
        t0 = time.perf_counter()
        nbytes = 0
        if policies["grads"] == "discard" and not self.paused("grads"):
            for p in self._params:
                if id(p) in self._grad_slots or _dt.is_dtensor(p):
                    p.grad = None
        if policies["grads"] == "offload" and not self.paused("grads"):
            self._adopt_sharded_grads()
        if policies["optimizer"] == "discard":
            self._forget_optimizer_states()
        if policies["grads"] != "keep" and self._mc.grad_storages:
            # Megatron's optimizers set .grad of the main parameters (or, with FP32Optimizer, of the model's)
            # to views of the grad buffer, remade at every step: drop them as optimizer.zero_grad() does,
            # rather than chase them.
            buffers = {_mc._key(flat) for c, _, flat, _ in self._repointed if c == "grads"}
            for t in (*self._mc.main_params, *self._params):
                if t.grad is not None and _mc._key(t.grad) in buffers:
                    t.grad = None
        moving = [c for c, p in policies.items() if p != "keep" and not self.paused(c)]
        self._refresh_whole(moving, strict=True)
        todo = [
            c
            for c in ("optimizer", "grads", "params", "buffers")
            if policies[c] != "keep"
            and not self.paused(c)
            and not (c == "optimizer" and policies[c] == "discard")
        ]
        for cat in todo:  # every backup first: a host that cannot hold them gets an error before any release
            for region in self._regions[cat]:
                if policies[cat] == "offload" or id(region) in self._standin:
                    region.reserve_backup()
        handles: list[tuple[str, Handle]] = []
        for cat in todo:
            policy = policies[cat]
            if not self._regions[cat]:
                continue
            for region in self._regions[cat]:
                keep = policy == "offload"
                if keep or id(region) in self._standin:
                    # Once the copies are queued: the current stream ordered after them (no host wait), then
                    # every holder re-pointed at the backup while they run, so whatever reads it from now on,
                    # on this stream, reads the kept bytes. Only then may the release begin.
                    # A discarded Megatron grad buffer is not copied: its views, which cannot be placeholders
                    # (bucket and shard views of one storage), read the zeroed backup as a stand-in, as
                    # after zero_grad_buffer(), until reload() brings the buffer back zeroed.
                    entries = self._entries(cat, region, groups=True)
                    away = partial(_backup_view, region, region.device.type == "cuda")
                    if not keep:
                        self._zero_standin(region)
                        self._zero_grads_on_return = True

                    def then(h: Handle, entries: list[Entry] = entries, away: Any = away) -> None:
                        h.wait_copied()
                        _holders.detach(entries, away)

                    h = region._pause(keep, blocking, then)
                    if keep:
                        nbytes += region.used_bytes
                        if id(region) in self._standin:
                            self._standin_dirty.add(id(region))
                else:
                    entries = self._entries(cat, region, groups=False)
                    why = (
                        f"rlmem: TrainState {self.name!r} discarded these {cat} "
                        f"(offload({cat}='discard')); their values are gone until reload() and your own "
                        f"reload of them; offload with {cat}='offload' to keep them readable"
                    )
                    _holders.detach(entries, partial(_holders.placeholder, why))
                    h = region.pause(keep=False, blocking=blocking)
                self._away[cat].extend(entries)
                handles.append((cat, h))
            self._policy[cat] = policy
        if not blocking:
            for cat, h in handles:
                self._pending[cat].append(h)
        self._last.update(offload_s=time.perf_counter() - t0 if blocking else None, offload_bytes=nbytes)

    def check_policies(
        self, *, params: str = "keep", grads: str = "keep", optimizer: str = "keep", buffers: str = "keep"
    ) -> dict[str, str]:
        """Validate an offload request for this model; returns the policies by category.

        ``params="discard"`` is refused for FSDP2 (DTensor) parameters: their sharded storage, which FSDP
        all-gathers from, can be re-pointed only at real memory of the same device (the backup), not at a
        placeholder; offload them instead.

        Raises:
            ValueError: naming the category and what to use instead.
        """
        pol = {
            "params": check_policy("params", params),
            "grads": check_policy("grads", grads),
            "optimizer": check_policy("optimizer", optimizer),
            "buffers": check_policy("buffers", buffers),
        }
        if pol["params"] == "discard" and self._mc.param_storages:
            raise ValueError(
                f"params='discard' is not available for TrainState {self.name!r}: its parameters live in "
                "Megatron-Core's contiguous parameter buffers, whose views cannot be placeholders; use "
                "params='offload' (or 'keep')"
            )
        if pol["optimizer"] == "discard" and self._mc.main_params:
            raise ValueError(
                f"optimizer='discard' is not available for TrainState {self.name!r}: its optimizer holds "
                "Megatron-Core's fp32 main parameters, the weights of record, which cannot be forgotten; "
                "use optimizer='offload' (or 'keep')"
            )
        if pol["params"] == "discard" and any(_dt.is_dtensor(p) for p in self._params):
            raise ValueError(
                f"params='discard' is not available for TrainState {self.name!r}: its parameters are "
                "DTensors (FSDP2), whose sharded storage cannot be a placeholder; use params='offload' "
                "(or 'keep')"
            )
        return pol

    def _entries(self, cat: str, region: Region, *, groups: bool) -> list[Entry]:
        """Every holder of ``region``'s views, one entry per view. ``groups``: include the
        storages re-pointed for DTensors (offload only: they cannot point at a placeholder)."""
        key = (id(region), groups)
        cached = self._entry_cache.get(key)
        if cached is not None:
            return cached
        found: dict[int, Entry] = {}

        def entry(view: torch.Tensor) -> Entry:
            e = found.get(id(view))
            if e is None:
                start, extent = region._byte_span(view)
                e = found[id(view)] = Entry(view, start, start + extent)
            return e

        if cat == "params":
            for p in self._params:
                slot = self._param_slots.get(id(p))
                if slot is not None and slot.region is region:
                    entry(slot.view).holders.append(Holder(lambda p=p: p, partial(_holders.put_param, p)))
        elif cat == "grads":
            for p in self._params:
                slot = self._grad_slots.get(id(p))
                if slot is not None and slot.region is region:
                    entry(slot.view).holders.append(Holder(lambda p=p: p.grad, partial(setattr, p, "grad")))
        elif cat == "buffers":
            for m, n, slot in self._buffer_slots:
                if slot.region is region:
                    entry(slot.view).holders.append(
                        Holder(lambda m=m, n=n: m._buffers.get(n), partial(m._buffers.__setitem__, n))
                    )
        else:
            in_groups = {id(t) for _, _, _, g in self._repointed for t in g}
            for (pid, k), slot in self._state_slots.items():
                p = self._param_by_id.get(pid)
                opt = self._opt_of.get(pid)
                if p is None or opt is None or slot.region is not region or id(slot.view) in in_groups:
                    continue
                entry(slot.view).holders.append(
                    Holder(
                        lambda p=p, k=k, opt=opt: opt.state.get(p, {}).get(k),
                        partial(_put_state, opt, p, k),
                    )
                )
        if groups:
            for c, r, flat, g in self._repointed:
                if c == cat and r is region:
                    entry(flat).holders.append(Holder(None, partial(_repoint_flat, g)))
        out = self._entry_cache[key] = list(found.values())
        return out

    def _forget_optimizer_states(self) -> None:
        # Discarding optimizer states means forgetting them: step() then starts from fresh state, as a new
        # optimizer would, instead of reading uninitialised memory.
        adopted = {pid for pid, _ in self._state_slots}
        for opt in self._opts:
            for p in list(opt.state):
                if id(p) in adopted:
                    del opt.state[p]
        self._state_slots.clear()
        self._entry_cache.clear()
        for region in list(self._regions["optimizer"]):
            self._drop_region("optimizer", region)

    def reload(self, *, blocking: bool = False) -> None:
        """Bring offloaded categories back: parameters first, optimizer states last.

        Every reference that was pointed at the backup (and still is) is pointed back at the same device
        addresses as before the offload, so views and CUDA graphs taken in the train phase stay valid.

        With ``blocking=False`` the copies run on a dedicated stream: the current stream is ordered after
        the parameter, buffer and gradient copies (so a forward queued now starts as soon as the weights are
        in), and ``optimizer.step()`` waits for the optimizer states, and only it. Until then (or until
        ``optimizer.state_dict()`` or :meth:`synchronize`) ``optimizer.state`` keeps pointing at the backup,
        which holds the same values.

        Raises:
            OutOfMemoryError: the device cannot take a category back; categories already back stay back, the
                rest stay offloaded and ``reload()`` can be retried after freeing memory.
        """
        check_flag("blocking", blocking)
        self._check_open()
        self._drain(CATEGORIES, host=False)
        t0 = time.perf_counter()
        nbytes = 0
        try:
            for cat in CATEGORIES:
                if not self.paused(cat):
                    continue
                for region in self._regions[cat]:
                    if region.paused:
                        h = region.resume(blocking=blocking)
                        nbytes += region.stats().last_resume_bytes
                        if not blocking:
                            self._pending[cat].append(h)
                self._policy[cat] = "keep"
        finally:
            # Holders go back once their bytes are ordered (non-blocking: on the current stream).
            self._drain(CATEGORIES if blocking else ("params", "buffers", "grads"), host=False)
        self._last.update(reload_s=time.perf_counter() - t0 if blocking else None, reload_bytes=nbytes)

    def backup_categories(self, policies: dict[str, str]) -> list[str]:
        """The categories whose offload under ``policies`` needs a pinned backup: those offloaded, and
        discarded Megatron gradient buffers (their zeroed stand-in)."""
        return [
            c
            for c, p in policies.items()
            if p == "offload" or (p == "discard" and any(id(r) in self._standin for r in self._regions[c]))
        ]

    def reserve_backups(
        self, categories: Iterable[str] = ("params", "optimizer"), *, blocking: bool = False
    ) -> None:
        """Allocate the pinned backups of ``categories`` now (in the background by default), so that the
        first offload runs at link speed instead of waiting for page-locking."""
        for cat in categories:
            for region in self._regions[cat]:
                region.reserve_backup(blocking=blocking)

    def synchronize(self) -> None:
        """Block until every offload or reload in flight has completed."""
        self._drain(CATEGORIES, host=True)

    # -- stats and teardown --------------------------------------------------------------------------
    def stats(self) -> TrainStateStats:
        """Bytes per category (total, resident, host backup), the current policy, and the last switch."""
        cats = {}
        for cat in CATEGORIES:
            rs = self._regions[cat]
            cats[cat] = CategoryStats(
                bytes=sum(r.used_bytes for r in rs),
                reserved_bytes=sum(r.nbytes for r in rs),
                resident_bytes=sum(r.resident_bytes for r in rs),
                backup_bytes=sum(r.backup_bytes for r in rs),
                policy=self._policy[cat],
                regions=len(rs),
            )
        last = self._last
        rates = {}
        for k in ("offload", "reload"):
            s, b = last[f"{k}_s"], last[f"{k}_bytes"]
            rates[k] = b / s / 1e9 if s and b else None
        return TrainStateStats(
            categories=cats,
            last=SwitchRecord(
                offload_s=last["offload_s"],
                offload_bytes=last["offload_bytes"],
                offload_gbps=rates["offload"],
                reload_s=last["reload_s"],
                reload_bytes=last["reload_bytes"],
                reload_gbps=rates["reload"],
            ),
        )

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"TrainState {self.name!r} is closed")

    def close(self) -> None:
        """Give every tensor back to PyTorch's allocator (reloading first if needed) and remove the hooks.

        The model and optimizer keep working without rlmem afterwards. Idempotent.
        """
        if self._closed:
            return
        self.reload(blocking=True)
        self.synchronize()
        self._refresh_whole(CATEGORIES, strict=False)
        copies: dict[int, torch.Tensor] = {}

        def plain(view: torch.Tensor) -> torch.Tensor:
            if id(view) not in copies:
                copies[id(view)] = view.clone()
            return copies[id(view)]

        for p in self._params:
            slot = self._param_slots.get(id(p))
            if slot is not None:
                p.data = plain(slot.view)
            gslot = self._grad_slots.get(id(p))
            if gslot is not None and p.grad is not None and p.grad.data_ptr() == gslot.view.data_ptr():
                p.grad = plain(gslot.view)
        for m, n, slot in self._buffer_slots:
            m._buffers[n] = plain(slot.view)
        for _, _, flat, group in self._repointed:
            _dt.repoint(group, flat.clone(), src_byte_offset=flat.storage_offset())
        for opt in self._opts:
            for p, st in opt.state.items():
                for k, v in list(st.items()):
                    if _dt.is_dtensor(v):
                        continue  # re-pointed below with its storage group
                    slot = self._state_slots.get((id(p), k))
                    if (
                        slot is not None
                        and isinstance(v, torch.Tensor)
                        and v.data_ptr() == slot.view.data_ptr()
                    ):
                        st[k] = plain(slot.view)
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        for region in self.regions():
            region.close()
        self._closed = True
        self._param_slots.clear()
        self._grad_slots.clear()
        self._state_slots.clear()
        self._buffer_slots.clear()


def _backup_view(region: Region, mapped: bool, e: Entry) -> torch.Tensor:
    return region._backup_view(e.view, e.start, e.end - e.start, mapped)


def _put_state(opt: torch.optim.Optimizer, p: nn.Parameter, key: str, t: torch.Tensor) -> None:
    st = opt.state.get(p)
    if st is not None:
        st[key] = t


def _repoint_flat(group: list[torch.Tensor], flat: torch.Tensor) -> None:
    # The backup mirrors the Region's layout, so the flat starts at the same byte offset in either storage.
    _dt.repoint(group, flat, src_byte_offset=flat.storage_offset())
