"""torch's ``DTensor`` (FSDP2's and tensor parallelism's parameters), None in builds without
``torch.distributed``: one test of "is this a DTensor" for the train state and the sampler, and parameters
gathered whole for a copy of the weights (FSDP2's shards in buckets, one all-gather for many parameters)."""

from __future__ import annotations

try:
    import torch.distributed as _dist
    from torch.distributed.tensor import DTensor

    # The all-gather into one tensor, by its name in torch.distributed (torch 2.13 renamed it), looked up at
    # each call: a caller that counts the gathers wraps it under this name.
    ALL_GATHER = "all_gather_single" if hasattr(_dist, "all_gather_single") else "all_gather_into_tensor"
except ImportError:  # pragma: no cover - builds without torch.distributed
    DTensor = None  # type: ignore[assignment,misc]
    ALL_GATHER = ""

from collections.abc import Iterable
from typing import Any

import torch

__all__ = ["ALL_GATHER", "DTensor", "copy_full", "full", "is_dtensor"]

# The most one bucket's all-gather puts out on a rank (the whole of its parameters, every rank's shard): what
# the gather adds to the device's memory while a copy is filled. A parameter larger than this goes alone.
BUCKET_BYTES = 256 << 20


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


def copy_full(
    pairs: Iterable[tuple[torch.Tensor, torch.Tensor]], *, bucket_bytes: int = BUCKET_BYTES
) -> None:
    """Copy each source whole into its destination, cast to the destination's dtype.

    Sources sharded on their first dim over a one-dimensional mesh (FSDP2's parameters) are cast to the
    destination's dtype into one buffer per bucket and gathered with one all-gather per bucket: one gather per
    parameter is bound by the gathers' count, not their bytes. Any other DTensor is gathered alone
    (:func:`full`), a plain tensor copied. The copies are bit for bit those of :func:`full`: a gather moves
    values unchanged, and the cast is elementwise. A collective: every rank calls it with the same pairs in
    the same order (which sources are bucketed depends only on their placements, meshes, global shapes and
    the destinations' dtypes, the same on every rank).

    Args:
        pairs: (source, destination) pairs; each destination has its source's global shape.
        bucket_bytes: the most one bucket's gather puts out per rank.
    """
    bucket: list[tuple[torch.Tensor, torch.Tensor, int, int]] = []  # (shard, destination, rows, slot)
    mesh: Any = None
    out_bytes = 0
    with torch.no_grad():
        for src, dst in pairs:
            m = _row_sharded(src, dst)
            if m is None:
                dst.copy_(full(src, dst.dtype))
                continue
            rows, slot = _span(dst, m.size())
            nbytes = slot * m.size() * dst.dtype.itemsize
            full_up = out_bytes + nbytes > bucket_bytes
            if bucket and (m is not mesh or dst.dtype != bucket[0][1].dtype or full_up):
                _gather_bucket(bucket, mesh)
                bucket, out_bytes = [], 0
            bucket.append((src.to_local(), dst, rows, slot))
            mesh, out_bytes = m, out_bytes + nbytes
        if bucket:
            _gather_bucket(bucket, mesh)


def _row_sharded(src: torch.Tensor, dst: torch.Tensor) -> Any:
    """``src``'s mesh where it is sharded on dim 0 over a one-dimensional mesh into a contiguous destination
    of its shape on the same device (what a bucket takes), else None."""
    if not is_dtensor(src) or src.device_mesh.ndim != 1 or len(src.placements) != 1:
        return None
    from torch.distributed.tensor import Shard

    p = src.placements[0]
    if type(p) is not Shard or p.dim != 0 or src.dim() == 0:  # a subclass (_StridedShard) lays rows out apart
        return None
    if dst.shape != src.shape or not dst.is_contiguous() or dst.device != src.device:
        return None
    return src.device_mesh


def _span(dst: torch.Tensor, world: int) -> tuple[int, int]:
    """The most rows a rank holds of ``dst`` (torch.chunk's chunk: DTensor's ``Shard`` splits as torch.chunk
    does), and the elements of one rank's slot in a bucket for it."""
    rows = -(-dst.shape[0] // world)
    return rows, rows * (dst[0].numel() if dst.shape[0] else 0)


def _gather_bucket(bucket: list[tuple[torch.Tensor, torch.Tensor, int, int]], mesh: Any) -> None:
    """One all-gather for the bucket's shards (cast into each rank's slots), then each destination filled from
    every rank's slot: whole chunks in one copy, the last rank's shorter one in a second."""
    world, rank = mesh.size(), mesh.get_local_rank()
    dtype, device = bucket[0][1].dtype, bucket[0][1].device
    per = sum(slot for *_, slot in bucket)
    send = torch.empty(per, dtype=dtype, device=device)  # the padding past a short shard is never read
    off = 0
    for local, dst, rows, slot in bucket:
        have = max(0, min(rows, dst.shape[0] - rank * rows))
        # torch.chunk's split, as DTensor's Shard documents it
        assert local.shape[0] == have, (local.shape, dst.shape, rank)
        if have:
            send[off : off + local.numel()].view(local.shape).copy_(local)  # cast here, before the gather
        off += slot
    out = torch.empty(world * per, dtype=dtype, device=device)
    getattr(_dist, ALL_GATHER)(out, send, group=mesh.get_group())
    grid = out.view(world, per)
    off = 0
    for _, dst, rows, slot in bucket:
        if slot:
            d0 = dst.shape[0]
            flat = dst.view(d0, -1)
            whole, rest = divmod(d0, rows)
            piece = grid[:, off : off + slot]
            if whole:
                flat[: whole * rows].view(whole, rows, -1).copy_(piece[:whole].view(whole, rows, -1))
            if rest:
                flat[whole * rows :].copy_(piece[whole, : rest * flat.shape[1]].view(rest, -1))
        off += slot
