"""What the saved-tensor hooks of the activation offloader hand to autograd, and the rules for what may be
offloaded."""

from __future__ import annotations

import weakref
from typing import Any

import torch

__all__ = ["Entry", "Kept", "Packed", "eligible", "storage_bytes", "version_error", "view_of"]


class Kept:
    """A saved tensor left where it is; its version is checked at unpack as autograd would."""

    __slots__ = ("tensor", "version")

    def __init__(self, t: torch.Tensor) -> None:
        self.tensor = t
        self.version = t._version


class Entry:
    """One offloaded storage: its host copy, and while it is in flight or reloaded its device bytes."""

    __slots__ = (
        "clean",
        "d2h_done",
        "dev",
        "group",
        "host",
        "modified",
        "nbytes",
        "ready",
        "refs",
        "reload",
        "storage",
        "version",
    )

    def __init__(self, nbytes: int, group: int, storage: Any, version: int) -> None:
        self.nbytes = nbytes
        self.group = group
        self.storage = weakref.ref(storage)  # the data_ptr key is valid only while the storage lives
        self.version = version
        self.host: torch.Tensor | None = None
        self.dev: torch.Tensor | None = None  # held (and its version watched) until the copy completes
        self.d2h_done: Any = None
        self.reload: torch.Tensor | None = None
        self.ready: Any = None
        self.refs = 0
        self.modified = False
        self.clean = False  # kept on the device, its copy seen complete while it was unchanged


class Packed:
    """A saved tensor whose storage is offloaded: how to rebuild the view from the storage's bytes."""

    __slots__ = ("dtype", "entry", "gen", "offset", "ref", "size", "stride", "version")

    def __init__(self, entry: Entry, t: torch.Tensor, gen: int) -> None:
        self.entry = entry
        self.size = t.size()
        self.stride = t.stride()
        self.offset = t.storage_offset()
        self.dtype = t.dtype
        self.ref = weakref.ref(t)
        self.version = t._version
        self.gen = gen


def version_error() -> RuntimeError:
    return RuntimeError(
        "one of the variables needed for gradient computation has been modified by an inplace operation "
        "after rlmem.offload_activations saved it; the gradient would be wrong"
    )


def view_of(buf: torch.Tensor, p: Packed) -> torch.Tensor:
    """The saved view ``p`` over a storage's bytes ``buf``."""
    return torch.empty(0, dtype=p.dtype, device=buf.device).set_(
        buf.untyped_storage(), p.offset, p.size, p.stride
    )


def storage_bytes(storage: Any) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def _is_param_cast(t: torch.Tensor) -> bool:
    # Autocast's copy of a parameter lives in autocast's cache for the whole forward pass anyway.
    fn = t.grad_fn
    if fn is None or type(fn).__name__ != "ToCopyBackward0":
        return False
    nxt = fn.next_functions
    return bool(nxt) and nxt[0][0] is not None and type(nxt[0][0]).__name__ == "AccumulateGrad"


def eligible(t: torch.Tensor, device: torch.device) -> bool:
    """Whether a saved tensor may be offloaded: a plain strided activation on ``device`` (never a parameter,
    buffer, input, a view of one, a cast of a parameter, or a tensor subclass)."""
    if type(t) is not torch.Tensor or t.layout != torch.strided or t.is_nested or t.is_quantized:
        return False
    if t.is_leaf or t.device != device:
        return False  # parameters, buffers, inputs, constants made without grad
    base = t._base
    if base is not None and base.is_leaf:
        return False  # a view of a parameter or an input
    return not _is_param_cast(t)
