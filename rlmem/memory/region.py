"""Region: a fixed range of device addresses whose physical memory can be given back and taken again.

Tensors carved from a Region keep their ``data_ptr()`` for the Region's whole life. ``pause()`` releases the
physical memory (after copying the contents to a reusable pinned host backup if asked to), ``resume()`` maps
fresh memory at the same addresses and copies the contents back. Views, optimizer references and captured
CUDA graphs stay valid across the cycle.

While a Region is paused its tensors point at released memory and must not be used: on a GPU a kernel that
reads them faults (an illegal memory access, after which the process's CUDA context is unusable) and a host
copy fails with ``invalid argument``; on the host backend they read as zeros. Check ``region.paused`` first;
:meth:`Region.host_view` gives the kept bytes of a paused Region as a tensor over its host backup.
:class:`rlmem.TrainState` re-points the model's and optimizer's own references there while they are offloaded.

What this module owns: the Region, one class. Its state (each chunk's state, paused or not, the backup, the
operation in flight) and the one lock under which its methods read and change it, deciding each step; its
sharing with other processes (whether it can, the layout and descriptors it exports, a Region made over
another process's export with ``attach``, a paused peer's mapping of the owner's new memory with
``reattach``, tensors over an attached Region with ``view``), under the same lock; and what it reports
(sizes, device and chunking, the bytes handed out, mapped, committed and backed up, paused or closed,
:class:`RegionStats`). The work is beside it, called with what it needs while the lock is held (or on the
worker thread of the operation in flight, which the next operation joins first): the per-chunk loops of
mapping, pause, resume and reattach (``_chunks``), the device, backend and chunking (``_device``), tensors
over the range (``_tensors``), the handle and worker of a non-blocking operation (``_handle``), the
backup's growth and views (``_backup``), the descriptor work and the protocol's refusals of sharing
(``sharing``), the timings and the stats record (``_stats``). The physical work is in the backends.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch

from .._checks import check_flag
from .._units import round_up
from ..errors import RegionClosedError
from . import _chunks as table  # the chunk loops: run under the Region's lock (see _chunks)
from ._backup import BackupViews, check_kept, drop_backup, grow_backup
from ._device import check_sizes, chunking, make_backend, resolve_device
from ._handle import Handle, finish, note_copies, worker
from ._pinned import HostBuffer
from ._stats import RegionStats, Timings
from ._tensors import check_request, check_room, check_view, span_of, tensor_over
from .backend import Backend
from .sharing import SharedLayout, check_export, check_pause, check_reattach, check_resume, export_files

# Handle and RegionStats are defined beside the mechanisms they belong to and published here as before.
__all__ = ["Handle", "Region", "RegionStats"]

_DEFAULT_ALIGN = 256

_R = TypeVar("_R", bound="Region")  # the Region class attach() is called on


class Region:
    """A fixed range of device memory that can be paused (physical memory released) and resumed.

    Args:
        nbytes: size of the range; rounded up to the device's allocation granularity (2 MiB on recent
            NVIDIA GPUs, a page on the host).
        device: ``"cuda"`` (the current device), ``"cuda:N"``, an int, a ``torch.device``, or ``"cpu"`` for
            the host backend (same semantics on an anonymous mapping; for CPU-only machines and tests).
        chunk_bytes: unit of mapping, copying and release; rounded up to the granularity. Default: about a
            sixteenth of ``nbytes``, between 64 MiB and 2 GiB (driver calls cost per chunk). Memory is given
            back chunk by chunk as each chunk's copy completes.
        name: a label for errors, stats and reports.
        shareable: make the memory exportable, so that another process can map it
            (:meth:`export`, :meth:`attach`; see :mod:`rlmem.memory.sharing`).
        paused: start paused, with nothing kept: the addresses reserved, no memory taken until
            :meth:`resume` (for a process that lays out its memory before it is given the device).

    Raises:
        ValueError: an argument is out of range.
        RuntimeError: CUDA was asked for but is not available.
        OutOfMemoryError: the device cannot provide ``nbytes``.

    Example:
        >>> region = Region(64 << 20, device="cpu")
        >>> w = region.empty((1024, 1024), torch.float32)
        >>> _ = w.fill_(1.5)
        >>> _ = region.pause()          # contents to host backup, memory released
        >>> _ = region.resume()         # same addresses, same bytes
        >>> float(w[3, 7])
        1.5

    Tensors carved from a paused Region must not be used (see the module docstring); ``host_view`` reads and
    writes the kept bytes meanwhile, and writes made through it are what ``resume()`` brings back.
    """

    # The Region's state: set by _build, read and changed under _lock (see the module docstring).
    name: str
    _lock: threading.RLock
    _device: torch.device
    _backend: Backend
    _nbytes: int
    _chunk: int
    _chunks: list[Any]
    _state: list[Any]
    _shareable: bool
    _peer: bool
    _generation: int
    _used: int
    _paused: bool
    _closed: bool
    _ptr: int
    _backup: HostBuffer | None
    _timings: Timings
    _views: BackupViews
    _op: Handle | None
    _resume_done: Any

    def __init__(
        self,
        nbytes: int,
        device: str | int | torch.device = "cuda",
        *,
        chunk_bytes: int | None = None,
        name: str = "",
        shareable: bool = False,
        paused: bool = False,
    ) -> None:
        check_flag("shareable", shareable)
        check_flag("paused", paused)
        self._build(nbytes, device, chunk_bytes, name, shareable, None, paused)

    def _build(
        self,
        nbytes: int,
        device: Any,
        chunk_bytes: int | None,
        name: str,
        shareable: bool,
        files: tuple[SharedLayout, list[int]] | None,
        paused: bool = False,
    ) -> None:
        check_sizes(nbytes, chunk_bytes)
        if not isinstance(name, str):
            raise ValueError(f"name must be a str, got {type(name).__name__}")
        self.name = name
        self._lock = threading.RLock()
        self._closed = True  # until fully built, so a failed construction leaves nothing usable
        dev = resolve_device(device)
        backend = make_backend(dev, shareable)
        capacity, chunk, chunks = chunking(nbytes, chunk_bytes, backend.granularity)
        self._device = dev
        self._backend = backend
        self._nbytes = capacity
        self._chunk = chunk
        self._chunks = chunks
        self._state = [table.EMPTY] * len(self._chunks)
        self._shareable = shareable
        self._peer = files is not None
        self._generation = 0 if files is None else files[0].generation
        self._state = table.build(backend, chunks, capacity, files, paused=paused, region=name, device=dev)
        self._ptr = backend.ptr
        self._used = 0 if files is None else files[0].used_bytes
        self._paused = paused
        self._backup = None
        self._views = BackupViews()  # cleared whenever the backup is replaced or freed
        self._op = None  # a non-blocking pause/resume whose worker may still run
        self._resume_done = None  # event after the last resume's copies (CUDA)
        self._timings = Timings()
        self._closed = False

    # -- allocation ----------------------------------------------------------------------------------
    def empty(
        self,
        shape: int | Sequence[int],
        dtype: torch.dtype | None = None,
        *,
        align: int = _DEFAULT_ALIGN,
    ) -> torch.Tensor:
        """Carve an uninitialised, contiguous tensor out of the Region (bump allocation).

        Its ``data_ptr()`` never changes for the life of the Region. Each tensor has a storage of its own
        over its bytes (``torch.save`` writes those bytes alone; tensors of different dtypes can be saved
        together). Tensors are not freed one by one; the whole range goes with the Region.

        Args:
            shape: an int or a sequence of non-negative ints.
            dtype: element type (default: ``torch.get_default_dtype()``).
            align: byte alignment of the start, a power of two (default 256, like ``cudaMalloc``).

        Raises:
            ValueError: bad shape, dtype or align, or not enough room left (the message gives the sizes).
            RegionClosedError: the Region is closed.
        """
        self._check_open()
        dims, dtype, itemsize, need = check_request(shape, dtype, align)
        with self._lock:
            offset = round_up(self._used, max(align, itemsize))
            check_room(self.name, dims, dtype, need, offset, self._nbytes)
            self._used = offset + need
        return tensor_over(self._backend, offset, need, dims, dtype, self._device)

    # -- pause ---------------------------------------------------------------------------------------
    def pause(
        self,
        *,
        keep: bool = True,
        blocking: bool = True,
        on_queued: Callable[[Handle], None] | None = None,
    ) -> Handle:
        """Release the Region's physical memory, first copying its contents to host memory if ``keep``.

        The copy is ordered after the work already queued on the caller's current stream (and after a
        previous non-blocking resume). Work on other streams that touches the Region must be ordered before
        the call by the caller. The copies are queued (on a GPU) or made (on the host backend) before the
        call returns; chunks are released one by one as their copies complete. Calling it on a paused Region
        does nothing, except after a pause that failed part-way: then it releases what is left.

        Args:
            keep: copy the contents to a pinned host backup (allocated on the first kept pause and reused
                by later ones). ``False`` discards them: after ``resume()`` the memory is uninitialised
                (zeros on the host backend); for KV caches and gradients.
            blocking: wait until the memory has been released. If False, release runs on a worker thread;
                the returned handle's ``wait()`` joins it, and its ``wait_copied()`` orders a stream after
                the copies alone.
            on_queued: called with the handle on this thread once the copies are queued (its
                ``wait_copied()`` usable) and before any memory is released: the moment to point whatever
                refers to the Region's tensors at :meth:`backup_view` of them (``TrainState`` does).

        Returns:
            A :class:`Handle`.

        Raises:
            HostOutOfMemoryError: the backup cannot be allocated; nothing has been released.
            RegionClosedError: the Region is closed.
        """
        check_flag("keep", keep)
        check_flag("blocking", blocking)
        check_pause(self.name, keep=keep, peer=self._peer)
        if on_queued is not None and not callable(on_queued):
            raise ValueError(f"on_queued must be callable or None, got {type(on_queued).__name__}")
        with self._lock:
            self._check_open()
            op = self._op
            if op is not None and op.kind == "pause" and not op.done():
                return op
            self._settle()
            if self._paused and table.MAPPED not in self._state:
                return Handle("pause")
            # Paused with chunks still mapped happens only after a failed pause: release what is left.
            t0 = time.perf_counter()
            saved = table.to_save(self._chunks, self._state, self._used) if keep else []
            if saved:
                off, size = self._chunks[saved[-1]]
                self._ensure_backup(off + size)  # may raise: nothing released yet
            after = self._backend.order(self._resume_done)
            self._timings.pause_began(keep, again=self._paused)
            self._paused = True
            # Chunk work under the lock; a non-blocking release, on the worker that _settle joins first.
            events = table.copy_out(self._backend, self._chunks, self._backup, saved, after)
            handle = Handle("pause", device=self._device)
            note_copies(handle, events[saved[-1]] if saved else None)
            if on_queued is not None:
                on_queued(handle)
            if blocking:
                self._release_work(events, after, t0)
                note_copies(handle, None)
                return handle
            return self._start_op("pause", self._release_work, events, after, t0, handle=handle)

    def _release_work(self, events: dict[int, Any], after: Any, t0: float) -> None:
        # Under the lock (blocking), or on the worker of the operation in flight, which the next one joins.
        copied = table.release(self._backend, self._chunks, self._state, events, after)
        self._timings.pause_ended(copied, t0)

    def reserve_backup(self, *, blocking: bool = True) -> Handle:
        """Allocate the pinned host backup for the bytes in use now, ahead of the first kept pause.

        Page-locking host memory runs at a few GiB/s, so a first pause that has to do it is several times
        slower than later ones; reserving early (in the background with ``blocking=False``) keeps it off the
        phase switch. A pause issued meanwhile waits for the reservation and uses it.

        Raises:
            HostOutOfMemoryError: (blocking) the host cannot provide the backup.
        """
        check_flag("blocking", blocking)
        with self._lock:
            self._check_open()
            self._settle()
            used = [off + size for off, size in self._chunks if off < self._used]
            if not used:
                return Handle("backup")
            if blocking:
                self._ensure_backup(used[-1])
                return Handle("backup")
            return self._start_op("backup", self._ensure_backup, used[-1])

    def _ensure_backup(self, nbytes: int) -> None:
        index = self._device.index if self._backend.pinned_backup else None
        saved = table.SAVED in self._state
        self._backup = grow_backup(self._backup, nbytes, device_index=index, saved=saved, views=self._views)

    # -- the backup while paused -------------------------------------------------------------------
    def host_view(self, tensor: torch.Tensor, *, mapped: bool = False) -> torch.Tensor:
        """The kept bytes of ``tensor``, a tensor carved from this paused Region, as a tensor over the host
        backup: same shape, strides and dtype, no copy.

        Reads give exactly what ``resume()`` will bring back, and writes made through the view are what it
        brings back. The view is valid until the next pause overwrites the backup: clone what you keep
        longer. A non-blocking pause still in flight is waited for first.

        Args:
            tensor: a tensor over this Region's memory (one from :meth:`empty`, or a view of one).
            mapped: on a GPU, return the view as a tensor of the Region's device instead: the pinned backup
                mapped into the device's address space, which kernels read and write in place over the link
                (on the host backend the view is the same either way).

        Raises:
            ValueError: ``tensor`` is not a tensor over this Region.
            RuntimeError: the Region is not paused (use ``tensor`` itself), or the bytes were not kept
                (``pause(keep=False)``).
            RegionClosedError: the Region is closed.
        """
        check_flag("mapped", mapped)
        with self._lock:
            self._check_open()
            self._settle()
            off, extent = self.span(tensor)
            check_kept(self.name, self._paused, self._chunks, table.is_saved(self._state), off, extent)
            return self._views.get(self._backup, tensor, off, extent, mapped=mapped, device=self._device)

    def span(self, tensor: Any) -> tuple[int, int]:
        """(offset from the Region's start, bytes spanned) of ``tensor``, a tensor over the Region.

        Raises:
            ValueError: ``tensor`` is not a tensor over this Region.
        """
        return span_of(tensor, base=self._ptr, nbytes=self._nbytes, device=self._device, region=self.name)

    def backup_view(
        self, tensor: torch.Tensor, *, mapped: bool = False, span: tuple[int, int] | None = None
    ) -> torch.Tensor:
        """``tensor``'s bytes in the host backup, as :meth:`host_view` gives them, but without its checks: for
        a pause's ``on_queued`` callback, when the copies are queued and the chunks not yet marked kept, and
        for writing a backup the caller reserved (:meth:`reserve_backup`) before a ``keep=False`` pause.

        Args:
            tensor: a tensor over this Region.
            mapped: as for :meth:`host_view`.
            span: ``span(tensor)``, when the caller has it already.

        Raises:
            RuntimeError: the Region has no backup (reserve one, or pause with ``keep=True``, first).
        """
        off, extent = self.span(tensor) if span is None else span
        if self.backup_bytes < off + extent:
            raise RuntimeError(f"region {self.name!r} has no backup for bytes {off}..{off + extent}")
        return self._views.get(self._backup, tensor, off, extent, mapped=mapped, device=self._device)

    # -- resume --------------------------------------------------------------------------------------
    def resume(self, *, blocking: bool = True) -> Handle:
        """Map new physical memory at the same addresses and copy kept contents back.

        Args:
            blocking: return once the contents are on the device. If False (CUDA), the copies run on a
                dedicated stream and the returned handle's ``wait()`` orders the caller's stream after them
                without blocking the host: call it before touching the Region's tensors.

        Returns:
            A :class:`Handle`.

        Raises:
            OutOfMemoryError: the device cannot provide the memory. Whatever was mapped is undone; the
                Region stays paused with its backup intact, so ``resume()`` can be retried.
            RegionClosedError: the Region is closed.
        """
        check_flag("blocking", blocking)
        with self._lock:
            self._check_open()
            self._settle()
            if not self._paused:
                return Handle("resume", event=self._resume_done, device=self._device)
            check_resume(self.name, peer=self._peer)
            t0 = time.perf_counter()
            if not blocking and not self._backend.asynchronous:
                return self._start_op("resume", self._resume_work, t0, True)
            done = self._resume_work(t0, blocking)
            return Handle("resume", event=None if blocking else done, device=self._device)

    def _resume_work(self, t0: float, blocking: bool) -> Any:
        # Under the lock, or on the worker of the operation in flight, which the next one joins (_settle).
        start, done, copied = table.restore(
            self._backend, self._chunks, self._state, self._backup, region=self.name, device=self._device
        )
        self._paused = False
        self._timings.resumes += 1
        self._generation += 1  # new physical memory: peers map it again from the next export()
        self._resume_done = done
        if blocking:
            self._backend.wait(done)
        self._timings.resume_ended(copied, t0, None if blocking else (start, done))
        return done

    def _start_op(
        self, kind: str, fn: Callable[..., Any], *args: Any, handle: Handle | None = None
    ) -> Handle:
        # Run fn(*args) on a worker thread as the Region's operation in flight; the next one joins it first.
        handle = handle or Handle(kind, device=self._device)
        thread = worker(handle, fn, args, setup=self._backend.thread_setup, name=f"rlmem-{kind}-{self.name}")
        self._op = handle
        thread.start()
        return handle

    def _settle(self) -> None:
        # Finish a non-blocking operation still in flight before starting another.
        op, self._op = self._op, None
        if op is not None:
            finish(op, self.name)

    def _check_open(self) -> None:
        if self._closed:
            raise RegionClosedError(f"region {self.name!r} is closed")

    # -- lifecycle -----------------------------------------------------------------------------------
    def free_backup(self) -> None:
        """Free the host backup now (the next kept pause allocates a new one).

        Raises:
            RuntimeError: the Region is paused with its contents in the backup.
        """
        with self._lock:
            self._settle()
            if any(st == table.SAVED for st in self._state):
                raise RuntimeError(
                    f"region {self.name!r} is paused with its contents in the host backup; resume() first"
                )
            drop_backup(self._backup, self._views)
            self._backup = None

    def close(self) -> None:
        """Release the physical memory and the backup. Idempotent; allowed while paused.

        Work queued on the device is waited for first. Tensors carved from the Region must not be used
        afterwards; their address range is returned to the driver once the last of them is gone.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._settle()
            self._backend.synchronize()
            self._backend.close()
            self._state = [table.EMPTY] * len(self._chunks)
            self._paused = False
            drop_backup(self._backup, self._views)
            self._backup = None
            self._resume_done = None

    def __enter__(self) -> Region:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- sharing -------------------------------------------------------------------------------------
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

    # -- what it reports -----------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def nbytes(self) -> int:
        """Size of the range in bytes (after rounding up to the granularity)."""
        return self._nbytes

    @property
    def chunk_bytes(self) -> int:
        return self._chunk

    @property
    def used_bytes(self) -> int:
        """Bytes handed out by :meth:`empty` so far, alignment padding included."""
        return self._used

    @property
    def resident_bytes(self) -> int:
        """Bytes of physical memory currently mapped (falls chunk by chunk during a pause)."""
        return table.resident(self._chunks, self._state)

    @property
    def committed_bytes(self) -> int:
        """Bytes of memory the mapped chunks take now: what pausing gives back to the device. On a GPU, and
        on the plain host backend, :attr:`resident_bytes`; on a shareable host Region, the pages its own
        files hold, which a chunk gets page by page as it is first touched: a chunk mapped but never
        touched (a Region partly written, or resumed after ``pause(keep=False)``) takes none, so shared
        memory will not fall by it. The fences of :mod:`rlmem.colocate` wait for the device to get this
        back, not :attr:`resident_bytes`."""
        return table.committed(self._backend, self._chunks, self._state)

    @property
    def backup_bytes(self) -> int:
        """Bytes of host backup held (kept across cycles so later pauses pin nothing)."""
        b = self._backup
        return b.nbytes if b is not None and b.alive else 0

    @property
    def paused(self) -> bool:
        """True from a ``pause()`` call until the next ``resume()``."""
        return self._paused

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def data_ptr(self) -> int:
        """Address of the start of the range; fixed for the Region's life."""
        return self._ptr

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("paused" if self._paused else "resident")
        return (
            f"Region(name={self.name!r}, device={str(self._device)!r}, nbytes={self._nbytes}, "
            f"used={self._used}, {state})"
        )

    def stats(self) -> RegionStats:
        """A :class:`RegionStats` snapshot."""
        return RegionStats(
            name=self.name,
            device=str(self._device),
            nbytes=self._nbytes,
            chunk_bytes=self._chunk,
            used_bytes=self._used,
            resident_bytes=0 if self._closed else self.resident_bytes,
            backup_bytes=self.backup_bytes,
            paused=self._paused,
            **self._timings.figures(),
        )
