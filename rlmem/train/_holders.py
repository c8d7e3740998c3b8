"""Who refers to a tensor adopted into a Region, and pointing them elsewhere while the Region is paused.

A :class:`~rlmem.TrainState` category lives in Regions, and the model and optimizer refer to its tensors
through *holders*: ``p.data``, ``p.grad``, ``optimizer.state[p][k]``, ``module._buffers[name]``, and the
tensors FSDP2 keeps over a sharded storage. While a Region is paused its memory is released, so before that
memory goes every holder is pointed *away*: at the tensor's bytes in the host backup (offload) or at a
placeholder (discard). After the Region is resumed they are pointed back at the same Region views, so
addresses never change across a cycle. A holder that something else has re-bound meanwhile (``zero_grad()``
setting ``p.grad`` to None, ``optimizer.load_state_dict`` replacing a state) is left as it is.

A placeholder keeps the device, dtype and shape (PyTorch refuses to give a parameter's data another kind of
tensor, and a parameter whose data changes device gets a new gradient accumulator, which DDP's hooks are not
on), holds no memory (one poisoned element, stride 0), and raises an error naming rlmem on any use of its
values. A discarded *parameter* object cannot be replaced, so its class is switched to one that raises the
same error until it is reloaded.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

__all__ = ["Holder", "ViewHolders", "attach", "detach", "placeholder", "points_at", "put_param"]


class Holder:
    """One reference to a Region view: ``get()`` returns what it refers to now (None: re-point it without
    asking), ``put(t)`` makes it refer to ``t``."""

    __slots__ = ("get", "put")

    def __init__(self, get: Callable[[], object] | None, put: Callable[[torch.Tensor], None]) -> None:
        self.get = get
        self.put = put


class ViewHolders:
    """A Region view (bytes ``start`` to ``end`` of its Region), its holders, and where they point while the
    Region is paused (``away``; None while they point at the view)."""

    __slots__ = ("away", "end", "holders", "start", "view")

    def __init__(self, view: torch.Tensor, start: int, end: int) -> None:
        self.view = view
        self.start = start
        self.end = end
        self.holders: list[Holder] = []
        self.away: torch.Tensor | None = None


def points_at(cur: object, t: torch.Tensor) -> bool:
    return cur is t or (
        isinstance(cur, torch.Tensor)
        and cur.device == t.device
        and cur.dtype == t.dtype
        and cur.shape == t.shape
        and cur.data_ptr() == t.data_ptr()
    )


def detach(entries: list[ViewHolders], away: Callable[[ViewHolders], torch.Tensor]) -> None:
    """Point the holders of every entry still at its view at ``away(entry)``."""
    for e in entries:
        if e.away is not None:
            continue
        target = away(e)
        for h in e.holders:
            if h.get is None or points_at(h.get(), e.view):
                h.put(target)
        e.away = target


def attach(entries: list[ViewHolders]) -> None:
    """Point every holder still referring to where it was sent back at its Region view."""
    for e in entries:
        target = e.away
        if target is None:
            continue
        for h in e.holders:
            if h.get is None or points_at(h.get(), target):
                h.put(e.view)
        e.away = None


# What a placeholder answers; everything else about it is an error. Descriptors are matched by name (a
# property's getter arrives as its ``__get__``).
_GET = frozenset(
    [
        "shape",
        "dtype",
        "device",
        "requires_grad",
        "grad",
        "is_leaf",
        "grad_fn",
        "_is_param",
        "is_meta",
        "ndim",
        "layout",
        "is_cuda",
        "is_sparse",
        "is_quantized",
        "_post_accumulate_grad_hooks",
        "_backward_hooks",
    ]
)
_SET = frozenset({"data", "grad"})
_CALL = frozenset({"data_ptr", "size", "stride", "dim", "numel", "element_size", "__hash__"})


class _Discarded:
    """Mixin of placeholder classes: any use of the values raises ``RuntimeError`` with ``_rlmem_why``."""

    _rlmem_why = "rlmem: this tensor's memory was given back"

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = getattr(func, "__name__", "")
        owner = getattr(func, "__self__", None)
        if name in ("__get__", "__set__") and owner is not None:
            allowed = (_GET if name == "__get__" else _SET).__contains__(getattr(owner, "__name__", ""))
        else:
            allowed = name in _CALL
        if allowed:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        why = next((a._rlmem_why for a in args if isinstance(a, _Discarded)), cls._rlmem_why)
        raise RuntimeError(f"{why} (used by {getattr(owner, '__name__', name) or func!r})")

    def __repr__(self) -> str:
        return f"<placeholder {tuple(self.shape)} {self.dtype} on {self.device}: {self._rlmem_why}>"

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise RuntimeError(f"{self._rlmem_why} (pickled)")

    def __deepcopy__(self, memo: Any) -> Any:
        raise RuntimeError(f"{self._rlmem_why} (deep-copied)")


class _Placeholder(_Discarded, torch.Tensor):
    pass


_classes: dict[type, type] = {}
_poison: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def _discarded_class(cls: type) -> type:
    made = _classes.get(cls)
    if made is None:
        made = _classes[cls] = type(f"Discarded{cls.__name__}", (_Discarded, cls), {"_rlmem_base": cls})
    return made


def _poisoned(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """One element per device and dtype, NaN (or the largest value) so that nothing reads as zeros."""
    key = (device, dtype)
    t = _poison.get(key)
    if t is None:
        if dtype.is_floating_point or dtype.is_complex:
            fill: Any = float("nan")
        elif dtype == torch.bool:
            fill = True
        else:
            fill = torch.iinfo(dtype).max
        t = _poison[key] = torch.full((1,), fill, dtype=dtype, device=device)
    return t


def placeholder(why: str, e: ViewHolders) -> torch.Tensor:
    """A tensor of the view's device, dtype and shape that holds no memory and raises ``RuntimeError(why)``
    on any use of its values."""
    v = e.view
    t = torch.Tensor._make_subclass(_Placeholder, _poisoned(v.device, v.dtype).expand(v.shape))
    t._rlmem_why = why
    return t


def put_param(p: nn.Parameter, t: torch.Tensor) -> None:
    """``p.data = t``; a placeholder also switches ``p``'s class so that using ``p`` raises its error, and the
    next real tensor switches it back."""
    if isinstance(t, _Discarded):
        p.data = t
        p._rlmem_why = t._rlmem_why  # type: ignore[attr-defined]
        p.__class__ = _discarded_class(type(p))
        return
    cls = type(p)
    if issubclass(cls, _Discarded):
        p.__class__ = cls._rlmem_base  # type: ignore[attr-defined]
        del p._rlmem_why  # type: ignore[attr-defined]
    p.data = t
