"""Tensors over a Region's byte range: sizing what a caller asks for, making the tensor at an offset, and
finding where a given tensor lies.

Owns the geometry between tensors and bytes, which reads nothing that changes: ``empty()``'s argument
checks, the bytes a shape and dtype take, whether they fit the range where asked (``empty()``'s room left,
``view()``'s bounds), a tensor of a given shape and dtype over mapped bytes, and a tensor's (offset, extent)
in the range. Which offset a new tensor gets (the bump of ``used_bytes``) and whether the bytes are mapped
are the Region's, under its lock.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from .backend import Backend

__all__ = ["check_request", "check_room", "check_view", "sized", "span_of", "tensor_over"]


def sized(shape: int | Sequence[int], dtype: torch.dtype) -> tuple[tuple[int, ...], int, int]:
    """(dims, element size, bytes) of a tensor of ``shape`` and ``dtype``; unchecked."""
    dims = (shape,) if isinstance(shape, int) else tuple(shape)
    itemsize = torch.empty((), dtype=dtype).element_size()
    return dims, itemsize, math.prod(dims) * itemsize


def check_request(
    shape: int | Sequence[int], dtype: torch.dtype | None, align: int
) -> tuple[tuple[int, ...], torch.dtype, int, int]:
    """``empty()``'s arguments checked: (dims, dtype, element size, bytes), ``dtype`` defaulted.

    Raises:
        ValueError: bad shape, dtype or align.
    """
    dims = (shape,) if isinstance(shape, int) else tuple(shape)
    if any(not isinstance(d, int) or isinstance(d, bool) or d < 0 for d in dims):
        raise ValueError(f"shape must be an int or a sequence of non-negative ints, got {shape!r}")
    if dtype is None:
        dtype = torch.get_default_dtype()
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"dtype must be a torch.dtype, got {dtype!r}")
    if not isinstance(align, int) or align <= 0 or align & (align - 1):
        raise ValueError(f"align must be a positive power of two, got {align!r}")
    _, itemsize, need = sized(dims, dtype)
    return dims, dtype, itemsize, need


def check_room(
    region: str, dims: tuple[int, ...], dtype: torch.dtype, need: int, offset: int, nbytes: int
) -> None:
    """Check that ``empty(dims, dtype)``, ``need`` bytes at ``offset``, fits the ``nbytes`` of ``region``.

    Raises:
        ValueError: it does not; the message gives the sizes.
    """
    if offset + need > nbytes:
        raise ValueError(
            f"Region {region!r} is out of room: empty({list(dims)}, {dtype}) needs {need} "
            f"bytes at offset {offset}, but only {max(nbytes - offset, 0)} of "
            f"{nbytes} bytes are left"
        )


def check_view(
    region: str, offset: int, shape: int | Sequence[int], dtype: torch.dtype, nbytes: int
) -> tuple[tuple[int, ...], int]:
    """(dims, bytes) of ``view(offset, shape, dtype)`` of the ``nbytes`` of ``region``, checked.

    Raises:
        ValueError: out of the range, or ``offset`` not aligned for ``dtype``.
    """
    dims, itemsize, need = sized(shape, dtype)
    if offset < 0 or offset % itemsize or offset + need > nbytes:
        raise ValueError(
            f"view({offset}, {list(dims)}, {dtype}) does not fit region {region!r} "
            f"({nbytes} bytes) at an offset aligned to {itemsize}"
        )
    return dims, need


def tensor_over(
    backend: Backend, offset: int, need: int, dims: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """A tensor of ``dims`` and ``dtype`` over the ``need`` mapped bytes at ``offset``, with a storage of
    its own; an empty one takes no bytes (a plain empty tensor on ``device``)."""
    if need == 0:
        return torch.empty(dims, dtype=dtype, device=device)
    return backend.tensor_at(offset, need).view(dtype).view(dims)


def span_of(tensor: Any, *, base: int, nbytes: int, device: torch.device, region: str) -> tuple[int, int]:
    """(offset from ``base``, bytes spanned) of ``tensor``, a tensor over the ``nbytes`` at ``base`` on
    ``device`` (the Region named ``region``).

    Raises:
        ValueError: ``tensor`` is not a tensor over that range.
    """
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"tensor must be a torch.Tensor over region {region!r}, got {type(tensor).__name__}")
    extent = 0
    if tensor.numel():
        last = sum((n - 1) * st for n, st in zip(tensor.shape, tensor.stride(), strict=True))
        extent = (last + 1) * tensor.element_size()
    off = tensor.data_ptr() - base
    if extent == 0 and tensor.device == device:
        return 0, 0  # no bytes: nothing to keep or to read
    if tensor.device != device or off < 0 or off + extent > nbytes:
        raise ValueError(
            f"tensor (shape {tuple(tensor.shape)}, {tensor.dtype}, on {tensor.device}) does not lie in "
            f"region {region!r} ({nbytes} bytes on {device})"
        )
    return off, extent
