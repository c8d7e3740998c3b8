"""ctypes binding to the libnccl that torch already loaded (never a second copy of the library).

Only what rlmem.comm needs: the version, and NCCL's communicator suspend API (NCCL >= 2.29.7):
``ncclCommSuspend(comm, NCCL_SUSPEND_MEM)``, ``ncclCommResume(comm)`` and
``ncclCommMemStats(comm, stat, &value)``, plus the error strings.
"""

from __future__ import annotations

import ctypes
import functools
import os

NCCL_SUSPEND_MEM = 0x01
# ncclCommMemStat_t
STAT_SUSPEND = 0  # bytes that suspend can release
STAT_SUSPENDED = 1  # 1 while suspended
STAT_PERSIST = 2  # bytes that stay
STAT_TOTAL = 3  # bytes NCCL tracks (only with NCCL_CUMEM_ENABLE on)
SUSPEND_VERSION = 22907  # 2.29.7, coded as NCCL_VERSION(2, 29, 7)
_IN_PROGRESS = 7  # ncclInProgress


def version_string(code: int) -> str:
    """``22907`` -> ``"2.29.7"`` (NCCL's code is X*1000+Y*100+Z up to 2.8, X*10000+Y*100+Z after)."""
    if code < 10000:
        return f"{code // 1000}.{code % 1000 // 100}.{code % 100}"
    return f"{code // 10000}.{code % 10000 // 100}.{code % 100}"


class _DlInfo(ctypes.Structure):
    _fields_ = [
        ("dli_fname", ctypes.c_char_p),
        ("dli_fbase", ctypes.c_void_p),
        ("dli_sname", ctypes.c_char_p),
        ("dli_saddr", ctypes.c_void_p),
    ]


def _global_path() -> str | None:
    # The copy whose symbols the process binds to (an LD_PRELOAD'ed one wins over torch's bundled one, even
    # when both are mapped): where the global scope's ncclGetVersion lives.
    try:
        fn = ctypes.CDLL(None).ncclGetVersion
        info = _DlInfo()
        if ctypes.CDLL(None).dladdr(ctypes.cast(fn, ctypes.c_void_p), ctypes.byref(info)) and info.dli_fname:
            return os.path.realpath(info.dli_fname.decode())
    except (AttributeError, OSError):
        return None
    return None


def loaded_path() -> str | None:
    """Path of the libnccl this process uses, if any."""
    found = _global_path()
    if found is not None:
        return found
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.rstrip("\n").split(" ")[-1]
                if "/libnccl" in path and ".so" in path:
                    return path
    except OSError:
        return None
    return None


class NcclError(RuntimeError):
    """An NCCL call returned an error."""


class Nccl:
    """The loaded libnccl's functions rlmem uses."""

    def __init__(self, path: str) -> None:
        # RTLD_NOLOAD: take the copy torch already mapped; fail rather than load a second one.
        self.path = path
        self.lib = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_GLOBAL)
        v = ctypes.c_int()
        self._check(self.lib.ncclGetVersion(ctypes.byref(v)), "ncclGetVersion")
        self.version = v.value
        self.lib.ncclGetErrorString.restype = ctypes.c_char_p
        self.has_suspend = self.version >= SUSPEND_VERSION and all(
            hasattr(self.lib, f) for f in ("ncclCommSuspend", "ncclCommResume", "ncclCommMemStats")
        )
        if self.has_suspend:
            self.lib.ncclCommSuspend.argtypes = [ctypes.c_void_p, ctypes.c_int]
            self.lib.ncclCommResume.argtypes = [ctypes.c_void_p]
            self.lib.ncclCommMemStats.argtypes = [
                ctypes.c_void_p,
                ctypes.c_int,
                ctypes.POINTER(ctypes.c_uint64),
            ]
        self.lib.ncclCommGetAsyncError.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_int)]
        if hasattr(self.lib, "ncclGetLastError"):
            self.lib.ncclGetLastError.restype = ctypes.c_char_p
            self.lib.ncclGetLastError.argtypes = [ctypes.c_void_p]

    @property
    def version_string(self) -> str:
        return version_string(self.version)

    def _check(self, rc: int, what: str, comm: int | None = None) -> None:
        if rc == 0:
            return
        msg = f"{what} failed with NCCL error {rc}"
        try:
            msg += f" ({self.lib.ncclGetErrorString(rc).decode()})"
            if comm is not None and hasattr(self.lib, "ncclGetLastError"):
                last = self.lib.ncclGetLastError(ctypes.c_void_p(comm))
                if last:
                    msg += f": {last.decode()}"
        except Exception:  # the error code alone still says what failed
            pass
        raise NcclError(msg)

    def async_error(self, comm: int) -> int:
        err = ctypes.c_int()
        self._check(
            self.lib.ncclCommGetAsyncError(ctypes.c_void_p(comm), ctypes.byref(err)), "ncclCommGetAsyncError"
        )
        return err.value

    def suspend(self, comm: int) -> None:
        self._check(
            self.lib.ncclCommSuspend(ctypes.c_void_p(comm), NCCL_SUSPEND_MEM), "ncclCommSuspend", comm
        )

    def resume(self, comm: int) -> None:
        self._check(self.lib.ncclCommResume(ctypes.c_void_p(comm)), "ncclCommResume", comm)

    def mem_stat(self, comm: int, stat: int) -> int:
        v = ctypes.c_uint64()
        self._check(
            self.lib.ncclCommMemStats(ctypes.c_void_p(comm), stat, ctypes.byref(v)), "ncclCommMemStats", comm
        )
        return int(v.value)


@functools.cache
def library() -> Nccl:
    """The libnccl torch loaded (loading torch's CUDA library first, which links it).

    Raises:
        RuntimeError: torch has no NCCL, or no libnccl is mapped into this process.
    """
    import torch

    if not torch.cuda.is_available() or not hasattr(torch.cuda, "nccl"):
        raise RuntimeError("rlmem.comm needs a CUDA build of torch with NCCL")
    torch.cuda.nccl.version()  # makes sure the library torch links is mapped
    path = loaded_path()
    if path is None:
        raise RuntimeError("no libnccl is loaded in this process (torch.cuda.nccl found none)")
    return Nccl(path)
