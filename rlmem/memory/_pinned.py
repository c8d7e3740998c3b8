"""Host buffers for kept pauses: allocated once, reused across cycles, page-locked for CUDA.

Making pinned memory ready is dominated by page population, not by the pinning itself (docs/design.md,
reference figures:
``torch.empty(16 GiB, pin_memory=True)`` 5.3 s; anonymous mmap with transparent huge pages, populated by
many threads, then ``cuMemHostRegister``: 0.64 s). So a buffer is an anonymous private mapping, advised
to use huge pages, populated by PyTorch's parallel fill, then registered with the driver.
"""

from __future__ import annotations

import mmap
import os
import threading
import weakref

import torch

from .._units import GiB
from ..errors import HostOutOfMemoryError

_HUGE = 2 << 20
_lock = threading.Lock()
_held = {"pinned": 0, "pageable": 0}


def host_memory_held() -> dict[str, int]:
    """Bytes of host memory rlmem holds in backup buffers, as ``{"pinned": n, "pageable": m}``."""
    with _lock:
        return dict(_held)


def _account(nbytes: int, pinned: bool) -> None:
    with _lock:
        _held["pinned" if pinned else "pageable"] += nbytes


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def available_host_bytes() -> int | None:
    """Host memory this process can still take: ``MemAvailable``, bounded by a cgroup v2 limit if any.

    Returns None where neither can be read (non-Linux), meaning: unknown.
    """
    avail = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
                    break
    except OSError:
        pass
    limit = _read_int("/sys/fs/cgroup/memory.max")
    used = _read_int("/sys/fs/cgroup/memory.current")
    if limit is not None and used is not None:
        room = max(limit - used, 0)
        avail = room if avail is None else min(avail, room)
    return avail


def _check_available(nbytes: int) -> None:
    # Anonymous mappings overcommit: without this check a backup larger than the host's memory would be
    # "allocated" and the process killed while populating it, after the caller was told it succeeded.
    if os.environ.get("RLMEM_HOST_MEMORY_CHECK", "1") == "0":
        return
    avail = available_host_bytes()
    if avail is not None and nbytes > avail:
        raise HostOutOfMemoryError(
            f"a host backup of {nbytes / GiB:.3f} GiB is needed but only {avail / GiB:.3f} GiB of host "
            "memory is available; nothing was released (free host memory, pause with keep=False, or set "
            "RLMEM_HOST_MEMORY_CHECK=0 if the host grows its memory on demand)",
            needed=nbytes,
            available=avail,
        )


class _Pin:
    """Owner of one device-mapped tensor over a :class:`HostBuffer`: alive while any view of that tensor is,
    and keeps the buffer registered and mapped until then."""

    __slots__ = ("__weakref__", "buffer")

    def __init__(self, buffer: HostBuffer) -> None:
        self.buffer = buffer

    def __del__(self) -> None:
        try:
            self.buffer._pin_gone(self)
        except Exception:
            pass


class HostBuffer:
    """``nbytes`` of host memory; page-locked when ``device_index`` is given (registered in that device's
    context as portable memory mapped into the devices' address space, so every CUDA context can use it for
    DMA and kernels can read it in place).

    ``node``: where a page-locked buffer's pages are preferred: ``"gpu"`` (the device's NUMA node on a host
    with several, else nothing is done), a node number, or None (no policy: first touch decides).

    Raises:
        HostOutOfMemoryError: the host cannot provide ``nbytes``; nothing is held.
    """

    def __init__(
        self, nbytes: int, *, device_index: int | None = None, node: int | str | None = "gpu"
    ) -> None:
        if nbytes <= 0:
            raise ValueError(f"nbytes must be positive, got {nbytes}")
        _check_available(nbytes)
        self.nbytes = nbytes
        self.pinned = pinned = device_index is not None
        self._index = device_index
        # The owner of the device views made so far: at most one is alive (a new one is made only once the
        # last is gone). Held weakly: the views own the pin and the pin owns this buffer; a strong reference
        # here would be a cycle through C++ that the garbage collector cannot see.
        self._pin: weakref.ref[_Pin] | None = None
        self._device_ptr: int | None = None
        self._free_pending = False
        try:
            self._map: mmap.mmap | None = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        except OSError as e:
            raise HostOutOfMemoryError(
                f"could not map {nbytes} bytes of host memory: {e}", needed=nbytes, available=0
            ) from e
        if nbytes >= _HUGE and hasattr(mmap, "MADV_HUGEPAGE"):
            try:
                self._map.madvise(mmap.MADV_HUGEPAGE)
            except OSError:
                pass
        self.tensor: torch.Tensor | None = torch.frombuffer(self._map, dtype=torch.uint8)
        self.ptr = self.tensor.data_ptr()
        self.numa_node: int | None = None
        if pinned:
            from . import _cuda, _numa

            # On a multi-node host, the pages go to the GPU's node (set before they are first touched).
            if node == "gpu":
                node = _numa.gpu_node(device_index)
            assert node is None or isinstance(node, int)
            if _numa.place(self.ptr, nbytes, node):
                self.numa_node = node
            # Populate with all intra-op threads first; registering unpopulated pages faults them in one
            # thread at a time, several times slower.
            self.tensor.zero_()
            try:
                _cuda.host_register(self.ptr, nbytes, device_index)
            except Exception as e:
                self._unmap()
                raise HostOutOfMemoryError(
                    f"could not page-lock {nbytes} bytes of host memory: {e}", needed=nbytes, available=0
                ) from e
        _account(nbytes, pinned)

    @property
    def alive(self) -> bool:
        return self._map is not None and not self._free_pending

    def host_view(self, offset: int, nbytes: int) -> torch.Tensor:
        """A uint8 CPU tensor with a storage of its own over ``nbytes`` at ``offset``."""
        assert self._map is not None
        return torch.frombuffer(self._map, dtype=torch.uint8, count=nbytes, offset=offset)

    def device_view(self, offset: int, nbytes: int) -> torch.Tensor:
        """A uint8 tensor of the registering device over ``nbytes`` at ``offset``, with a storage of its
        own: zero-copy, kernels read and write host memory over the link. The buffer stays registered and
        mapped while any such tensor exists, even after :meth:`free`, so none points at unmapped memory."""
        if not self.pinned or not self.alive:
            raise RuntimeError("device_view() needs a live page-locked buffer")
        from . import _cuda

        assert self._index is not None
        pin = self._live_pin()
        if pin is None:
            pin = _Pin(self)
            self._pin = weakref.ref(pin)
        if self._device_ptr is None:
            self._device_ptr = _cuda.host_device_pointer(self.ptr, self._index)
        return _cuda.mapped_tensor(self._device_ptr + offset, nbytes, self._index, pin)

    def _live_pin(self) -> _Pin | None:
        return self._pin() if self._pin is not None else None

    def _pin_gone(self, pin: _Pin) -> None:
        # Called from the last device view's pin as it goes: a free() deferred for it can happen now.
        if self._free_pending:
            self._free_pending = False
            self._release()

    def _unmap(self) -> None:
        self.tensor = None
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:
                pass  # a view is still alive somewhere; the mapping goes with it
            self._map = None

    def free(self) -> None:
        """Unregister and unmap the buffer (idempotent). Deferred while device views of it are alive."""
        if self._map is None or self._free_pending:
            return
        if self._live_pin() is not None:
            self._free_pending = True
            return
        self._release()

    def _release(self) -> None:
        if self.pinned:
            from . import _cuda

            try:
                _cuda.host_unregister(self.ptr, self._index)
            except Exception:
                pass
        self._unmap()
        _account(-self.nbytes, self.pinned)

    def __del__(self) -> None:
        try:
            self.free()
        except Exception:
            pass
