"""torch's ``DTensor`` (FSDP2's and tensor parallelism's parameters), None in builds without
``torch.distributed``: one test of "is this a DTensor" for the train state and the sampler, and a
parameter gathered whole for a copy of the weights."""

from __future__ import annotations

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover - builds without torch.distributed
    DTensor = None  # type: ignore[assignment,misc]

import torch

__all__ = ["DTensor", "full", "is_dtensor"]


def is_dtensor(t: object) -> bool:
    """Whether ``t`` is a DTensor."""
    return DTensor is not None and isinstance(t, DTensor)


def full(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` whole, for a copy in ``dtype``: a DTensor is gathered (a collective: every rank calls it
    together), cast first where ``dtype`` is narrower, so the gather moves half the bytes of an fp32 shard
    for a bf16 copy. The cast is elementwise, so the copy is bit for bit the one cast after the gather."""
    if not is_dtensor(t):
        return t
    with torch.no_grad():
        if t.dtype.is_floating_point and dtype.is_floating_point and dtype.itemsize < t.dtype.itemsize:
            t = t.to(dtype)
        return t.full_tensor()
