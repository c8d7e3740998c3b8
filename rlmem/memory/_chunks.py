"""A Region's chunk table: the state of each chunk, and the per-chunk work of mapping, pausing and resuming.

Owns the three states a chunk is in (:data:`MAPPED`, :data:`SAVED`, :data:`EMPTY`) and the loops that move
chunks between them: mapping the chunks of a new or attached Region, a pause's copies of the kept chunks to
the host backup and its release of every mapped chunk, a resume's mapping of the released chunks with their
kept contents copied back, and a peer's mapping of its owner's new memory.

The Region holds the chunks, their states, the backup and its lock. It runs these loops while it holds that
lock, or on the worker thread of its one non-blocking operation in flight (which its next operation joins
before it touches the states), or while it is being built and nothing else can see it; nothing here locks.
Each loop changes the states it is given in place (or returns new ones) as the memory changes, so a failure
part-way leaves them true; the Region records what the operation did (paused or not, counts, timings,
generation). The physical work is the backend's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ._device import map_chunks
from ._pinned import HostBuffer
from .backend import Backend
from .sharing import SharedLayout, map_files

__all__ = [
    "EMPTY",
    "MAPPED",
    "SAVED",
    "build",
    "committed",
    "copy_out",
    "is_saved",
    "release",
    "remap",
    "resident",
    "restore",
    "to_save",
]

MAPPED = 0  # physical memory mapped; contents live on the device
SAVED = 1  # released; contents kept in the host backup
EMPTY = 2  # released; contents discarded

Chunks = Sequence[tuple[int, int]]  # (offset, size) of each chunk


def resident(chunks: Chunks, states: Sequence[int]) -> int:
    """Bytes of the mapped chunks."""
    return sum(size for (_, size), st in zip(chunks, states, strict=True) if st == MAPPED)


def committed(backend: Backend, chunks: Chunks, states: Sequence[int]) -> int:
    """Bytes of memory the mapped chunks take now, as the backend counts them."""
    return sum(
        backend.committed(off)  # type: ignore[attr-defined]
        for (off, _), st in zip(chunks, states, strict=True)
        if st == MAPPED
    )


def build(
    backend: Backend,
    chunks: Chunks,
    nbytes: int,
    files: tuple[SharedLayout, list[int]] | None,
    *,
    paused: bool,
    region: str,
    device: torch.device,
) -> list[int]:
    """The states of a new Region's chunks once ``backend`` has reserved its ``nbytes`` of addresses and each
    chunk is mapped to the owner's file (``files``, an attached Region), to new memory, or (``paused``) not
    at all. On failure the backend is destroyed and the error raised."""
    backend.open(nbytes)
    try:
        if files is not None:
            map_files(backend, chunks, nbytes, region, *files)
        elif not paused:
            map_chunks(backend, chunks, range(len(chunks)), what="Region()", region=region, device=device)
    except BaseException:
        backend.destroy()  # no tensor exists yet: the address range can go at once
        raise
    return [EMPTY if paused else MAPPED] * len(chunks)


def is_saved(states: Sequence[int]) -> list[bool]:
    """Whether each chunk's contents are in the host backup."""
    return [st == SAVED for st in states]


def to_save(chunks: Chunks, states: Sequence[int], used: int) -> list[int]:
    """The chunks a kept pause copies to the backup: those mapped that hold bytes handed out (the first
    ``used``). Chunks past them have never been written, and released ones are kept already or lost."""
    return [i for i, (off, _) in enumerate(chunks) if off < used and states[i] == MAPPED]


def copy_out(
    backend: Backend, chunks: Chunks, backup: HostBuffer | None, saved: list[int], after: Any
) -> dict[int, Any]:
    """Queue (GPU) or make (host) the copies of the chunks ``saved`` to ``backup``, ordered after the token
    ``after``; returns the token of each chunk's copy, by index."""
    events: dict[int, Any] = {}
    if saved:
        assert backup is not None and backup.tensor is not None
        backend.begin_out(after)
        for i in saved:
            off, size = chunks[i]
            events[i] = backend.copy_out(off, size, backup.tensor[off : off + size])
    return events


def release(backend: Backend, chunks: Chunks, states: list[int], events: dict[int, Any], after: Any) -> int:
    """Release every mapped chunk, one by one, and return the bytes kept: a chunk with a copy in ``events``
    once its copy has completed (then :data:`SAVED`), any other at once (then :data:`EMPTY`). Each state is
    set as its chunk goes, so a failure part-way leaves the states true and a later pause releases the rest.
    """
    copied = 0
    backend.wait(after)
    for i, (off, size) in enumerate(chunks):
        if states[i] != MAPPED:
            continue
        if i in events:
            backend.wait(events[i])
            backend.unmap(off)
            states[i] = SAVED
            copied += size
        else:
            backend.unmap(off)
            states[i] = EMPTY
    return copied


def restore(
    backend: Backend,
    chunks: Chunks,
    states: list[int],
    backup: HostBuffer | None,
    *,
    region: str,
    device: torch.device,
) -> tuple[Any, Any, int]:
    """Map every released chunk and queue the copy of each :data:`SAVED` one back from ``backup``; returns
    the backend's marks before and after the copies and the bytes copied. Every chunk is then
    :data:`MAPPED`; on failure those this call mapped are unmapped and the states are left as they were.

    Raises:
        OutOfMemoryError: the device cannot provide the memory (see :func:`map_chunks`).
    """
    todo = [i for i, st in enumerate(states) if st != MAPPED]
    start = backend.mark_in(timing=True)
    copied = 0

    def copy_back(i: int) -> None:
        nonlocal copied
        if states[i] == SAVED:
            assert backup is not None and backup.tensor is not None
            off, size = chunks[i]
            backend.copy_in(off, size, backup.tensor[off : off + size])
            copied += size

    # Map and copy chunk by chunk, so mapping the next chunk overlaps the copy of this one.
    map_chunks(backend, chunks, todo, what="resume()", region=region, device=device, on_mapped=copy_back)
    done = backend.mark_in(timing=True)
    for i in todo:
        states[i] = MAPPED
    return start, done, copied


def remap(
    backend: Backend, chunks: Chunks, nbytes: int, region: str, layout: SharedLayout, fds: list[int]
) -> list[int]:
    """The states of a paused peer's chunks once each is mapped to its owner's new file (``layout`` and
    ``fds`` from the owner's ``export()``): all :data:`MAPPED`. On failure nothing is left mapped.

    Raises:
        ValueError: the layout is another Region's, or a descriptor does not fit its chunk.
    """
    map_files(backend, chunks, nbytes, region, layout, fds)
    return [MAPPED] * len(chunks)
