"""The part of :class:`~rlmem.memory.region.Region` that shares its memory with other processes: whether
it can, the layout and descriptors it exports, a Region made over another process's export (``attach``), a
paused peer's mapping of the owner's new memory (``reattach``), and tensors over an attached Region
(``view``).

A base class of ``Region`` and nothing else, over the Region's state as ``_region_info.RegionInfo`` declares
it, under the Region's lock as the rest of its methods work (see ``region.py``); the descriptor work and the
protocol's refusals are in :mod:`rlmem.memory.sharing`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

import torch

from . import _chunks as table
from ._region_info import RegionInfo
from ._tensors import check_view, tensor_over
from .sharing import SharedLayout, check_export, check_reattach, export_files

__all__ = ["SharedRegion"]

_R = TypeVar("_R", bound="SharedRegion")  # the Region class attach() is called on


class SharedRegion(RegionInfo):
    """Sharing methods of :class:`~rlmem.memory.region.Region` (its base class; see the module docstring)."""

    # The Region's methods these call: _check_open(), _settle() (joins the operation in flight), _build().

    @property
    def shareable(self) -> bool:
        """Whether other processes can map this Region's memory (``shareable=True``, or attached)."""
        return self._shareable

    @property
    def attached(self) -> bool:
        """Whether this Region maps another process's memory (:meth:`attach`) rather than owning its own."""
        return self._peer

    @property
    def generation(self) -> int:
        """How many times the owner's memory was made anew by ``resume()`` (a peer: the one it maps)."""
        return self._generation

    def export(self) -> tuple[SharedLayout, list[int]]:
        """The layout of this Region and a new file descriptor per chunk, for another process to
        :meth:`attach` (send both over a Unix socket: ``socket.send_fds``; close the descriptors after).

        Raises:
            ValueError: the Region was not made with ``shareable=True``, or is itself attached.
            RuntimeError: it is paused (its memory is not there to share).
            RegionClosedError: it is closed.
        """
        with self._lock:
            self._check_open()
            self._settle()
            check_export(self.name, shareable=self._shareable, peer=self._peer, paused=self._paused)
            fds = export_files(self._backend, self._chunks)
            layout = SharedLayout(
                name=self.name,
                device=str(self._device),
                nbytes=self._nbytes,
                chunk_bytes=self._chunk,
                chunks=tuple(self._chunks),
                used_bytes=self._used,
                generation=self._generation,
            )
            return layout, fds

    @classmethod
    def attach(cls: type[_R], layout: SharedLayout, fds: Sequence[int], *, name: str | None = None) -> _R:
        """Map another process's exported Region here, at addresses of this process's own that stay fixed;
        tensors over it come from :meth:`view`. The descriptors may be closed once it returns.

        Raises:
            ValueError: ``fds`` do not match the layout's chunks (not one per chunk, or one whose memory is
                not its chunk's size: the message names the chunk), or this device's chunking differs. Every
                descriptor is checked before any is mapped; nothing is left mapped.
            OutOfMemoryError / CudaError: the memory cannot be mapped; nothing is left mapped.
        """
        if not isinstance(layout, SharedLayout):
            raise ValueError(f"layout must be a SharedLayout, got {type(layout).__name__}")
        region = cls.__new__(cls)
        label = layout.name if name is None else name
        region._build(layout.nbytes, layout.device, layout.chunk_bytes, label, True, (layout, list(fds)))
        return region

    def reattach(self, layout: SharedLayout, fds: Sequence[int]) -> None:
        """A paused peer maps the owner's new memory (its ``export()`` after ``resume()``) at the same
        addresses as before.

        Raises:
            RuntimeError: this Region is not an attached one, or is not paused.
            ValueError: the layout is another Region's, or ``fds`` do not match it (as for :meth:`attach`);
                nothing is mapped and the Region stays paused, ready for a ``reattach`` with the right ones.
        """
        with self._lock:
            self._check_open()
            self._settle()
            check_reattach(self.name, peer=self._peer, paused=self._paused)
            self._state = table.remap(self._backend, self._chunks, self._nbytes, self.name, layout, list(fds))
            self._paused = False
            self._generation = layout.generation
            self._timings.resumes += 1

    def view(self, offset: int, shape: int | Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """A tensor of ``shape`` and ``dtype`` at byte ``offset`` of the Region (the owner's tensors are at
        ``span(t)[0]``; an attached Region's tensors are views at the same offsets).

        Raises:
            ValueError: out of the Region, or not aligned for ``dtype``.
            RuntimeError: the Region is paused.
        """
        self._check_open()
        dims, need = check_view(self.name, offset, shape, dtype, self._nbytes)
        if self._paused:
            raise RuntimeError(f"region {self.name!r} is paused: its memory is not there to view")
        return tensor_over(self._backend, offset, need, dims, dtype, self._device)

    # -- lifecycle -----------------------------------------------------------------------------------
