"""Where a Region's memory comes from: the device, its backend, the chunking, and mapping chunks.

Owns reading the caller's ``device``, ``nbytes`` and ``chunk_bytes``, choosing the backend for the device
(the CUDA one imported only when a GPU is asked for, so CPU-only machines never load the driver binding),
cutting the range into chunks, and mapping a list of chunks as one step: the single retry after PyTorch's
caching allocator gives its free blocks back, the undo of what the step mapped when it fails, and the one
out-of-memory message. Which chunks are mapped is the Region's bookkeeping; nothing here records it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from .._units import GiB, round_up
from ..errors import CudaError, OutOfMemoryError
from ._host import HostBackend, SharedHostBackend
from .backend import Backend

__all__ = ["check_sizes", "chunking", "make_backend", "map_chunks", "resolve_device"]

# Default chunking: about _TARGET_CHUNKS chunks per region, each between the two bounds. Driver calls cost
# per chunk, not per byte: a 16 GiB discard cycle took 24 ms with 64 MiB chunks and 7 ms with 1 GiB chunks on
# an H100 (bench/results/vmm_calls-nvidia-h100-x1.json), while ~16 chunks keep release progressive and let
# mapping the next chunk overlap the copy of this one.
_TARGET_CHUNKS = 16
_MIN_CHUNK = 64 << 20
_MAX_CHUNK = 2 << 30


def resolve_device(device: Any) -> torch.device:
    """``device`` as ``cpu`` or ``cuda:N`` with its index, checked against this machine."""
    if isinstance(device, int) and not isinstance(device, bool):
        device = torch.device("cuda", device)
    try:
        dev = torch.device(device)
    except (TypeError, RuntimeError) as e:
        raise ValueError(
            f"device must be 'cpu', 'cuda', 'cuda:N', an int or a torch.device; got {device!r}"
        ) from e
    if dev.type == "cpu":
        return dev
    if dev.type != "cuda":
        raise ValueError(f"device must be a CUDA device or 'cpu'; got {device!r}")
    if not torch.cuda.is_available():
        raise RuntimeError(
            f"Region(device={device!r}): CUDA is not available on this machine; "
            "use device='cpu' for the host backend"
        )
    index = torch.cuda.current_device() if dev.index is None else dev.index
    count = torch.cuda.device_count()
    if not 0 <= index < count:
        raise ValueError(f"device {device!r} does not exist: this machine has {count} CUDA device(s)")
    return torch.device("cuda", index)


def make_backend(dev: torch.device, shareable: bool) -> Backend:
    """The backend of a Region on ``dev`` (from :func:`resolve_device`)."""
    if dev.type == "cpu":
        return SharedHostBackend() if shareable else HostBackend()
    from ._cuda import CudaBackend

    return CudaBackend(dev.index, shareable=shareable)


def check_sizes(nbytes: int, chunk_bytes: int | None) -> None:
    """Check a Region's ``nbytes`` and ``chunk_bytes`` arguments.

    Raises:
        ValueError: either is not a positive int (``chunk_bytes`` may be None).
    """
    if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes <= 0:
        raise ValueError(f"nbytes must be a positive int, got {nbytes!r}")
    if chunk_bytes is not None and (
        not isinstance(chunk_bytes, int) or isinstance(chunk_bytes, bool) or chunk_bytes <= 0
    ):
        raise ValueError(f"chunk_bytes must be a positive int or None, got {chunk_bytes!r}")


def chunking(
    nbytes: int, chunk_bytes: int | None, granularity: int
) -> tuple[int, int, list[tuple[int, int]]]:
    """(capacity, chunk size, ``(offset, size)`` of each chunk) of a Region of ``nbytes``: both sizes
    rounded up to ``granularity``, the chunk no larger than the capacity, the last chunk what is left."""
    capacity = round_up(nbytes, granularity)
    chunk = round_up(chunk_bytes, granularity) if chunk_bytes else _default_chunk(capacity, granularity)
    chunk = min(chunk, capacity)
    return capacity, chunk, [(off, min(chunk, capacity - off)) for off in range(0, capacity, chunk)]


def _default_chunk(capacity: int, granularity: int) -> int:
    chunk = round_up(-(-capacity // _TARGET_CHUNKS), granularity)
    return max(_MIN_CHUNK, min(chunk, _MAX_CHUNK))


def _is_oom(e: BaseException) -> bool:
    from ._cuda import CUDA_ERROR_OUT_OF_MEMORY

    return isinstance(e, CudaError) and e.code == CUDA_ERROR_OUT_OF_MEMORY


def map_chunks(
    backend: Backend,
    chunks: Sequence[tuple[int, int]],
    indices: Sequence[int] | range,
    *,
    what: str,
    region: str,
    device: torch.device,
    on_mapped: Callable[[int], None] | None = None,
) -> None:
    """Map the chunks ``indices`` of ``chunks`` (``(offset, size)`` each), calling ``on_mapped(i)`` after
    each; on failure unmap those this call mapped and raise.

    Raises:
        OutOfMemoryError: the device cannot provide them; the message names ``what`` (the operation) and
            ``region``, and the bytes needed and free.
    """
    mapped: list[int] = []
    try:
        for i in indices:
            off, size = chunks[i]
            try:
                backend.map(off, size)
            except CudaError as e:
                if not _is_oom(e):
                    raise
                # PyTorch's caching allocator may hold free blocks: give them back and try once more.
                backend.reclaim_cache()
                backend.map(off, size)
            mapped.append(i)
            if on_mapped is not None:
                on_mapped(i)
    except BaseException as e:
        backend.synchronize()  # copies into chunks about to be unmapped must finish first
        for i in mapped:
            backend.unmap(chunks[i][0])
        if _is_oom(e):
            needed = sum(chunks[i][1] for i in indices)
            free, _ = backend.mem_info()
            raise OutOfMemoryError(
                f"{what} of region {region!r} needs {needed / GiB:.3f} GiB of device memory on "
                f"{device}, but only {free / GiB:.3f} GiB is free"
                + (
                    "; the region stays paused with its contents kept: free memory and call resume() again"
                    if what == "resume()"
                    else ""
                ),
                needed=needed,
                free=free,
                device=str(device),
            ) from e
        raise
