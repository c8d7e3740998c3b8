"""Host backends of :class:`rlmem.Region`: the same semantics on an anonymous private mapping, and on
chunks other processes can map (:class:`SharedHostBackend`).

Releasing a chunk is ``madvise(MADV_DONTNEED)``: its pages go back to the OS (the process RSS drops) and
read as zeros when touched again. Copies are synchronous memory copies, so CPU-only machines and CI run the
same pause/resume logic as a GPU, not a mock of it.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import threading
from typing import Any

import torch

from ._pinned import available_host_bytes


class HostBackend:
    """Pages of one host Region, released and re-populated chunk by chunk."""

    kind = "cpu"
    asynchronous = False
    pinned_backup = False
    granularity = mmap.PAGESIZE

    def __init__(self) -> None:
        self.device = torch.device("cpu")
        self._map: mmap.mmap | None = None
        self._base: torch.Tensor | None = None
        self._size = 0
        self._mapped: dict[int, int] = {}

    def open(self, nbytes: int) -> None:
        # MAP_PRIVATE matters: Python's default for anonymous maps is MAP_SHARED, where MADV_DONTNEED only
        # hides pages from RSS while shared memory keeps them.
        self._map = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self._size = nbytes
        self._base = torch.frombuffer(self._map, dtype=torch.uint8)  # what the copies read and write

    def tensor_at(self, offset: int, nbytes: int) -> torch.Tensor:
        """A uint8 tensor with a storage of its own over ``nbytes`` at ``offset``."""
        assert self._map is not None
        return torch.frombuffer(self._map, dtype=torch.uint8, count=nbytes, offset=offset)

    @property
    def ptr(self) -> int:
        assert self._base is not None
        return self._base.data_ptr()

    def map(self, offset: int, size: int) -> None:
        # Pages are provided on first touch; nothing to create.
        self._mapped[offset] = size

    def unmap(self, offset: int) -> None:
        size = self._mapped.pop(offset)
        assert self._map is not None
        self._map.madvise(mmap.MADV_DONTNEED, offset, size)

    def committed(self, offset: int) -> int:
        """Bytes of memory the chunk mapped at ``offset`` takes: all of it. Private pages are not counted
        page by page; nothing measures them (the fences count shared memory, see ``SharedHostBackend``)."""
        return self._mapped.get(offset, 0)

    def mem_info(self) -> tuple[int, int]:
        avail = available_host_bytes() or 0
        total = 0
        try:
            with open("/proc/meminfo") as f:
                total = int(f.readline().split()[1]) * 1024
        except OSError:
            pass
        return avail, total

    def reclaim_cache(self) -> None:
        pass

    def thread_setup(self) -> None:
        pass

    def order(self, extra: object = None) -> None:
        return None

    def wait(self, token: object) -> None:
        pass

    def begin_out(self, after: object) -> None:
        pass

    def copy_out(self, offset: int, size: int, host: torch.Tensor) -> None:
        assert self._base is not None
        host.copy_(self._base[offset : offset + size])

    def copy_in(self, offset: int, size: int, host: torch.Tensor) -> None:
        assert self._base is not None
        self._base[offset : offset + size].copy_(host)

    def mark_in(self, timing: bool = False) -> None:
        return None

    def synchronize(self) -> None:
        pass

    def close(self) -> None:
        for offset in list(self._mapped):
            self.unmap(offset)

    def destroy(self) -> None:
        self.close()
        self._base = None
        if self._map is not None:
            self._map.close()
            self._map = None


_libc: Any = None
_PROT_RW = mmap.PROT_READ | mmap.PROT_WRITE
_MAP_FIXED = 0x10  # Linux; not exported by Python's mmap module


def _mmap_at(addr: int, size: int, flags: int, fd: int) -> None:
    """``mmap(addr, size, PROT_READ|PROT_WRITE, flags|MAP_FIXED, fd, 0)``: replace what is mapped there."""
    global _libc
    if _libc is None:
        lib = ctypes.CDLL(None, use_errno=True)
        lib.mmap.restype = ctypes.c_void_p
        lib.mmap.argtypes = [
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_long,
        ]
        _libc = lib
    got = _libc.mmap(addr, size, _PROT_RW, flags | _MAP_FIXED, fd, 0)
    if got != addr:
        err = ctypes.get_errno()
        raise OSError(err, f"mmap at {addr:#x} ({size} bytes): {os.strerror(err)}")


class SharedHostBackend(HostBackend):
    """A host Region whose chunks another process can map: each chunk is a ``memfd`` mapped shared over its
    part of the Region's range, so the pages live as long as some process maps them or holds the file.

    Releasing a chunk puts private zero pages over its addresses (the range stays; paused tensors read
    zeros, as on the plain host backend) and closes this process's file: the memory goes back to the OS once
    every process that mapped it has done the same. A peer maps the files another process exported
    (:meth:`map_file`) at addresses of its own."""

    def __init__(self) -> None:
        super().__init__()
        self._files: dict[int, int | None] = {}  # offset -> this process's memfd (None: a peer's mapping)
        # A non-blocking pause closes files on its worker while committed() may read them: a descriptor
        # closed under fstat could be reused by another file in between.
        self._files_lock = threading.Lock()

    def open(self, nbytes: int) -> None:
        self._map = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self._size = nbytes
        self._base = torch.frombuffer(self._map, dtype=torch.uint8)

    def map(self, offset: int, size: int) -> None:
        fd = os.memfd_create(f"rlmem-region-{offset}", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, size)
            _mmap_at(self.ptr + offset, size, mmap.MAP_SHARED, fd)
        except BaseException:
            os.close(fd)
            raise
        self._files[offset] = fd
        self._mapped[offset] = size

    def file_bytes(self, fd: int) -> int:
        """Bytes of the file ``fd``, to check against a chunk before mapping it: a file shorter than the
        mapping leaves addresses past its end whose first touch kills the process with SIGBUS.

        Raises:
            OSError: ``fd`` is not an open descriptor.
        """
        return os.fstat(fd).st_size

    def map_file(self, offset: int, size: int, fd: int) -> None:
        """Map ``size`` bytes of the file ``fd`` (another process's chunk) at ``offset``; ``fd`` may be
        closed after.

        Raises:
            ValueError: the file is not ``size`` bytes (``Region`` checks every descriptor before mapping
                any; this guards the one call).
        """
        got = self.file_bytes(fd)
        if got != size:
            raise ValueError(f"the chunk at offset {offset} is {size} bytes, but its file has {got} bytes")
        _mmap_at(self.ptr + offset, size, mmap.MAP_SHARED, fd)
        self._files[offset] = None
        self._mapped[offset] = size

    def export_file(self, offset: int) -> int:
        """A new descriptor of the chunk at ``offset`` for another process (the caller closes it)."""
        fd = self._files.get(offset)
        if fd is None:
            raise ValueError(f"the chunk at offset {offset} is not this process's to export")
        return os.dup(fd)

    def committed(self, offset: int) -> int:
        """Bytes of memory the chunk at ``offset`` takes: the pages its file holds (``st_blocks``, in units
        of 512 bytes). A memfd gets a page on its first touch, written or read, so a chunk never touched
        takes nothing though it is mapped, and shared memory (``Shmem``) rises only by what this counts.
        Pages swapped out count here and not in ``Shmem``. A peer's mapping (another process's file, not
        held here) counts whole: this process cannot see its pages."""
        with self._files_lock:
            fd = self._files.get(offset)
            if fd is None:
                return self._mapped.get(offset, 0)
            return os.fstat(fd).st_blocks * 512

    def unmap(self, offset: int) -> None:
        size = self._mapped.pop(offset)
        _mmap_at(self.ptr + offset, size, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1)
        with self._files_lock:
            fd = self._files.pop(offset, None)
            if fd is not None:
                os.close(fd)
