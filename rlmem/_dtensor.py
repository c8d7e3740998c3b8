"""torch's ``DTensor`` (FSDP2's and tensor parallelism's parameters), None in builds without
``torch.distributed``: one test of "is this a DTensor" for the train state and the sampler."""

from __future__ import annotations

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover - builds without torch.distributed
    DTensor = None  # type: ignore[assignment,misc]

__all__ = ["DTensor", "is_dtensor"]


def is_dtensor(t: object) -> bool:
    """Whether ``t`` is a DTensor."""
    return DTensor is not None and isinstance(t, DTensor)
