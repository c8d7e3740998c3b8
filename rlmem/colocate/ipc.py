"""Tensors handed to another process by handle, as JSON: what frameworks send a rollout server today.

:func:`share_tensors` describes each tensor by its storage's sharing handle (CUDA IPC on a GPU, PyTorch's
shared-memory file on the host), its dtype, shape, stride and offset, base64 where bytes; the receiving
process maps the same memory with :func:`open_tensors` (no copy on the way) and copies what it needs. No
pickle is involved: a handle is data, never code, so a server can take it from a request body.

The sender keeps its tensors alive, unchanged, until the receiver has answered (PyTorch's own reference
counting of CUDA IPC storages covers the mapping's lifetime on both sides).
"""

from __future__ import annotations

import base64
from collections.abc import Iterable, Mapping
from typing import Any

import torch

__all__ = ["open_tensors", "share_tensors"]


def _b64(b: bytes | None) -> str | None:
    return None if b is None else base64.b64encode(b).decode()


def _unb64(s: Any, field: str) -> bytes:
    if not isinstance(s, str):
        raise ValueError(f"{field} must be a base64 str, got {type(s).__name__}")
    try:
        return base64.b64decode(s, validate=True)
    except ValueError as e:
        raise ValueError(f"{field} is not base64: {e}") from e


def share_tensors(named: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> list[dict]:
    """JSON-able handles of ``named`` tensors (CUDA ones by CUDA IPC; host ones moved into shared memory
    first, as ``Tensor.share_memory_`` does).

    Raises:
        ValueError: a tensor that cannot be shared (sparse, on another kind of device).
    """
    from torch.multiprocessing.reductions import reduce_tensor

    items = named.items() if isinstance(named, Mapping) else named
    out = []
    for name, t in items:
        if not isinstance(t, torch.Tensor) or t.layout != torch.strided:
            raise ValueError(f"{name!r}: only dense tensors can be shared, got {type(t).__name__}")
        t = t.detach()
        base = {
            "name": str(name),
            "dtype": str(t.dtype).removeprefix("torch."),
            "shape": list(t.shape),
            "stride": list(t.stride()),
            "offset": t.storage_offset(),
        }
        if t.device.type == "cuda":
            args = reduce_tensor(t)[1]  # PyTorch's own CUDA IPC description, not pickled
            dev, handle, size, off, rc_handle, rc_off, ev_handle, ev_sync = args[6:10] + args[11:15]
            base.update(
                kind="cuda_ipc",
                device=int(dev),
                handle=_b64(handle),
                storage_bytes=int(size),
                storage_offset_bytes=int(off),
                ref_counter_handle=_b64(rc_handle),
                ref_counter_offset=int(rc_off),
                event_handle=_b64(ev_handle),
                event_sync_required=bool(ev_sync),
            )
        elif t.device.type == "cpu":
            manager, handle, size = t.untyped_storage()._share_filename_cpu_()
            base.update(kind="shm", manager=_b64(manager), handle=_b64(handle), storage_bytes=int(size))
        else:
            raise ValueError(f"{name!r}: tensors on {t.device.type} cannot be shared by handle")
        out.append(base)
    return out


def _dtype(s: Any, field: str) -> torch.dtype:
    dt = getattr(torch, str(s), None) if isinstance(s, str) else None
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"{field} must name a torch dtype (e.g. 'bfloat16'), got {s!r}")
    return dt


def _ints(v: Any, field: str) -> list[int]:
    if not isinstance(v, list) or not all(isinstance(x, int) and x >= 0 for x in v):
        raise ValueError(f"{field} must be a list of non-negative ints, got {v!r}")
    return v


def open_tensors(handles: list[dict]) -> list[tuple[str, torch.Tensor]]:
    """Map the tensors :func:`share_tensors` described in another process, in order.

    Raises:
        ValueError: a malformed handle (the message names its field), or one for memory this process
            cannot map.
    """
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    if not isinstance(handles, list):
        raise ValueError(f"handles must be a list, got {type(handles).__name__}")
    out = []
    for i, h in enumerate(handles):
        where = f"tensors[{i}]"
        if not isinstance(h, dict):
            raise ValueError(f"{where} must be an object, got {type(h).__name__}")
        name = h.get("name")
        if not isinstance(name, str) or not name:
            raise ValueError(f"{where}.name must be a non-empty str")
        dtype = _dtype(h.get("dtype"), f"{where}.dtype")
        shape, stride = _ints(h.get("shape"), f"{where}.shape"), _ints(h.get("stride"), f"{where}.stride")
        offset = h.get("offset")
        if len(shape) != len(stride) or not isinstance(offset, int) or offset < 0:
            raise ValueError(f"{where}: shape and stride must be as long as each other, offset an int >= 0")
        kind = h.get("kind")
        try:
            if kind == "cuda_ipc":
                ev = h.get("event_handle")
                t = rebuild_cuda_tensor(
                    torch.Tensor,
                    torch.Size(shape),
                    tuple(stride),
                    offset,
                    torch.storage.TypedStorage,
                    dtype,
                    int(h["device"]),
                    _unb64(h.get("handle"), f"{where}.handle"),
                    int(h["storage_bytes"]),
                    int(h["storage_offset_bytes"]),
                    False,
                    _unb64(h.get("ref_counter_handle"), f"{where}.ref_counter_handle"),
                    int(h["ref_counter_offset"]),
                    None if ev is None else _unb64(ev, f"{where}.event_handle"),
                    bool(h["event_sync_required"]),
                )
            elif kind == "shm":
                storage = torch.UntypedStorage._new_shared_filename_cpu(
                    _unb64(h.get("manager"), f"{where}.manager"),
                    _unb64(h.get("handle"), f"{where}.handle"),
                    int(h["storage_bytes"]),
                )
                t = torch.empty(0, dtype=dtype).set_(storage, offset, shape, stride)
            else:
                raise ValueError(f"{where}.kind must be 'cuda_ipc' or 'shm', got {kind!r}")
        except (KeyError, TypeError) as e:
            raise ValueError(f"{where}: a field is missing or of the wrong type: {e!r}") from e
        except RuntimeError as e:  # the driver or the allocator refused the handle
            raise ValueError(f"{where} ({name!r}): cannot map it here: {e}") from e
        out.append((name, t))
    return out
