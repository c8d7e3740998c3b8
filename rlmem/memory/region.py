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

What this module owns: the Region's state (each chunk's state, paused or not, the backup, the operation in
flight) and the one lock under which its methods read and change it, deciding each step. The work is beside
it, called with what it needs while the lock is held (or on the worker thread of the operation in flight,
which the next operation joins first): the per-chunk loops of mapping, pause, resume and reattach
(``_chunks``), the device, backend and chunking (``_device``), tensors over the range (``_tensors``), the
handle and worker of a non-blocking operation (``_handle``), the backup's growth and views (``_backup``),
the sharing methods (``_shared_region``, its base class) and their descriptor work and refusals
(``sharing``), what it reports (``_region_info``, the base of that, which declares its state; ``_stats``).
The physical work is in the backends.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .._checks import check_flag
from .._units import round_up
from ..errors import RegionClosedError
from . import _chunks as table  # the chunk loops: run under the Region's lock (see _chunks)
from ._backup import BackupViews, check_kept, drop_backup, grow_backup
from ._device import check_sizes, chunking, make_backend, resolve_device
from ._handle import Handle, finish, note_copies, worker
from ._pinned import HostBuffer
from ._shared_region import SharedRegion
from ._stats import RegionStats, Timings
from ._tensors import check_request, check_room, span_of, tensor_over
from .backend import Backend
from .sharing import SharedLayout, check_pause, check_resume

# Handle and RegionStats are defined beside the mechanisms they belong to and published here as before.
__all__ = ["Handle", "Region", "RegionStats"]

_DEFAULT_ALIGN = 256


class Region(SharedRegion):
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
        self._backend: Backend = backend
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
        self._backup: HostBuffer | None = None
        self._views = BackupViews()  # cleared whenever the backup is replaced or freed
        self._op: Handle | None = None  # a non-blocking pause/resume whose worker may still run
        self._resume_done: Any = None  # event after the last resume's copies (CUDA)
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
