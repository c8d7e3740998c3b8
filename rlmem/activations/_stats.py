"""The figures of the activation offloader: the counters one step keeps (:data:`STEP_FIELDS`, a fresh set
from :func:`new_step`), and what :meth:`ActivationOffloader.stats` returns of them, the last step's
:class:`ActivationStats` with its :class:`ActivationTotals` over all steps."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .._results import Result

__all__ = ["STEP_FIELDS", "ActivationStats", "ActivationTotals", "new_step"]

STEP_FIELDS = (
    "offloaded_bytes",
    "offloaded_tensors",
    "dedup_hits",
    "kept_small",
    "kept_ineligible",
    "reloaded_bytes",
    "reloaded_prefetched",
    "reloaded_on_demand",
    "served_resident",
    "deferred_scopes",
    "copying_at_backward_bytes",
    "held_elsewhere_bytes",
    "allocated_at_backward",
    "pool_bytes",
    "pool_peak_bytes",
)


@dataclass(frozen=True)
class ActivationTotals(Result):
    """Over every step so far: steps, bytes offloaded, bytes reloaded."""

    steps: int
    offloaded_bytes: int
    reloaded_bytes: int


@dataclass(frozen=True)
class ActivationStats(Result):
    """What :meth:`ActivationOffloader.stats` returns: figures of the last step, and totals.

    Attributes:
        offloaded_bytes, offloaded_tensors: storages copied to host memory (each storage once).
        by_name: offloaded bytes per module name.
        dedup_hits: saved tensors that shared a storage already offloaded.
        kept_small, kept_ineligible: saved tensors left on the device (under ``min_bytes``; parameters,
            inputs, casts of parameters, subclasses).
        reloaded_bytes: bytes copied back; ``reloaded_prefetched`` / ``reloaded_on_demand`` storages
            reloaded one layer ahead / when first needed; ``served_resident`` storages whose copy had not
            completed and were used from the device.
        deferred_scopes: scopes left to another saved-tensor mechanism (torch checkpoint, ``save_on_cpu``).
        copying_at_backward_bytes: offloaded bytes whose copy had not completed when backward began (served
            from the device, as are the last layers' tensors, whose copies completed but which the forward
            pass does not free); held_elsewhere_bytes: released by rlmem but referenced elsewhere (offloading
            them freed nothing); allocated_at_backward: device bytes allocated then.
        pool_bytes, pool_peak_bytes: host pool held, and used at most.
        totals: over all steps.
        plan: the budget mode's chosen layers per name, once it has chosen.
    """

    offloaded_bytes: int
    offloaded_tensors: int
    by_name: dict[str, int]
    dedup_hits: int
    kept_small: int
    kept_ineligible: int
    reloaded_bytes: int
    reloaded_prefetched: int
    reloaded_on_demand: int
    served_resident: int
    deferred_scopes: int
    copying_at_backward_bytes: int
    held_elsewhere_bytes: int
    allocated_at_backward: int
    pool_bytes: int
    pool_peak_bytes: int
    totals: ActivationTotals
    plan: dict[str, list[int]] | None


def new_step() -> dict[str, Any]:
    """A step's counters, all zero, and its bytes per module name."""
    step: dict[str, Any] = dict.fromkeys(STEP_FIELDS, 0)
    step["by_name"] = {}
    return step
