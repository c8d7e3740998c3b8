"""What :meth:`TrainState.stats` returns: bytes per category and the last switch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .._results import Result
from ..memory.region import Region

__all__ = ["CategoryStats", "SwitchRecord", "TrainStateStats", "collect"]


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


def collect(
    regions: dict[str, list[Region]], policy: dict[str, str], last: dict[str, Any]
) -> TrainStateStats:
    """The stats of Regions by category under ``policy``, with the ``last`` offload and reload."""
    cats = {}
    for cat, rs in regions.items():
        cats[cat] = CategoryStats(
            bytes=sum(r.used_bytes for r in rs),
            reserved_bytes=sum(r.nbytes for r in rs),
            resident_bytes=sum(r.resident_bytes for r in rs),
            backup_bytes=sum(r.backup_bytes for r in rs),
            policy=policy[cat],
            regions=len(rs),
        )
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
