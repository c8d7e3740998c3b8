"""FSDP1 (``FullyShardedDataParallel``) state in a TrainState: each unit's sharded ``FlatParameter``.

Between steps a FlatParameter's data is its local shard: ``flat_param.data`` and ``flat_param._local_shard``
are two tensor objects over one storage, and FSDP rebinds the first to the second at every reshard. With
``use_orig_params=True`` the original parameters (what the optimizer sees) are views of that storage too,
remade over it by FSDP after each forward and backward, and their gradients are views of the flat
parameter's gradient. So the shard's storage is adopted whole, as FSDP2's are: every tensor object over it
re-pointed at a Region copy (the same objects, new memory), which keeps the views FSDP makes afterwards in
the Region as well. Gradients (made by FSDP's reduce-scatter, replaced after ``zero_grad()``) are adopted the
same way when they are offloaded; optimizer states are ordinary ``optimizer.state`` entries, keyed by the
flat parameters or by the original ones, for the plain source.

Mixed precision (``MixedPrecision(param_dtype=...)``) is adopted as it is: FSDP all-gathers from a
low-precision copy of the shard (``_mp_shard``) that it makes from the full-precision shard at every forward
and frees right after the all-gather, from PyTorch's allocator, so between steps the shard is all there is.
Layouts whose shard FSDP keeps elsewhere (CPU offload, hybrid and unsharded strategies, a unit caught
unsharded) are refused at adoption, naming them.
"""

from __future__ import annotations

from itertools import chain
from typing import Any

import torch
from torch import nn

from ._adopted import Group
from ._megatron import others, storage_key, tensors_over
from ._source import Source

__all__ = ["FlatParamSource", "flat_handles"]

# The strategies whose FlatParameter holds this rank's shard of one process group between steps.
_SHARDED = ("FULL_SHARD", "SHARD_GRAD_OP")


def flat_handles(root: nn.Module) -> list[Any]:
    """The ``FlatParamHandle`` of every FSDP1 unit in ``root`` (units without parameters have none)."""
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:  # pragma: no cover
        return []
    out = []
    for m in root.modules():
        if isinstance(m, FullyShardedDataParallel):
            h = getattr(m, "_handle", None)
            if h is not None and all(h is not o for o in out):
                out.append(h)
    return out


def _refusal(handle: Any) -> str | None:
    """Why a unit's layout cannot be adopted, or None."""
    fp = handle.flat_param
    strategy = getattr(handle._sharding_strategy, "name", str(handle._sharding_strategy))
    if handle._offload_params:
        return (
            "CPU offload (cpu_offload=CPUOffload(offload_params=True)): FSDP keeps the shard in its own "
            "pinned host memory and copies it in at every forward"
        )
    mp = getattr(fp, "_mp_shard", None) if handle._uses_param_mixed_precision else None
    if isinstance(mp, torch.Tensor) and mp.untyped_storage().size() != 0:
        # FSDP remakes the low-precision copy of the shard it all-gathers from at every forward and frees it
        # after the all-gather; held now, it is a unit caught inside forward or backward.
        return (
            "a unit holding its param_dtype copy of the shard (inside forward or backward); adopt it "
            "between steps"
        )
    if strategy not in _SHARDED:
        return (
            f"sharding_strategy={strategy}: only {' and '.join(_SHARDED)} are adopted (hybrid strategies "
            "and NO_SHARD are not)"
        )
    # Before the first forward FSDP has not made ``_local_shard`` yet; it will take ``flat_param.data``.
    local = getattr(fp, "_local_shard", None)
    if not handle.is_sharded(fp) or (
        isinstance(local, torch.Tensor) and storage_key(local) != storage_key(fp)
    ):
        return "a unit that is not sharded now (inside forward or backward); adopt it between steps"
    return None


class FlatParamSource(Source):
    """FSDP1's sharded FlatParameters (every tensor over their storage re-pointed, the original parameters
    of ``use_orig_params=True`` included) and their gradients, when offloaded.

    Raises:
        ValueError: at construction, before anything is adopted, for an FSDP1 layout named in the message
            that cannot be adopted.
        RuntimeError: this PyTorch's FSDP1 is not laid out as this version of rlmem expects.
    """

    def __init__(self, kit: Any, root: nn.Module, *rest: Any) -> None:
        super().__init__(kit, root, *rest)
        self._handles = flat_handles(root)
        for h in self._handles:
            try:
                why = _refusal(h)
            except AttributeError as e:
                raise RuntimeError(
                    f"TrainState cannot find FSDP1's flat parameter layout in this PyTorch "
                    f"({torch.__version__}): {e}"
                ) from e
            if why is not None:
                raise ValueError(
                    f"TrainState {kit.name!r} cannot adopt this FullyShardedDataParallel model: {why}. "
                    "Use FULL_SHARD or SHARD_GRAD_OP without CPU offload, or FSDP2 "
                    "(fully_shard)"
                )
        self._flats = [h.flat_param for h in self._handles]
        self._origs = [
            p for fp in self._flats for p in chain(fp._params or (), fp._shared_params or ())
        ]  # empty with use_orig_params=False
        self._claimed = {id(t) for t in chain(self._flats, self._origs)}
        self._params: list[Group] = []
        self._grads: list[Group] = []

    def accepts(self, p: nn.Parameter) -> bool:
        return id(p) in self._claimed

    def adopt_params(self, params: list[nn.Parameter]) -> list[nn.Parameter]:
        if self._flats:
            self._params = self.kit.repoint("params", tensors_over(self._flats))
        return [p for p in params if id(p) not in self._claimed]

    def adopt_grads(self, params: list[nn.Parameter]) -> list[nn.Parameter]:
        return [p for p in params if id(p) not in self._claimed]  # FSDP's are adopted when offloaded

    def check(self, policies: dict[str, str]) -> None:
        if policies["params"] == "discard" and self._flats:
            raise ValueError(
                f"params='discard' is not available for TrainState {self.kit.name!r}: its parameters are "
                "FSDP1 FlatParameters, whose sharded storage cannot be a placeholder; use params='offload' "
                "(or 'keep')"
            )

    def before_offload(self, policies: dict[str, str], moving: list[str]) -> None:
        if "params" in moving:
            self._refresh(self._params)
        if "grads" not in moving or not self._flats:
            return
        if policies["grads"] == "discard":
            for t in chain(self._flats, self._origs):
                t.grad = None
        else:
            self._adopt_grads()

    def before_close(self) -> None:
        self._refresh(self._params)
        self._refresh([g for g in self._grads if not g.region.closed])

    def _refresh(self, groups: list[Group]) -> None:
        """Every tensor over each group's storage, views FSDP made since adoption included."""
        if groups:
            for g, found in zip(groups, tensors_over([g.flat for g in groups]), strict=True):
                g.tensors[:] = others(found, g.flat)

    def _adopt_grads(self) -> None:
        """Move the sharded gradients FSDP made into a Region (before offloading them), every tensor over
        them (the original parameters' gradient views) re-pointed, and give back the gradient Regions no
        gradient lives in any more."""
        grads = [fp.grad for fp in self._flats if fp.grad is not None]
        inside = {storage_key(t) for g in self._grads if not g.region.closed for t in g.tensors}
        new = [g for g in grads if storage_key(g) not in inside]
        self._grads += self.kit.repoint("grads", tensors_over(new)) if new else []
        self._refresh([g for g in self._grads if not g.region.closed])
        live = {storage_key(g) for g in grads}
        dead = {id(g.region): g.region for g in self._grads}
        for g in self._grads:
            if any(storage_key(t) in live for t in g.tensors):
                dead.pop(id(g.region), None)
        for region in dead.values():
            self.kit.drop("grads", region)
        self._grads = [g for g in self._grads if not g.region.closed]
