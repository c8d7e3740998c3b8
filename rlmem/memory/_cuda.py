"""Checked wrappers over ``cuda.bindings.driver`` and the CUDA backend of :class:`rlmem.Region`.

The driver module is imported on first use, so ``import rlmem`` works on machines without a GPU or driver.
Physical memory is managed with CUDA virtual memory management: a virtual range is reserved once and physical
chunks are created, mapped and released under it, so addresses never move.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from ..errors import CudaError

_driver: Any = None
_lock = threading.RLock()  # copy_streams retains the primary context while holding it
_primary_ctx: dict[int, Any] = {}
_streams: dict[tuple[int, str], tuple[torch.cuda.Stream, torch.cuda.Stream]] = {}
_stream_handles: list[Any] = []

CUDA_ERROR_INVALID_VALUE = 1
CUDA_ERROR_OUT_OF_MEMORY = 2
CUDA_ERROR_NOT_SUPPORTED = 801
# What cuMemMap answers to a size past the end of the memory it is given: NOT_SUPPORTED (H100, driver 580;
# measured), INVALID_VALUE by its documentation's list. Either way it maps nothing.
_MAP_REFUSED = (CUDA_ERROR_INVALID_VALUE, CUDA_ERROR_NOT_SUPPORTED)


def driver() -> Any:
    """Return ``cuda.bindings.driver``, importing it and calling ``cuInit`` the first time."""
    global _driver
    if _driver is None:
        with _lock:
            if _driver is None:
                try:
                    from cuda.bindings import driver as d
                except ImportError as e:  # pragma: no cover - depends on the install
                    raise RuntimeError(
                        "rlmem's CUDA backend needs the 'cuda-bindings' package (pip install cuda-bindings)"
                    ) from e
                _check("cuInit", d.cuInit(0), d)
                _driver = d
    return _driver


def _check(name: str, result: Any, d: Any) -> Any:
    err = result[0]
    if err != d.CUresult.CUDA_SUCCESS:
        code = int(err)
        text = "unknown error"
        try:
            res = d.cuGetErrorString(err)
            if res[0] == d.CUresult.CUDA_SUCCESS and res[1]:
                text = res[1].decode() if isinstance(res[1], bytes) else str(res[1])
        except Exception:
            pass
        raise CudaError(name, code, text)
    if len(result) == 1:
        return None
    if len(result) == 2:
        return result[1]
    return result[1:]


def call(name: str, *args: Any) -> Any:
    """Call driver function ``name`` and raise :class:`rlmem.errors.CudaError` unless it succeeds."""
    d = driver()
    return _check(name, getattr(d, name)(*args), d)


def primary_context(index: int) -> Any:
    """The primary context of device ``index``: the one PyTorch's runtime uses."""
    ctx = _primary_ctx.get(index)
    if ctx is None:
        with _lock:
            ctx = _primary_ctx.get(index)
            if ctx is None:
                dev = call("cuDeviceGet", index)
                ctx = call("cuDevicePrimaryCtxRetain", dev)
                _primary_ctx[index] = ctx
    return ctx


@contextmanager
def context(index: int) -> Iterator[None]:
    """Make device ``index``'s primary context current for driver calls, restoring the caller's after."""
    call("cuCtxPushCurrent", primary_context(index))
    try:
        yield
    finally:
        call("cuCtxPopCurrent")


def copy_streams(index: int, role: str = "region") -> tuple[torch.cuda.Stream, torch.cuda.Stream]:
    """The dedicated (device-to-host, host-to-device) copy streams of device ``index`` for ``role``.

    Region copies and activation copies get their own pairs, so neither waits behind the other.

    Two streams, so an offload and a reload can use both directions of the link at once. They are made
    with the driver and wrapped, not taken from PyTorch's stream pool: the pool's first use creates all of
    its streams, which cost 70 MiB of device memory on an H100 (measured), in a process that may need none.
    """
    pair = _streams.get((index, role))
    if pair is None:
        d = driver()
        with _lock:
            pair = _streams.get((index, role))
            if pair is None:
                made = []
                with context(index):
                    for _ in range(2):
                        s = call("cuStreamCreate", d.CUstream_flags.CU_STREAM_NON_BLOCKING)
                        _stream_handles.append(s)  # lives as long as the process
                        made.append(torch.cuda.ExternalStream(int(s), device=torch.device("cuda", index)))
                pair = (made[0], made[1])
                _streams[(index, role)] = pair
    return pair


def host_register(ptr: int, nbytes: int, index: int) -> None:
    """Page-lock ``nbytes`` of host memory at ``ptr`` for DMA, usable from every context and mapped into the
    devices' address space (kernels can read and write it over the link)."""
    d = driver()
    with context(index):
        call("cuMemHostRegister", ptr, nbytes, d.CU_MEMHOSTREGISTER_PORTABLE | d.CU_MEMHOSTREGISTER_DEVICEMAP)


def host_device_pointer(ptr: int, index: int) -> int:
    """The device address of registered host memory at ``ptr`` (the same value on unified-addressing
    systems, H100 included)."""
    with context(index):
        return int(call("cuMemHostGetDevicePointer", ptr, 0))


def mapped_tensor(device_ptr: int, nbytes: int, index: int, owner: object) -> torch.Tensor:
    """A uint8 tensor of device ``index`` over ``nbytes`` of registered host memory at the device address
    ``device_ptr`` (see :func:`host_device_pointer`); it keeps ``owner`` alive."""
    t = torch.as_tensor(_CudaArray(device_ptr, nbytes, owner), device=torch.device("cuda", index))
    assert t.device.index == index
    return t


def host_unregister(ptr: int, index: int) -> None:
    with context(index):
        call("cuMemHostUnregister", ptr)


class _CudaArray:
    """Exposes a device range through ``__cuda_array_interface__`` and keeps its owner alive."""

    __slots__ = ("__cuda_array_interface__", "owner")

    def __init__(self, ptr: int, nbytes: int, owner: object) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (ptr, False),
            "strides": None,
            "version": 2,
        }
        self.owner = owner


class CudaBackend:
    """Physical memory of one Region on one CUDA device, managed chunk by chunk.

    The object owns the virtual reservation: the Region's base tensor keeps it alive, so the address range is
    freed only once the Region and every tensor carved from it are gone (a freed range could be handed to
    another allocation while stale views still point into it).
    """

    kind = "cuda"
    asynchronous = True
    pinned_backup = True

    def __init__(self, index: int, shareable: bool = False) -> None:
        d = driver()
        torch.cuda.init()
        self.index = index
        self.device = torch.device("cuda", index)
        loc = d.CUmemLocation()
        loc.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        loc.id = index
        prop = d.CUmemAllocationProp()
        prop.type = d.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location = loc
        self._fd_type = d.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        if shareable:  # the handle type must be asked for when the memory is made, or it cannot be exported
            prop.requestedHandleTypes = self._fd_type
        access = d.CUmemAccessDesc()
        access.location = loc
        access.flags = d.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        self._prop = prop
        self._access = [access]
        with context(index):
            self.granularity = int(
                call(
                    "cuMemGetAllocationGranularity",
                    prop,
                    d.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED,
                )
            )
        self._d2h, self._h2d = copy_streams(index)
        self._d2h_handle = d.CUstream(self._d2h.cuda_stream)
        self._h2d_handle = d.CUstream(self._h2d.cuda_stream)
        self._ptr = 0
        self._size = 0
        self._handles: dict[int, tuple[Any, int]] = {}

    # -- address range -------------------------------------------------------------------------------
    def open(self, nbytes: int) -> None:
        """Reserve ``nbytes`` of virtual addresses (nothing is mapped yet)."""
        with context(self.index):
            self._ptr = int(call("cuMemAddressReserve", nbytes, self.granularity, 0, 0))
        self._size = nbytes

    def tensor_at(self, offset: int, nbytes: int) -> torch.Tensor:
        """A uint8 tensor with a storage of its own over ``nbytes`` at ``offset``; call once that part of the
        range is mapped (torch reads the pointer's device from the mapping)."""
        t = torch.as_tensor(_CudaArray(self._ptr + offset, nbytes, self), device=self.device)
        assert t.data_ptr() == self._ptr + offset and t.device == self.device
        return t

    @property
    def ptr(self) -> int:
        return self._ptr

    # -- physical chunks -----------------------------------------------------------------------------
    def map(self, offset: int, size: int) -> None:
        """Create ``size`` bytes of physical memory and map them at ``offset``; undo on failure."""
        with context(self.index):
            self._map_handle(offset, size, call("cuMemCreate", size, self._prop, 0))

    def file_bytes(self, fd: int) -> None:
        """Check the exported descriptor ``fd`` before anything is mapped: open, CUDA memory, and on this
        device. Its size cannot be read: returns None.

        The driver API has no call that gives the size of an imported allocation handle:
        ``cuMemGetAllocationPropertiesFromHandle`` gives its type, location and handle types (the location
        is checked here), ``cuMemGetAllocationGranularity`` the device's granularity, not the handle's size,
        and ``cuMemGetAddressRange`` finds nothing of these mappings (measured). A descriptor of smaller
        memory is refused by ``cuMemMap`` in :meth:`map_file` instead, with an error and not a fault (see
        ``_MAP_REFUSED``), and ``Region`` unmaps what it had mapped.

        Raises:
            OSError: ``fd`` is not an open descriptor.
            ValueError: it is not CUDA memory exported as a POSIX descriptor, or not on this device.
        """
        os.fstat(fd)  # a closed descriptor is EBADF here, not a driver error
        d = driver()
        with context(self.index):
            try:
                handle = call("cuMemImportFromShareableHandle", fd, self._fd_type)
            except CudaError as e:
                raise ValueError(f"it is not CUDA memory exported as a POSIX descriptor ({e})") from e
            try:
                prop = call("cuMemGetAllocationPropertiesFromHandle", handle)
            finally:
                call("cuMemRelease", handle)
        loc = prop.location
        if loc.type != d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE or int(loc.id) != self.index:
            raise ValueError(f"its memory is at {loc.type!r} {int(loc.id)}, not on cuda:{self.index}")
        return None

    def map_file(self, offset: int, size: int, fd: int) -> None:
        """Map another process's chunk, exported as the POSIX file descriptor ``fd``, at ``offset`` (``fd``
        may be closed after); undo on failure.

        Raises:
            ValueError: the driver refused to map ``size`` bytes of it (its memory is smaller).
        """
        with context(self.index):
            handle = call("cuMemImportFromShareableHandle", fd, self._fd_type)
            try:
                self._map_handle(offset, size, handle)
            except CudaError as e:
                if e.call != "cuMemMap" or e.code not in _MAP_REFUSED:
                    raise
                raise ValueError(f"the driver refused to map {size} bytes of it (less memory?): {e}") from e

    def committed(self, offset: int) -> int:
        """Bytes of device memory the chunk at ``offset`` takes: all of it (``cuMemCreate`` makes it
        whole)."""
        entry = self._handles.get(offset)
        return 0 if entry is None else entry[1]

    def _map_handle(self, offset: int, size: int, handle: Any) -> None:
        """Map physical memory ``handle`` at ``offset`` with read-write access; on failure unmap it and
        release the handle. Called with the device's context current."""
        ptr = self._ptr + offset
        try:
            call("cuMemMap", ptr, size, 0, handle, 0)
            try:
                call("cuMemSetAccess", ptr, size, self._access, 1)
            except BaseException:
                call("cuMemUnmap", ptr, size)
                raise
        except BaseException:
            call("cuMemRelease", handle)
            raise
        self._handles[offset] = (handle, size)

    def export_file(self, offset: int) -> int:
        """A POSIX file descriptor of the chunk at ``offset`` for another process (the caller closes it)."""
        handle, _ = self._handles[offset]
        with context(self.index):
            return int(call("cuMemExportToShareableHandle", handle, self._fd_type, 0))

    def unmap(self, offset: int) -> None:
        """Unmap the chunk at ``offset`` and release this process's handle of its physical memory (freed
        once every process that imported it has released it too)."""
        handle, size = self._handles.pop(offset)
        with context(self.index):
            call("cuMemUnmap", self._ptr + offset, size)
            call("cuMemRelease", handle)

    def mem_info(self) -> tuple[int, int]:
        """(free, total) bytes of the device."""
        with context(self.index):
            free, total = call("cuMemGetInfo")
        return int(free), int(total)

    def reclaim_cache(self) -> None:
        """Return PyTorch's cached, unused blocks to the driver (before retrying a failed map)."""
        with torch.cuda.device(self.index):
            torch.cuda.empty_cache()

    # -- ordering and copies -------------------------------------------------------------------------
    def thread_setup(self) -> None:
        torch.cuda.set_device(self.index)

    def order(self, extra: torch.cuda.Event | None = None) -> list[torch.cuda.Event]:
        """Events marking the work queued so far on the caller's current stream (and ``extra``)."""
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.device))
        return [ev] if extra is None else [ev, extra]

    def wait(self, token: Any) -> None:
        if token is None:
            return
        for ev in token if isinstance(token, list) else [token]:
            ev.synchronize()

    def begin_out(self, after: list[torch.cuda.Event]) -> None:
        for ev in after:
            self._d2h.wait_event(ev)

    def copy_out(self, offset: int, size: int, host: torch.Tensor) -> torch.cuda.Event:
        """Queue a copy of the chunk at ``offset`` to pinned ``host``; return its completion event."""
        with context(self.index):
            call("cuMemcpyDtoHAsync", host.data_ptr(), self._ptr + offset, size, self._d2h_handle)
        ev = torch.cuda.Event()
        ev.record(self._d2h)
        return ev

    def copy_in(self, offset: int, size: int, host: torch.Tensor) -> None:
        with context(self.index):
            call("cuMemcpyHtoDAsync", self._ptr + offset, host.data_ptr(), size, self._h2d_handle)

    def mark_in(self, timing: bool = False) -> torch.cuda.Event:
        """An event on the host-to-device stream after the copies queued so far."""
        ev = torch.cuda.Event(enable_timing=timing)
        ev.record(self._h2d)
        return ev

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    # -- teardown -------------------------------------------------------------------------------------
    def close(self) -> None:
        """Release every mapped chunk. The address range itself is freed with this object."""
        for offset in list(self._handles):
            self.unmap(offset)

    def destroy(self) -> None:
        """Release every chunk and free the address range now: only when no tensor views it."""
        self.close()
        if self._ptr:
            with context(self.index):
                call("cuMemAddressFree", self._ptr, self._size)
            self._ptr = 0

    def __del__(self) -> None:
        # Runs when the Region and every view of it are gone; at interpreter exit the driver may be gone too.
        try:
            if self._handles:
                torch.cuda.synchronize(self.device)
            self.destroy()
        except Exception:
            pass
