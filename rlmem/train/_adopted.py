"""What a :class:`~rlmem.TrainState` has adopted: its Regions by category, one record per adopted tensor or
storage, and the mechanics every stack shares to put tensors there.

Two kinds of record, each knowing its holders and how to give its tensor back to PyTorch:

* a :class:`Slot`: a tensor copied into a Region view whose holders (``p.data``, ``p.grad``,
  ``optimizer.state[p][k]``, ``module._buffers[name]``) were rebound to the view;
* a :class:`Group`: a storage adopted whole, every tensor object over it re-pointed (``Tensor.set_``) at a
  uint8 range of a Region: the same objects, new memory, fixed addresses. FSDP2's shards, DTensor optimizer
  states and Megatron-Core's buffers are held by objects rlmem cannot rebind, so they are re-pointed.

:class:`Adopted` is what the stacks' sources (``_plain.py``, ``_dtensor.py``, ``_megatron.py``) adopt
through, and what ``TrainState`` offloads, reloads and closes, category by category, without knowing which
stack made a record.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable
from functools import partial
from typing import Any

import torch
from torch import nn

from .._units import round_up
from ..memory.region import Handle, Region
from . import _holders
from ._holders import Holder, ViewHolders, points_at

__all__ = [
    "ALIGN",
    "CATEGORIES",
    "Adopted",
    "Group",
    "Slot",
    "copy_storage",
    "empty_like",
    "repoint",
    "storage_bytes",
    "storage_groups",
]

CATEGORIES = ("params", "buffers", "grads", "optimizer")  # also the reload order
ALIGN = 256


def nbytes(t: torch.Tensor) -> int:
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


def empty_like(region: Region, t: torch.Tensor) -> torch.Tensor:
    """A view in ``region`` shaped like ``t``, with ``t``'s strides when they are dense (so layout-sensitive
    kernels, and the gradients autograd lays out like their parameter, round exactly as before), else
    contiguous."""
    if t.is_contiguous() or not _dense_strides(t):
        return region.empty(t.shape, t.dtype, align=ALIGN)
    flat = region.empty(t.numel(), t.dtype, align=ALIGN)
    return flat.as_strided(t.shape, t.stride())


# -- re-pointing whole storages -------------------------------------------------------------------------


def storage_bytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()


def repoint(tensors: list[torch.Tensor], flat: torch.Tensor, src_byte_offset: int = 0) -> None:
    """Point every tensor in ``tensors`` (all over one storage) at ``flat``, a uint8 copy of that storage
    (which starts ``src_byte_offset`` bytes into the tensors' current storage), keeping each one's offset
    within it, size and stride."""
    base = flat.untyped_storage()
    byte_offset = flat.storage_offset()
    with torch.no_grad():
        for t in tensors:
            es = t.element_size()
            assert byte_offset % es == 0 and src_byte_offset % es == 0
            rel = t.storage_offset() - src_byte_offset // es
            if isinstance(t, nn.Parameter):
                # set_() on a leaf gives it a new gradient accumulator, and the hooks DDP (Megatron's too)
                # put on the old one would stop firing; assigning .data keeps it.
                t.data = torch.empty(0, dtype=t.dtype, device=t.device).set_(
                    base, byte_offset // es + rel, t.size(), t.stride()
                )
            else:
                t.set_(base, byte_offset // es + rel, t.size(), t.stride())


def copy_storage(src: torch.Tensor, flat: torch.Tensor) -> None:
    """Copy the whole storage under ``src`` into the uint8 tensor ``flat``."""
    whole = torch.empty(0, dtype=torch.uint8, device=src.device).set_(src.untyped_storage())
    flat.copy_(whole)


def storage_groups(tensors: list[tuple[torch.Tensor, list[torch.Tensor]]]) -> list[list[torch.Tensor]]:
    """Group (tensor, extra holders) pairs by the storage they live in, each group listing every tensor
    object to re-point (shared storages are adopted once)."""
    groups: dict[int, list[torch.Tensor]] = {}
    for t, extra in tensors:
        key = t.untyped_storage().data_ptr()
        lst = groups.setdefault(key, [])
        for x in [t, *extra]:
            if all(x is not y for y in lst):
                lst.append(x)
    return list(groups.values())


def _repoint_at(group: list[torch.Tensor], flat: torch.Tensor) -> None:
    # The backup mirrors the Region's layout, so the flat starts at the same byte offset in either storage.
    repoint(group, flat, src_byte_offset=flat.storage_offset())


# -- records --------------------------------------------------------------------------------------------


class Slot:
    """A tensor copied into ``view`` (in ``region``) and the holders rebound to it; several holders may
    share one view (tied parameters, a buffer of two modules). A discarded slot's holders point at a
    placeholder."""

    __slots__ = ("holders", "region", "view")

    def __init__(self, region: Region, view: torch.Tensor, holders: Iterable[Holder] = ()) -> None:
        self.region = region
        self.view = view
        self.holders = list(holders)

    def restore(self, plain: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Give every holder still at the view a plain tensor with its bytes."""
        for h in self.holders:
            if h.get is None or points_at(h.get(), self.view):
                h.put(plain(self.view))


class Group:
    """A storage adopted whole: ``tensors`` (every tensor object over it) re-pointed at ``flat``, a uint8
    range of ``region``. ``zeroed_on_discard``: its views cannot be placeholders, so a discard points them at
    a zeroed backup instead (Megatron's grad buffers, as after ``zero_grad_buffer()``); ``dirty`` then says
    the backup holds offloaded bytes that must be zeroed first. Otherwise a discarded group is not
    re-pointed (its holders are dropped by the stack that made it)."""

    __slots__ = ("dirty", "flat", "region", "tensors", "zeroed_on_discard")

    def __init__(
        self, region: Region, flat: torch.Tensor, tensors: list[torch.Tensor], zeroed_on_discard: bool
    ) -> None:
        self.region = region
        self.flat = flat
        self.tensors = tensors
        self.zeroed_on_discard = zeroed_on_discard
        self.dirty = False

    def restore(self, plain: Callable[[torch.Tensor], torch.Tensor]) -> None:
        repoint(self.tensors, self.flat.clone(), src_byte_offset=self.flat.storage_offset())


Record = Slot | Group


class Adopted:
    """The Regions of one TrainState by category, the records in each Region, and optimizer states by key
    ``(id(param), name)``.

    Args:
        name: the TrainState's label (Region names, errors).
        paused: ``paused(category)``: whether a category's memory is released now (sources' hooks ask).
    """

    def __init__(self, name: str, paused: Callable[[str], bool]) -> None:
        self.name = name
        self.paused = paused
        self.regions: dict[str, list[Region]] = {c: [] for c in CATEGORIES}
        self.hooks: list[Any] = []  # removed by close()
        self.states: dict[tuple[int, str], tuple[Record, int]] = {}  # key -> (record, adopted address)
        self._in: dict[int, list[Record]] = {}  # id(region) -> its records
        self._entries: dict[tuple[int, bool], list[ViewHolders]] = {}

    # -- making records ------------------------------------------------------------------------------
    def new_regions(
        self, category: str, sizes_in: Iterable[tuple[torch.device, int]]
    ) -> dict[torch.device, Region]:
        """One new Region of ``category`` per device, sized for the (device, bytes) pairs given."""
        sizes: dict[torch.device, int] = defaultdict(int)
        for dev, n in sizes_in:
            sizes[dev] += round_up(max(n, 1), ALIGN)
        out = {}
        for dev, size in sizes.items():
            region = Region(size, dev, name=f"{self.name}/{category}/{dev}")
            self.regions[category].append(region)
            self._in[id(region)] = []
            out[dev] = region
        return out

    def place(self, category: str, tensors: list[torch.Tensor]) -> list[Slot]:
        """A Slot per tensor (no holders yet): a copy of it in a new Region of ``category``."""
        regions = self.new_regions(category, ((t.device, nbytes(t)) for t in tensors))
        out = []
        for t in tensors:
            view = empty_like(regions[t.device], t)
            view.copy_(t)
            out.append(self.add(Slot(regions[t.device], view)))
        return out

    def repoint(
        self, category: str, groups: list[list[torch.Tensor]], *, zeroed_on_discard: bool = False
    ) -> list[Group]:
        """Copy each group's storage into a new Region of ``category`` and re-point the group's tensors."""
        if not groups:
            return []
        regions = self.new_regions(category, ((g[0].device, storage_bytes(g[0])) for g in groups))
        out = []
        for g in groups:
            region = regions[g[0].device]
            flat = region.empty(storage_bytes(g[0]), torch.uint8, align=ALIGN)
            copy_storage(g[0], flat)
            repoint(g, flat)
            out.append(self.add(Group(region, flat, g, zeroed_on_discard)))
        return out

    def add(self, record: Record) -> Any:
        self._in[id(record.region)].append(record)
        self._entries.clear()
        return record

    def set_state(self, key: tuple[int, str], record: Record, address: int) -> None:
        """``record`` holds the optimizer state ``key``, adopted at ``address``; a record it replaces goes."""
        old = self.states.get(key)
        if old is not None:
            self.remove(old[0])
        self.states[key] = (record, address)

    def forget_state(self, key: tuple[int, str]) -> None:
        record, _ = self.states.pop(key)
        self.remove(record)

    # -- reading records -----------------------------------------------------------------------------
    def records(self, category: str) -> list[Record]:
        return [rec for r in self.regions[category] for rec in self._in[id(r)]]

    def in_region(self, region: Region) -> list[Record]:
        return list(self._in.get(id(region), ()))

    def entries(self, region: Region, *, groups: bool) -> list[ViewHolders]:
        """Every holder of ``region``'s views, one entry per view. ``groups``: include the storages adopted
        whole (offload, or a zeroed discard: they cannot point at a placeholder)."""
        key = (id(region), groups)
        cached = self._entries.get(key)
        if cached is not None:
            return cached
        found: dict[int, ViewHolders] = {}

        def entry(view: torch.Tensor) -> ViewHolders:
            e = found.get(id(view))
            if e is None:
                start, extent = region.span(view)
                e = found[id(view)] = ViewHolders(view, start, start + extent)
            return e

        for rec in self._in[id(region)]:
            if isinstance(rec, Slot):
                entry(rec.view).holders.extend(rec.holders)
            elif groups:
                entry(rec.flat).holders.append(Holder(None, partial(_repoint_at, rec.tensors)))
        out = self._entries[key] = list(found.values())
        return out

    # -- removing ------------------------------------------------------------------------------------
    def remove(self, record: Record) -> None:
        recs = self._in.get(id(record.region))
        if recs is not None and any(r is record for r in recs):
            recs[:] = [r for r in recs if r is not record]
            self._entries.clear()

    def drop(self, category: str, region: Region) -> None:
        """Close ``region`` and forget it and its records."""
        self._entries.clear()
        region.close()
        self.regions[category].remove(region)
        self._in.pop(id(region), None)
        for key in [k for k, (rec, _) in self.states.items() if rec.region is region]:
            del self.states[key]

    def drop_empty(self, category: str) -> None:
        """Give back the Regions of ``category`` that no record lives in any more."""
        for region in [r for r in self.regions[category] if not self._in[id(r)]]:
            self.drop(category, region)

    def forget_states(self, optimizers: list[torch.optim.Optimizer]) -> None:
        """Forget every adopted optimizer state (``optimizer='discard'``) and give their Regions back."""
        # Discarding optimizer states means forgetting them: step() then starts from fresh state, as a new
        # optimizer would, instead of reading uninitialised memory.
        adopted = {pid for pid, _ in self.states}
        for opt in optimizers:
            for p in list(opt.state):
                if id(p) in adopted:
                    del opt.state[p]
        for region in list(self.regions["optimizer"]):
            self.drop("optimizer", region)

    def zeroed(self, region: Region) -> list[Group]:
        """The groups of ``region`` whose discard points their holders at a zeroed backup."""
        return [g for g in self.in_region(region) if isinstance(g, Group) and g.zeroed_on_discard]

    def release(
        self, cat: str, region: Region, policy: str, blocking: bool
    ) -> tuple[Handle, list[ViewHolders]]:
        """Pause ``region`` per ``policy``, every holder of its views pointed away first; returns the pause
        and the holders pointed away."""
        keep = policy == "offload"
        zeroed = self.zeroed(region)
        if not keep and not zeroed:
            entries = self.entries(region, groups=False)
            why = (
                f"rlmem: TrainState {self.name!r} discarded these {cat} (offload({cat}='discard')); their "
                f"values are gone until reload() and your own reload of them; offload with {cat}='offload' "
                "to keep them readable"
            )
            _holders.detach(entries, partial(_holders.placeholder, why))
            return region.pause(keep=False, blocking=blocking), entries
        # Once the copies are queued: the current stream ordered after them (no host wait), then every
        # holder re-pointed at the backup while they run, so whatever reads it from now on, on this stream,
        # reads the kept bytes. Only then may the release begin. A zeroed discard copies nothing: its holders
        # read the zeroed backup until reload() brings the memory back.
        entries = self.entries(region, groups=True)
        mapped = region.device.type == "cuda"
        for g in zeroed:
            if not keep and g.dirty:  # it held offloaded bytes: not a zeroed stand-in any more
                region.backup_view(g.flat).zero_()
            g.dirty = keep

        def away(e: ViewHolders) -> torch.Tensor:
            return region.backup_view(e.view, mapped=mapped, span=(e.start, e.end - e.start))

        def on_queued(h: Handle) -> None:
            h.wait_copied()
            _holders.detach(entries, away)

        return region.pause(keep=keep, blocking=blocking, on_queued=on_queued), entries

    def restore(self) -> None:
        """Give every adopted tensor back to PyTorch's allocator: holders at their views get plain copies
        (one per view, shared by its holders), groups are re-pointed at copies of their storage."""
        copies: dict[int, torch.Tensor] = {}

        def plain(view: torch.Tensor) -> torch.Tensor:
            if id(view) not in copies:
                copies[id(view)] = view.clone()
            return copies[id(view)]

        for c in CATEGORIES:
            for rec in self.records(c):
                rec.restore(plain)
