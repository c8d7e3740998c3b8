"""A Region's host backup and the views of its kept bytes: tensors over the pinned backup, or over that
backup as the GPU sees it through its device-mapped registration.

Owns growing the backup without losing what a pause that failed part-way left only there, freeing it,
telling whether a span's bytes were kept, and building a view with a Region tensor's geometry (shape,
strides, dtype) at its offset in the backup, cached for the backup's life. The Region holds the backup and
the chunks' states and calls these under its lock; replacing or freeing the backup clears the cache.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ._pinned import HostBuffer

__all__ = ["BackupViews", "check_kept", "drop_backup", "grow_backup"]


def grow_backup(
    backup: HostBuffer | None, nbytes: int, *, device_index: int | None, saved: bool, views: BackupViews
) -> HostBuffer:
    """A backup of at least ``nbytes``: ``backup`` itself if it is alive and large enough, else a new one
    (pinned for ``device_index``; pageable for None) that replaces it, ``views`` cleared. ``saved``: some
    chunk's contents are in ``backup`` alone (a pause that failed part-way), so they are copied over first.

    Raises:
        HostOutOfMemoryError: the host cannot provide it; ``backup`` and ``views`` are untouched.
    """
    if backup is not None and backup.alive and backup.nbytes >= nbytes:
        return backup
    new = HostBuffer(nbytes, device_index=device_index)
    views.clear()
    if backup is not None:
        if saved and backup.alive:
            assert new.tensor is not None and backup.tensor is not None
            new.tensor[: backup.nbytes].copy_(backup.tensor)
        backup.free()
    return new


def drop_backup(backup: HostBuffer | None, views: BackupViews) -> None:
    """Free ``backup``, if any, and forget the views over it (the Region then holds no backup)."""
    views.clear()
    if backup is not None:
        backup.free()


def check_kept(
    region: str, paused: bool, chunks: Sequence[tuple[int, int]], kept: Sequence[bool], off: int, extent: int
) -> None:
    """Check that the ``extent`` bytes at ``off`` of a Region can be read from its backup: the Region is
    ``paused`` and every one of ``chunks`` (``(offset, size)``) they touch is ``kept``.

    Raises:
        RuntimeError: the Region is resident, or some of the bytes were not kept.
    """
    if not paused:
        raise RuntimeError(
            f"region {region!r} is resident: read the tensor itself (host_view is for a paused region)"
        )
    lost = [
        i
        for i, (coff, size) in enumerate(chunks)
        if coff < off + extent and off < coff + size and not kept[i]
    ]
    if lost:
        raise RuntimeError(
            f"region {region!r}: bytes {off}..{off + extent} were not kept "
            "(paused with keep=False, or a pause that failed part-way); there is nothing to read"
        )


class BackupViews:
    """Views of one backup, cached: the same tensors serve every pause (a trainer offloads the same state
    every step), and each has a storage of its own, as the Region's tensors do."""

    def __init__(self) -> None:
        self._cache: dict[tuple, torch.Tensor] = {}

    def clear(self) -> None:
        """Forget every view (the backup they are over is being replaced or freed)."""
        self._cache.clear()

    def get(
        self,
        backup: HostBuffer | None,
        tensor: torch.Tensor,
        off: int,
        extent: int,
        *,
        mapped: bool,
        device: torch.device,
    ) -> torch.Tensor:
        """``tensor``'s geometry over ``backup`` at ``off`` (``extent`` bytes), unchecked: the caller knows
        the bytes are there. ``mapped``: a tensor of ``device`` over the pinned backup (a backup that is not
        pinned, the host backend's, gives the host view either way)."""
        assert backup is not None and backup.tensor is not None
        mapped = mapped and backup.pinned
        key = (off, extent, tensor.dtype, tuple(tensor.shape), tuple(tensor.stride()), mapped)
        view = self._cache.get(key)
        if view is None:
            if extent == 0:
                view = torch.empty(tensor.shape, dtype=tensor.dtype, device=device if mapped else "cpu")
            else:
                flat = backup.device_view(off, extent) if mapped else backup.host_view(off, extent)
                view = flat.view(tensor.dtype).as_strided(tensor.shape, tensor.stride())
            self._cache[key] = view
        return view
