"""What one process tells another so that it can map the same Region: :class:`SharedLayout`.

A shareable Region (``Region(..., shareable=True)``) makes its chunks exportable: POSIX file descriptors of
its CUDA allocations (``cuMemExportToShareableHandle``; the handle type must be asked for when the memory is
made, which is why sharing is chosen at construction), or of the ``memfd`` files behind a host Region's
chunks. ``region.export()`` gives the layout and a descriptor per chunk; the other process, sent both over a
Unix socket (``socket.send_fds``), calls ``Region.attach(layout, fds)`` and maps the same memory at
addresses of its own, which stay fixed for its life (CUDA graphs captured over them stay valid).

Fabric handles (``CU_MEM_HANDLE_TYPE_FABRIC``, for memory shared across hosts over NVLink) are not used:
both processes are on one GPU, where a file descriptor is what the driver shares and what a Unix socket can
carry; fabric handles also need IMEX channels that a co-located pair does not.

Memory is freed only when every process has released it, so pausing shared memory is a protocol: the
peers pause first (``peer.pause(keep=False)``: unmapped, their address range kept), then the owner pauses
(with or without a backup), and the memory goes back to the device. After the owner's ``resume()`` the
memory is new (``generation`` counts): its next ``export()`` goes to the peers, whose
``reattach(layout, fds)`` maps it at the same addresses as before.

Besides the layout, this module holds the descriptor work behind ``Region.export`` / ``attach`` /
``reattach``: a descriptor per chunk out, and in, every descriptor checked against its chunk before any is
mapped, with one message form naming the chunk that does not fit; and the protocol's refusals (a peer kept
or resumed, an export of what is not there to share, a reattach out of turn), each with the step to take
instead. The Region calls these under its lock and records the chunks' states itself.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from .backend import Backend

# export_files, map_files and the check_* refusals are the Region's, not part of the public API.
__all__ = ["SharedLayout"]


@dataclass(frozen=True)
class SharedLayout:
    """A shareable Region as another process needs it: its name, device, size, chunking (``(offset, size)``
    of each chunk, one file descriptor each), the bytes handed out by ``empty()`` and its generation (the
    number of times its memory was made anew by ``resume()``). JSON-able with :meth:`as_dict`."""

    name: str
    device: str
    nbytes: int
    chunk_bytes: int
    chunks: tuple[tuple[int, int], ...]
    used_bytes: int
    generation: int

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["chunks"] = [list(c) for c in self.chunks]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SharedLayout:
        """The layout :meth:`as_dict` wrote.

        Raises:
            ValueError: a field is missing or of the wrong kind.
        """
        try:
            return cls(
                name=str(d["name"]),
                device=str(d["device"]),
                nbytes=int(d["nbytes"]),
                chunk_bytes=int(d["chunk_bytes"]),
                chunks=tuple((int(o), int(s)) for o, s in d["chunks"]),
                used_bytes=int(d["used_bytes"]),
                generation=int(d["generation"]),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"not a SharedLayout: {e!r}") from e


def export_files(backend: Backend, chunks: Sequence[tuple[int, int]]) -> list[int]:
    """A new file descriptor for each of ``chunks`` (``(offset, size)``); if one cannot be made, those made
    so far are closed and the error raised."""
    fds: list[int] = []
    try:
        for off, _ in chunks:
            fds.append(backend.export_file(off))  # type: ignore[attr-defined]
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return fds


def map_files(
    backend: Backend,
    chunks: Sequence[tuple[int, int]],
    nbytes: int,
    region: str,
    layout: SharedLayout,
    fds: list[int],
) -> None:
    """Map each chunk's file at its offset, once every descriptor has been checked against its chunk;
    on failure unmap what this call mapped and raise.

    Args:
        backend, chunks, nbytes, region: the Region's backend, chunks, size and name.
        layout, fds: what the owner's ``export()`` gave.

    Raises:
        ValueError: the layout is another Region's, or a descriptor does not fit its chunk.
    """
    if tuple(chunks) != tuple(layout.chunks) or nbytes != layout.nbytes:
        raise ValueError(
            f"layout of region {layout.name!r} ({layout.nbytes} bytes in {len(layout.chunks)} chunks) "
            f"does not match this one's ({nbytes} bytes in {len(chunks)} chunks)"
        )
    _check_files(backend, chunks, region, fds)
    done: list[int] = []
    try:
        for i, ((off, size), fd) in enumerate(zip(chunks, fds, strict=True)):
            try:
                backend.map_file(off, size, fd)  # type: ignore[attr-defined]
            except ValueError as e:
                raise ValueError(_file_mismatch(chunks, region, i, str(e))) from e
            done.append(i)
    except BaseException:
        for i in done:
            backend.unmap(chunks[i][0])
        raise


def check_pause(region: str, *, keep: bool, peer: bool) -> None:
    """Refuse ``pause(keep=True)`` of a peer: the memory is its owner's, to keep or discard.

    Raises:
        ValueError: ``keep`` and ``peer``.
    """
    if keep and peer:
        raise ValueError(
            f"keep=True: region {region!r} is attached to another process's memory, which that "
            "process keeps or discards; a peer pauses with keep=False (unmapped, its addresses kept)"
        )


def check_resume(region: str, *, peer: bool) -> None:
    """Refuse ``resume()`` of a paused peer: the owner makes the memory anew, and the peer maps it again.

    Raises:
        RuntimeError: ``peer``.
    """
    if peer:
        raise RuntimeError(
            f"region {region!r} is attached to another process's memory: map the owner's memory "
            "again with reattach(layout, fds) from its export() after it resumed"
        )


def check_export(region: str, *, shareable: bool, peer: bool, paused: bool) -> None:
    """Refuse ``export()`` of a Region that is not its own shareable memory, or whose memory is not there.

    Raises:
        ValueError: not ``shareable``, or a ``peer``.
        RuntimeError: ``paused``.
    """
    if not shareable or peer:
        why = "it is attached to another process's memory" if peer else "make it with shareable=True"
        raise ValueError(f"region {region!r} cannot be exported: {why}")
    if paused:
        raise RuntimeError(f"region {region!r} is paused: resume() it before export()")


def check_reattach(region: str, *, peer: bool, paused: bool) -> None:
    """Refuse ``reattach()`` of a Region that is not a peer, or of a peer still mapped.

    Raises:
        RuntimeError: not ``peer``, or not ``paused``.
    """
    if not peer:
        raise RuntimeError(f"region {region!r} is not attached to another process's memory")
    if not paused:
        raise RuntimeError(f"region {region!r} is mapped: pause(keep=False) it before reattach()")


def _check_files(backend: Backend, chunks: Sequence[tuple[int, int]], region: str, fds: list[int]) -> None:
    """Check every descriptor against its chunk before any is mapped: one per chunk, open, and holding
    the chunk's size where the backend can read it (a host file shorter than its chunk would be mapped
    past its end, where the first touch kills the process with SIGBUS).

    Raises:
        ValueError: naming the first chunk (index, offset) whose descriptor does not fit, with the bytes
            expected and found.
    """
    if len(fds) != len(chunks):
        raise ValueError(
            f"fds: {len(fds)} descriptors for the {len(chunks)} chunks of region {region!r}; "
            "one per chunk, in the layout's order"
        )
    for i, ((_, size), fd) in enumerate(zip(chunks, fds, strict=True)):
        if not isinstance(fd, int) or isinstance(fd, bool) or fd < 0:
            raise ValueError(
                _file_mismatch(chunks, region, i, f"fds[{i}] must be a file descriptor, got {fd!r}")
            )
        try:
            got = backend.file_bytes(fd)  # type: ignore[attr-defined]
        except (OSError, ValueError) as e:
            raise ValueError(_file_mismatch(chunks, region, i, f"fds[{i}] cannot be mapped: {e}")) from e
        if got is not None and got != size:
            raise ValueError(_file_mismatch(chunks, region, i, f"its descriptor fds[{i}] holds {got} bytes"))


def _file_mismatch(chunks: Sequence[tuple[int, int]], region: str, index: int, why: str) -> str:
    """The one message form of a descriptor that does not fit its chunk."""
    off, size = chunks[index]
    return (
        f"fds do not match the layout of region {region!r}: chunk {index} at offset {off} expects "
        f"{size} bytes, but {why}; nothing is left mapped (are these another Region's descriptors?)"
    )
