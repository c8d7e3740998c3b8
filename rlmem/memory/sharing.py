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
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

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
