"""DTensor (FSDP2, tensor-parallel) state in a TrainState, adopted by re-pointing the tensors that hold it.

A DTensor parameter's data is its local shard, and under FSDP2 that shard is a view of the FSDPParam's
padded ``_sharded_param_data``, which FSDP all-gathers from. Rebinding the parameter would leave FSDP
reading the old memory, so instead every tensor object over the shard's storage is re-pointed
(``Tensor.set_``) to a Region copy of that storage: the same objects, new memory, fixed addresses. DTensor
optimizer states are re-pointed the same way, and the gradients FSDP's reduce-scatter makes are adopted
when they are offloaded (they are made anew after ``zero_grad()``, not accumulated by autograd).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .._dtensor import is_dtensor
from ._adopted import Group, storage_groups
from ._source import Source, StateItem

__all__ = ["DTensorSource", "fsdp_holders", "is_dtensor", "local"]


def local(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor holding ``t``'s data on this rank (``t`` itself if it is not a DTensor)."""
    return t._local_tensor if is_dtensor(t) else t  # type: ignore[attr-defined]


def fsdp_holders(model: nn.Module) -> dict[int, list[torch.Tensor]]:
    """For each FSDP2-managed parameter (by id), FSDP's own tensors over its shard's storage.

    Raises:
        RuntimeError: the model uses FSDP2 but its internals are not laid out as this version of rlmem
            expects; adopting without them would let FSDP read stale memory.
    """
    out: dict[int, list[torch.Tensor]] = {}
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover
        return out
    for m in model.modules():
        if not isinstance(m, FSDPModule):
            continue
        try:
            group = m._get_fsdp_state()._fsdp_param_group  # type: ignore[attr-defined]
            params = [] if group is None else group.fsdp_params
            for fp in params:
                holders = [fp._sharded_param_data]
                post = getattr(fp, "_sharded_post_forward_param_data", None)
                if isinstance(post, torch.Tensor):
                    holders.append(post)
                out[id(fp.sharded_param)] = holders
        except AttributeError as e:
            raise RuntimeError(
                f"TrainState cannot find FSDP2's sharded storage in this PyTorch ({torch.__version__}): {e}"
            ) from e
    return out


class DTensorSource(Source):
    """DTensor parameters (their sharded storages, FSDP's own tensors over them included), DTensor optimizer
    states, and the gradients FSDP makes, when offloaded."""

    def __init__(self, kit: Any, root: nn.Module, params: list[nn.Parameter], *rest: Any) -> None:
        super().__init__(kit, root, params, *rest)
        self._root = root
        self._sharded = [p for p in params if is_dtensor(p)]
        self._grads: list[Group] = []

    def accepts(self, p: nn.Parameter) -> bool:
        return is_dtensor(p.data) and not local(p.data).is_meta

    def adopt_params(self, params: list[nn.Parameter]) -> list[nn.Parameter]:
        sharded = [p for p in params if is_dtensor(p.data)]
        if sharded:
            holders = fsdp_holders(self._root)
            # The parameter's own local tensor, not ``p.data``'s: ``p.data`` of a DTensor parameter is a new
            # DTensor over a new local tensor object (same storage), and re-pointing that alias would leave
            # the parameter, which the optimizer updates, on the old memory while FSDP all-gathers from the
            # new (FSDP's lazy initialisation happens to re-sync the two, so only adoption after it shows it).
            self.kit.repoint("params", storage_groups([(local(p), holders.get(id(p), [])) for p in sharded]))
        return [p for p in params if not is_dtensor(p.data)]

    def adopt_grads(self, params: list[nn.Parameter]) -> list[nn.Parameter]:
        return [p for p in params if not is_dtensor(p.data)]  # FSDP's are adopted when offloaded

    def takes_state(self, value: torch.Tensor) -> torch.Tensor | None:
        return local(value) if is_dtensor(value) else None

    def adopt_states(self, items: list[StateItem]) -> None:
        groups = self.kit.repoint("optimizer", [[it.local] for it in items])
        for it, g in zip(items, groups, strict=True):
            self.kit.set_state(it.key, g, it.local.data_ptr())

    def check(self, policies: dict[str, str]) -> None:
        if policies["params"] == "discard" and self._sharded:
            raise ValueError(
                f"params='discard' is not available for TrainState {self.kit.name!r}: its parameters are "
                "DTensors (FSDP2), whose sharded storage cannot be a placeholder; use params='offload' "
                "(or 'keep')"
            )

    def before_offload(self, policies: dict[str, str], moving: list[str]) -> None:
        if "grads" not in moving:
            return
        if policies["grads"] == "discard":
            for p in self._sharded:
                p.grad = None
        else:
            self._adopt_grads()

    def _adopt_grads(self) -> None:
        """Move FSDP-made gradients into a Region (before offloading them), giving back the gradient Regions
        that no gradient lives in any more."""
        grads = [local(p.grad) for p in self._sharded if p.grad is not None]
        inside = {t.data_ptr() for g in self._grads for t in g.tensors}
        self._grads += self.kit.repoint(
            "grads", storage_groups([(g, []) for g in grads if g.data_ptr() not in inside])
        )
        live = {g.data_ptr() for g in grads}
        for g in self._grads:
            if not g.region.closed and not any(t.data_ptr() in live for t in g.tensors):
                self.kit.drop("grads", g.region)
        self._grads = [g for g in self._grads if not g.region.closed]
