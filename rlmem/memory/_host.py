"""Host backend of :class:`rlmem.Region`: the same semantics on an anonymous private mapping.

Releasing a chunk is ``madvise(MADV_DONTNEED)``: its pages go back to the OS (the process RSS drops) and
read as zeros when touched again. Copies are synchronous memory copies, so CPU-only machines and CI run the
same pause/resume logic as a GPU, not a mock of it.
"""

from __future__ import annotations

import mmap

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
