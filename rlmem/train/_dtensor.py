"""Adopting DTensor (FSDP2, tensor-parallel) state into Regions by re-pointing the tensors that hold it.

A DTensor parameter's data is its local shard, and under FSDP2 that shard is a view of the FSDPParam's
padded ``_sharded_param_data``, which FSDP all-gathers from. Rebinding the parameter would leave FSDP
reading the old memory, so instead every tensor object over the shard's storage is re-pointed
(``Tensor.set_``) to a Region copy of that storage: the same objects, new memory, fixed addresses.
"""

from __future__ import annotations

import torch
from torch import nn

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover - builds without torch.distributed
    DTensor = None  # type: ignore[assignment,misc]


def is_dtensor(t: object) -> bool:
    return DTensor is not None and isinstance(t, DTensor)


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
