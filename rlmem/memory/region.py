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

What this module owns: the chunk state machine (mapped, saved, empty), the backup, the lock and the
operation in flight, as one mechanism: every method reads and changes all of them under one lock, and
splitting it would spread that invariant across files. The physical work is in the backends.
"""

from __future__ import annotations

import math
import os
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from .._checks import check_flag
from .._units import GiB, round_up
from ..errors import CudaError, OutOfMemoryError, RegionClosedError
from ._host import HostBackend, SharedHostBackend
from ._pinned import HostBuffer
from .backend import Backend
from .sharing import SharedLayout

__all__ = ["Handle", "Region", "RegionStats"]

# Default chunking: about _TARGET_CHUNKS chunks per region, each between the two bounds. Driver calls cost
# per chunk, not per byte: a 16 GiB discard cycle took 24 ms with 64 MiB chunks and 7 ms with 1 GiB chunks on
# an H100 (bench/results/vmm_calls-nvidia-h100-x1.json), while ~16 chunks keep release progressive and let
# mapping the next chunk overlap the copy of this one.
_TARGET_CHUNKS = 16
_MIN_CHUNK = 64 << 20
_MAX_CHUNK = 2 << 30
_DEFAULT_ALIGN = 256

# Chunk states.
_MAPPED = 0  # physical memory mapped; contents live on the device
_SAVED = 1  # released; contents kept in the host backup
_EMPTY = 2  # released; contents discarded


def _resolve_device(device: Any) -> torch.device:
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


def _make_backend(dev: torch.device, shareable: bool) -> Backend:
    if dev.type == "cpu":
        return SharedHostBackend() if shareable else HostBackend()
    from ._cuda import CudaBackend

    return CudaBackend(dev.index, shareable=shareable)


def _default_chunk(capacity: int, granularity: int) -> int:
    chunk = round_up(-(-capacity // _TARGET_CHUNKS), granularity)
    return max(_MIN_CHUNK, min(chunk, _MAX_CHUNK))


def _is_oom(e: BaseException) -> bool:
    from ._cuda import CUDA_ERROR_OUT_OF_MEMORY

    return isinstance(e, CudaError) and e.code == CUDA_ERROR_OUT_OF_MEMORY


@dataclass(frozen=True)
class RegionStats:
    """A snapshot of a Region's sizes and its last pause and resume.

    Times are wall-clock seconds from the call until the memory was released (pause) or the contents were
    back on the device (resume); ``*_gbps`` is bytes copied over that time, in GB/s (1e9 bytes per second).
    Figures of a non-blocking resume that has not finished yet are None.
    """

    name: str
    device: str
    nbytes: int
    chunk_bytes: int
    used_bytes: int
    resident_bytes: int
    backup_bytes: int
    paused: bool
    pauses: int
    resumes: int
    last_pause_kept: bool | None
    last_pause_bytes: int
    last_pause_s: float | None
    last_pause_gbps: float | None
    last_resume_bytes: int
    last_resume_s: float | None
    last_resume_gbps: float | None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class Handle:
    """Completion of a :meth:`Region.pause` or :meth:`Region.resume`.

    ``wait()`` makes the result usable by the caller: after a pause the memory has been released; after a
    resume the caller's current CUDA stream (or ``stream``) is ordered after the copies, without blocking
    the host, so work queued before it overlaps the copy. ``synchronize()`` blocks the host until all of it
    is done. A failure inside a non-blocking operation is raised by ``wait()`` and ``synchronize()``.
    ``wait_copied()`` orders a stream after a pause's copies to the backup (not its release).
    """

    def __init__(
        self,
        kind: str,
        *,
        thread: threading.Thread | None = None,
        event: Any = None,
        device: torch.device | None = None,
    ) -> None:
        self.kind = kind
        self._thread = thread
        self._event = event
        self._device = device
        self.error: BaseException | None = None
        self.observed = False
        self._copied: Any = None  # a pause's last copy to the backup (CUDA event), while it may be pending

    def done(self) -> bool:
        """True once the operation has completed (never blocks)."""
        if self._thread is not None and self._thread.is_alive():
            return False
        return self._event is None or bool(self._event.query())

    def _join(self) -> None:
        if self._thread is not None:
            self._thread.join()
        if self.error is not None:
            self.observed = True
            raise self.error

    def wait(self, stream: torch.cuda.Stream | None = None) -> None:
        """Order ``stream`` (default: the current stream) after the operation; see the class docstring."""
        self._join()
        if self._event is not None:
            (stream or torch.cuda.current_stream(self._device)).wait_event(self._event)

    def wait_copied(self, stream: torch.cuda.Stream | None = None) -> None:
        """After a pause: order ``stream`` (default: the current stream) after its copies to the host backup,
        without blocking the host. Work queued on it from then on that reads
        ``region.host_view(t, mapped=True)`` sees the kept bytes, while the release goes on in the background.
        On the host backend the copies are done when ``pause()`` returns."""
        if self._copied is not None:
            (stream or torch.cuda.current_stream(self._device)).wait_event(self._copied)

    def synchronize(self) -> None:
        """Block the host until the operation is complete."""
        self._join()
        if self._event is not None:
            self._event.synchronize()

    def __repr__(self) -> str:
        return f"<rlmem.Handle {self.kind} {'done' if self.done() else 'pending'}>"


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
        if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes <= 0:
            raise ValueError(f"nbytes must be a positive int, got {nbytes!r}")
        if chunk_bytes is not None and (
            not isinstance(chunk_bytes, int) or isinstance(chunk_bytes, bool) or chunk_bytes <= 0
        ):
            raise ValueError(f"chunk_bytes must be a positive int or None, got {chunk_bytes!r}")
        if not isinstance(name, str):
            raise ValueError(f"name must be a str, got {type(name).__name__}")
        self.name = name
        self._lock = threading.RLock()
        self._closed = True  # until fully built, so a failed construction leaves nothing usable
        dev = _resolve_device(device)
        backend = _make_backend(dev, shareable)
        gran = backend.granularity
        capacity = round_up(nbytes, gran)
        chunk = round_up(chunk_bytes, gran) if chunk_bytes else _default_chunk(capacity, gran)
        chunk = min(chunk, capacity)
        self._device = dev
        self._backend: Backend = backend
        self._nbytes = capacity
        self._chunk = chunk
        self._chunks = [(off, min(chunk, capacity - off)) for off in range(0, capacity, chunk)]
        self._state = [_EMPTY] * len(self._chunks)
        self._shareable = shareable
        self._peer = files is not None
        self._generation = 0 if files is None else files[0].generation
        backend.open(capacity)
        try:
            if files is not None:
                self._map_files(*files)
            elif not paused:
                self._map_chunks(range(len(self._chunks)), what="Region()")
        except BaseException:
            backend.destroy()  # no tensor exists yet: the address range can go at once
            raise
        self._state = [_EMPTY if paused else _MAPPED] * len(self._chunks)
        self._ptr = backend.ptr
        self._used = 0 if files is None else files[0].used_bytes
        self._paused = paused
        self._backup: HostBuffer | None = None
        self._views: dict[tuple, torch.Tensor] = {}  # host views of the backup, see _view_of_backup
        self._op: Handle | None = None  # a non-blocking pause/resume whose worker may still run
        self._resume_done: Any = None  # event after the last resume's copies (CUDA)
        self._pauses = 0
        self._resumes = 0
        self._last_pause: dict[str, Any] = {"kept": None, "bytes": 0, "s": None}
        self._last_resume: dict[str, Any] = {"bytes": 0, "s": None, "events": None}
        self._closed = False

    # -- properties ----------------------------------------------------------------------------------
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
        return sum(size for (_, size), st in zip(self._chunks, self._state, strict=True) if st == _MAPPED)

    @property
    def committed_bytes(self) -> int:
        """Bytes of memory the mapped chunks take now: what pausing gives back to the device. On a GPU, and
        on the plain host backend, :attr:`resident_bytes`; on a shareable host Region, the pages its own
        files hold, which a chunk gets page by page as it is first touched: a chunk mapped but never
        touched (a Region partly written, or resumed after ``pause(keep=False)``) takes none, so shared
        memory will not fall by it. The fences of :mod:`rlmem.colocate` wait for the device to get this
        back, not :attr:`resident_bytes`."""
        backend = self._backend
        return sum(
            backend.committed(off)  # type: ignore[attr-defined]
            for (off, _), st in zip(self._chunks, self._state, strict=True)
            if st == _MAPPED
        )

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
        dims = (shape,) if isinstance(shape, int) else tuple(shape)
        if any(not isinstance(d, int) or isinstance(d, bool) or d < 0 for d in dims):
            raise ValueError(f"shape must be an int or a sequence of non-negative ints, got {shape!r}")
        if dtype is None:
            dtype = torch.get_default_dtype()
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"dtype must be a torch.dtype, got {dtype!r}")
        if not isinstance(align, int) or align <= 0 or align & (align - 1):
            raise ValueError(f"align must be a positive power of two, got {align!r}")
        itemsize = torch.empty((), dtype=dtype).element_size()
        need = math.prod(dims) * itemsize
        with self._lock:
            offset = round_up(self._used, max(align, itemsize))
            if offset + need > self._nbytes:
                raise ValueError(
                    f"Region {self.name!r} is out of room: empty({list(dims)}, {dtype}) needs {need} "
                    f"bytes at offset {offset}, but only {max(self._nbytes - offset, 0)} of "
                    f"{self._nbytes} bytes are left"
                )
            self._used = offset + need
        if need == 0:
            return torch.empty(dims, dtype=dtype, device=self._device)
        return self._backend.tensor_at(offset, need).view(dtype).view(dims)

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
        if keep and self._peer:
            raise ValueError(
                f"keep=True: region {self.name!r} is attached to another process's memory, which that "
                "process keeps or discards; a peer pauses with keep=False (unmapped, its addresses kept)"
            )
        if on_queued is not None and not callable(on_queued):
            raise ValueError(f"on_queued must be callable or None, got {type(on_queued).__name__}")
        with self._lock:
            self._check_open()
            op = self._op
            if op is not None and op.kind == "pause" and not op.done():
                return op
            self._settle()
            if self._paused and _MAPPED not in self._state:
                return Handle("pause")
            # Paused with chunks still mapped happens only after a failed pause: release what is left.
            t0 = time.perf_counter()
            saved = [
                i
                for i, (off, _) in enumerate(self._chunks)
                if keep and off < self._used and self._state[i] == _MAPPED
            ]
            if saved:
                off, size = self._chunks[saved[-1]]
                self._ensure_backup(off + size)  # may raise: nothing released yet
            after = self._backend.order(self._resume_done)
            if not self._paused:
                self._pauses += 1
            self._paused = True
            self._last_pause = {"kept": keep, "bytes": 0, "s": None}
            events = self._copy_out(saved, after)
            handle = Handle("pause", device=self._device)
            handle._copied = events[saved[-1]] if saved else None
            if on_queued is not None:
                on_queued(handle)
            if blocking:
                self._release_work(events, after, t0)
                handle._copied = None
                return handle
            return self._start_op("pause", self._release_work, events, after, t0, handle=handle)

    def _copy_out(self, saved: list[int], after: Any) -> dict[int, Any]:
        """Queue (GPU) or make (host) the copies of saved chunks to the backup; returns their events."""
        backup = self._backup
        events: dict[int, Any] = {}
        if saved:
            assert backup is not None and backup.tensor is not None
            self._backend.begin_out(after)
            for i in saved:
                off, size = self._chunks[i]
                events[i] = self._backend.copy_out(off, size, backup.tensor[off : off + size])
        return events

    def _release_work(self, events: dict[int, Any], after: Any, t0: float) -> None:
        backend = self._backend
        copied = 0
        backend.wait(after)
        for i, (off, size) in enumerate(self._chunks):
            if self._state[i] != _MAPPED:
                continue
            if i in events:
                backend.wait(events[i])
                backend.unmap(off)
                self._state[i] = _SAVED
                copied += size
            else:
                backend.unmap(off)
                self._state[i] = _EMPTY
        self._last_pause["bytes"] = copied
        self._last_pause["s"] = time.perf_counter() - t0

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
        b = self._backup
        if b is not None and b.alive and b.nbytes >= nbytes:
            return
        new = HostBuffer(nbytes, device_index=self._device.index if self._backend.pinned_backup else None)
        self._views.clear()
        if b is not None:
            if _SAVED in self._state and b.alive:  # a part-way pause left contents only in the old backup
                assert new.tensor is not None and b.tensor is not None
                new.tensor[: b.nbytes].copy_(b.tensor)
            b.free()
        self._backup = new

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
            if not self._paused:
                raise RuntimeError(
                    f"region {self.name!r} is resident: read the tensor itself "
                    "(host_view is for a paused region)"
                )
            lost = [
                i
                for i, (coff, size) in enumerate(self._chunks)
                if coff < off + extent and off < coff + size and self._state[i] != _SAVED
            ]
            if lost:
                raise RuntimeError(
                    f"region {self.name!r}: bytes {off}..{off + extent} were not kept "
                    "(paused with keep=False, or a pause that failed part-way); there is nothing to read"
                )
            return self._view_of_backup(tensor, off, extent, mapped)

    def span(self, tensor: Any) -> tuple[int, int]:
        """(offset from the Region's start, bytes spanned) of ``tensor``, a tensor over the Region.

        Raises:
            ValueError: ``tensor`` is not a tensor over this Region.
        """
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(
                f"tensor must be a torch.Tensor over region {self.name!r}, got {type(tensor).__name__}"
            )
        extent = 0
        if tensor.numel():
            last = sum((n - 1) * st for n, st in zip(tensor.shape, tensor.stride(), strict=True))
            extent = (last + 1) * tensor.element_size()
        off = tensor.data_ptr() - self._ptr
        if extent == 0 and tensor.device == self._device:
            return 0, 0  # no bytes: nothing to keep or to read
        if tensor.device != self._device or off < 0 or off + extent > self._nbytes:
            raise ValueError(
                f"tensor (shape {tuple(tensor.shape)}, {tensor.dtype}, on {tensor.device}) does not lie in "
                f"region {self.name!r} ({self._nbytes} bytes on {self._device})"
            )
        return off, extent

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
        return self._view_of_backup(tensor, off, extent, mapped)

    def _view_of_backup(self, tensor: torch.Tensor, off: int, extent: int, mapped: bool) -> torch.Tensor:
        """``tensor``'s geometry over the backup at ``off``, unchecked (the bytes are known to be there).

        Views are cached for the backup's life: the same tensors serve every pause (a trainer offloads the
        same state every step), and each has a storage of its own, as the Region's tensors do."""
        backup = self._backup
        assert backup is not None and backup.tensor is not None
        mapped = mapped and backup.pinned
        key = (off, extent, tensor.dtype, tuple(tensor.shape), tuple(tensor.stride()), mapped)
        view = self._views.get(key)
        if view is None:
            if extent == 0:
                view = torch.empty(tensor.shape, dtype=tensor.dtype, device=self._device if mapped else "cpu")
            else:
                flat = backup.device_view(off, extent) if mapped else backup.host_view(off, extent)
                view = flat.view(tensor.dtype).as_strided(tensor.shape, tensor.stride())
            self._views[key] = view
        return view

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
            if self._peer:
                raise RuntimeError(
                    f"region {self.name!r} is attached to another process's memory: map the owner's memory "
                    "again with reattach(layout, fds) from its export() after it resumed"
                )
            t0 = time.perf_counter()
            if not blocking and not self._backend.asynchronous:
                return self._start_op("resume", self._resume_work, t0, True)
            done = self._resume_work(t0, blocking)
            return Handle("resume", event=None if blocking else done, device=self._device)

    def _resume_work(self, t0: float, blocking: bool) -> Any:
        backend = self._backend
        backup = self._backup
        todo = [i for i, st in enumerate(self._state) if st != _MAPPED]
        start = backend.mark_in(timing=True)
        copied = 0

        def restore(i: int) -> None:
            nonlocal copied
            if self._state[i] == _SAVED:
                assert backup is not None and backup.tensor is not None
                off, size = self._chunks[i]
                backend.copy_in(off, size, backup.tensor[off : off + size])
                copied += size

        # Map and copy chunk by chunk, so mapping the next chunk overlaps the copy of this one.
        self._map_chunks(todo, what="resume()", on_mapped=restore)
        done = backend.mark_in(timing=True)
        for i in todo:
            self._state[i] = _MAPPED
        self._paused = False
        self._resumes += 1
        self._generation += 1  # new physical memory: peers map it again from the next export()
        self._resume_done = done
        if blocking:
            backend.wait(done)
            self._last_resume = {"bytes": copied, "s": time.perf_counter() - t0, "events": None}
        else:
            self._last_resume = {"bytes": copied, "s": None, "events": (start, done)}
        return done

    def _map_chunks(
        self, indices: Sequence[int] | range, *, what: str, on_mapped: Callable[[int], None] | None = None
    ) -> None:
        """Map the given chunks; on failure unmap those this call mapped and raise (states untouched)."""
        backend = self._backend
        mapped: list[int] = []
        try:
            for i in indices:
                off, size = self._chunks[i]
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
                backend.unmap(self._chunks[i][0])
            if _is_oom(e):
                needed = sum(self._chunks[i][1] for i in indices)
                free, _ = backend.mem_info()
                raise OutOfMemoryError(
                    f"{what} of region {self.name!r} needs {needed / GiB:.3f} GiB of device memory on "
                    f"{self._device}, but only {free / GiB:.3f} GiB is free"
                    + (
                        "; the region stays paused with its contents kept: "
                        "free memory and call resume() again"
                        if what == "resume()"
                        else ""
                    ),
                    needed=needed,
                    free=free,
                    device=str(self._device),
                ) from e
            raise

    # -- sharing with other processes ---------------------------------------------------------------
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
            if not self._shareable or self._peer:
                raise ValueError(
                    f"region {self.name!r} cannot be exported: "
                    + (
                        "it is attached to another process's memory"
                        if self._peer
                        else "make it with shareable=True"
                    )
                )
            if self._paused:
                raise RuntimeError(f"region {self.name!r} is paused: resume() it before export()")
            fds: list[int] = []
            try:
                for off, _ in self._chunks:
                    fds.append(self._backend.export_file(off))  # type: ignore[attr-defined]
            except BaseException:
                for fd in fds:
                    os.close(fd)
                raise
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
    def attach(cls, layout: SharedLayout, fds: Sequence[int], *, name: str | None = None) -> Region:
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
            if not self._peer:
                raise RuntimeError(f"region {self.name!r} is not attached to another process's memory")
            if not self._paused:
                raise RuntimeError(f"region {self.name!r} is mapped: pause(keep=False) it before reattach()")
            self._map_files(layout, list(fds))
            self._paused = False
            self._generation = layout.generation
            self._resumes += 1

    def _map_files(self, layout: SharedLayout, fds: list[int]) -> None:
        """Map each chunk's file at its offset, once every descriptor has been checked against its chunk;
        on failure unmap what this call mapped and raise (states untouched)."""
        if tuple(self._chunks) != tuple(layout.chunks) or self._nbytes != layout.nbytes:
            raise ValueError(
                f"layout of region {layout.name!r} ({layout.nbytes} bytes in {len(layout.chunks)} chunks) "
                f"does not match this one's ({self._nbytes} bytes in {len(self._chunks)} chunks)"
            )
        self._check_files(fds)
        done: list[int] = []
        try:
            for i, ((off, size), fd) in enumerate(zip(self._chunks, fds, strict=True)):
                try:
                    self._backend.map_file(off, size, fd)  # type: ignore[attr-defined]
                except ValueError as e:
                    raise ValueError(self._file_mismatch(i, str(e))) from e
                done.append(i)
        except BaseException:
            for i in done:
                self._backend.unmap(self._chunks[i][0])
            raise
        self._state = [_MAPPED] * len(self._chunks)

    def _check_files(self, fds: list[int]) -> None:
        """Check every descriptor against its chunk before any is mapped: one per chunk, open, and holding
        the chunk's size where the backend can read it (a host file shorter than its chunk would be mapped
        past its end, where the first touch kills the process with SIGBUS).

        Raises:
            ValueError: naming the first chunk (index, offset) whose descriptor does not fit, with the bytes
                expected and found.
        """
        if len(fds) != len(self._chunks):
            raise ValueError(
                f"fds: {len(fds)} descriptors for the {len(self._chunks)} chunks of region {self.name!r}; "
                "one per chunk, in the layout's order"
            )
        for i, ((_, size), fd) in enumerate(zip(self._chunks, fds, strict=True)):
            if not isinstance(fd, int) or isinstance(fd, bool) or fd < 0:
                raise ValueError(self._file_mismatch(i, f"fds[{i}] must be a file descriptor, got {fd!r}"))
            try:
                got = self._backend.file_bytes(fd)  # type: ignore[attr-defined]
            except (OSError, ValueError) as e:
                raise ValueError(self._file_mismatch(i, f"fds[{i}] cannot be mapped: {e}")) from e
            if got is not None and got != size:
                raise ValueError(self._file_mismatch(i, f"its descriptor fds[{i}] holds {got} bytes"))

    def _file_mismatch(self, index: int, why: str) -> str:
        """The one message form of a descriptor that does not fit its chunk."""
        off, size = self._chunks[index]
        return (
            f"fds do not match the layout of region {self.name!r}: chunk {index} at offset {off} expects "
            f"{size} bytes, but {why}; nothing is left mapped (are these another Region's descriptors?)"
        )

    def view(self, offset: int, shape: int | Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """A tensor of ``shape`` and ``dtype`` at byte ``offset`` of the Region (the owner's tensors are at
        ``span(t)[0]``; an attached Region's tensors are views at the same offsets).

        Raises:
            ValueError: out of the Region, or not aligned for ``dtype``.
            RuntimeError: the Region is paused.
        """
        self._check_open()
        dims = (shape,) if isinstance(shape, int) else tuple(shape)
        itemsize = torch.empty((), dtype=dtype).element_size()
        need = math.prod(dims) * itemsize
        if offset < 0 or offset % itemsize or offset + need > self._nbytes:
            raise ValueError(
                f"view({offset}, {list(dims)}, {dtype}) does not fit region {self.name!r} "
                f"({self._nbytes} bytes) at an offset aligned to {itemsize}"
            )
        if self._paused:
            raise RuntimeError(f"region {self.name!r} is paused: its memory is not there to view")
        if need == 0:
            return torch.empty(dims, dtype=dtype, device=self._device)
        return self._backend.tensor_at(offset, need).view(dtype).view(dims)

    # -- lifecycle -----------------------------------------------------------------------------------
    def _start_op(
        self, kind: str, fn: Callable[..., Any], *args: Any, handle: Handle | None = None
    ) -> Handle:
        """Run ``fn(*args)`` on a worker thread as the Region's operation in flight; the next operation
        joins it first (``_settle``)."""
        handle = handle or Handle(kind, device=self._device)
        thread = threading.Thread(
            target=self._run_worker, args=(handle, fn, *args), name=f"rlmem-{kind}-{self.name}", daemon=True
        )
        handle._thread = thread
        self._op = handle
        thread.start()
        return handle

    def _run_worker(self, handle: Handle, fn: Callable[..., Any], *args: Any) -> None:
        try:
            self._backend.thread_setup()
            fn(*args)
        except BaseException as e:
            handle.error = e

    def _settle(self) -> None:
        """Finish a non-blocking operation still in flight before starting another."""
        op = self._op
        if op is None:
            return
        self._op = None
        if op._thread is not None:
            op._thread.join()
        if op.error is not None and not op.observed:
            op.observed = True
            warnings.warn(
                f"a non-blocking {op.kind}() of region {self.name!r} failed and nobody waited for it: "
                f"{op.error!r}; the region's chunks are left in a consistent state",
                RuntimeWarning,
                stacklevel=3,
            )

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
            if any(st == _SAVED for st in self._state):
                raise RuntimeError(
                    f"region {self.name!r} is paused with its contents in the host backup; resume() first"
                )
            if self._backup is not None:
                self._views.clear()
                self._backup.free()
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
            self._state = [_EMPTY] * len(self._chunks)
            self._paused = False
            self._views.clear()
            if self._backup is not None:
                self._backup.free()
                self._backup = None
            self._resume_done = None

    def __enter__(self) -> Region:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- stats ---------------------------------------------------------------------------------------
    def stats(self) -> RegionStats:
        """A :class:`RegionStats` snapshot."""
        lr = self._last_resume
        if lr["s"] is None and lr["events"] is not None:
            start, done = lr["events"]
            if done.query():
                lr["s"] = start.elapsed_time(done) / 1e3
                lr["events"] = None
        lp = self._last_pause
        return RegionStats(
            name=self.name,
            device=str(self._device),
            nbytes=self._nbytes,
            chunk_bytes=self._chunk,
            used_bytes=self._used,
            resident_bytes=0 if self._closed else self.resident_bytes,
            backup_bytes=self.backup_bytes,
            paused=self._paused,
            pauses=self._pauses,
            resumes=self._resumes,
            last_pause_kept=lp["kept"],
            last_pause_bytes=lp["bytes"],
            last_pause_s=lp["s"],
            last_pause_gbps=_gbps(lp["bytes"], lp["s"]),
            last_resume_bytes=lr["bytes"],
            last_resume_s=lr["s"],
            last_resume_gbps=_gbps(lr["bytes"], lr["s"]),
        )


def _gbps(nbytes: int, seconds: float | None) -> float | None:
    if seconds is None or nbytes == 0 or seconds <= 0:
        return None
    return nbytes / seconds / 1e9
