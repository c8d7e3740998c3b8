"""Weights shared, not copied: a model's parameters in one shareable Region, laid out by name.

The trainer keeps a rollout copy of its policy (its own dtype, e.g. bf16) in a :class:`SharedWeights`; the
rollout process, sent :meth:`SharedWeights.export`'s spec and descriptors over a Unix socket, maps the same
memory with :func:`attach_weights` and gets ``name -> tensor`` views to run its model on
(``torch.func.functional_call(model, weights.tensors, ...)``, or parameters re-pointed at the views). A sync
is the trainer's in-place cast-copy of each parameter into its view: 6 bytes moved per bf16 parameter from
fp32, on the device, and the views the other process holds (and CUDA graphs captured over them) see the new
values at the same addresses.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from .._dtensor import copy_full
from .._units import round_up
from ..memory.region import Region
from ..memory.sharing import SharedLayout
from .member import PeerLostError

__all__ = ["AttachedWeights", "SharedWeights", "attach_weights"]

_ALIGN = 256


def _dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"not a torch dtype: {name!r}")
    return dt


class SharedWeights:
    """A copy of ``model``'s parameters (each once, tied ones too) in a shareable Region on ``device``.

    Args:
        model: the trainer's model; a DTensor (FSDP2) parameter is gathered whole at each sync.
        dtype: the copy's dtype (default: each parameter's own).
        device: where the copy lives (default: the model's first parameter's device).
        name: the Region's label.
        buffers: share the model's buffers too, each in its own dtype (e.g. rotary tables): the other
            process can then run a model built on the meta device, with no memory of its own.

    Example:
        >>> w = SharedWeights(model, torch.bfloat16)
        >>> spec, fds = w.export()       # send both to the rollout process (socket.send_fds)
        >>> ...; opt.step(); w.sync()    # the rollout process's views now hold the new weights
    """

    def __init__(
        self,
        model: nn.Module,
        dtype: torch.dtype | None = None,
        *,
        device: str | torch.device | None = None,
        name: str = "weights",
        buffers: bool = False,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise ValueError(f"dtype must be a floating torch.dtype or None, got {dtype!r}")
        self.model, self.buffers = model, bool(buffers)
        named = dict(model.named_parameters())
        if not named:
            raise ValueError("model has no parameters to share")
        dev = torch.device(device) if device is not None else next(iter(named.values())).device
        dtypes = {n: dtype or p.dtype for n, p in named.items()}
        shapes = {n: p.shape for n, p in named.items()}
        for n, b in model.named_buffers() if self.buffers else ():
            dtypes[n], shapes[n] = b.dtype, b.shape
        size = sum(round_up(math.prod(shapes[n]) * dt.itemsize, _ALIGN) for n, dt in dtypes.items())
        self.region = Region(size, dev, name=name, shareable=True)
        self.tensors = {n: self.region.empty(shapes[n], dt, align=_ALIGN) for n, dt in dtypes.items()}
        self.sync()

    @torch.no_grad()
    def sync(self) -> None:
        """Copy (and cast) every parameter into its view, in place, and wait until the copies are done: the
        fence after which the other process's next kernels read the new weights.

        Raises:
            RuntimeError: the Region is paused.
        """
        if self.region.paused:
            raise RuntimeError(f"SharedWeights {self.region.name!r} is paused: resume it before sync()")
        copy_full((p, self.tensors[n]) for n, p in self.model.named_parameters())
        for n, b in self.model.named_buffers() if self.buffers else ():
            self.tensors[n].copy_(b)
        if self.region.device.type == "cuda":
            torch.cuda.current_stream(self.region.device).synchronize()

    def export(self) -> tuple[dict[str, Any], list[int]]:
        """A JSON-able spec (the Region's layout, and each tensor's name, offset, shape and dtype) and a file
        descriptor per chunk, for :func:`attach_weights` in another process (the caller closes them)."""
        layout, fds = self.region.export()
        spec = {
            "region": layout.as_dict(),
            "tensors": [
                [n, self.region.span(t)[0], list(t.shape), str(t.dtype)] for n, t in self.tensors.items()
            ],
        }
        return spec, fds

    def close(self) -> None:
        self.region.close()


class AttachedWeights:
    """Another process's :class:`SharedWeights`, mapped here: ``tensors`` by parameter name, at addresses
    of this process's own that stay fixed (``pause`` / ``reattach`` keep them)."""

    def __init__(self, region: Region, tensors: dict[str, torch.Tensor]) -> None:
        self.region = region
        self._tensors = tensors
        self._lost: dict[str, Any] | None = None

    @property
    def tensors(self) -> dict[str, torch.Tensor]:
        """The views by parameter name.

        Raises:
            PeerLostError: the process that owns the memory died (see :meth:`owner_lost`).
            RuntimeError: paused (unmapped) until :meth:`reattach`.
        """
        if self._lost is not None:
            raise PeerLostError(
                f"the weights {self.region.name!r} belong to pid {self._lost.get('pid')} "
                f"({self._lost.get('role')}), which died: they are no longer synced; close() them",
                self._lost,
            )
        if self.region.paused:
            raise RuntimeError(
                f"the weights {self.region.name!r} are unmapped (paused): reattach() them to the owner's "
                "memory"
            )
        return self._tensors

    def owner_lost(self, entry: dict[str, Any]) -> None:
        """Mark the owner (``entry``: its ledger entry) dead: :attr:`tensors` raises from now on. The memory
        stays mapped (it lives while this process maps it) until :meth:`close`."""
        self._lost = dict(entry)

    def pause(self) -> None:
        """Unmap (before the owner releases the memory); the views must not be used until :meth:`reattach`."""
        self.region.pause(keep=False)

    def reattach(self, spec: dict[str, Any], fds: list[int]) -> None:
        """Map the owner's memory again (its export after it resumed), at the same addresses."""
        self.region.reattach(SharedLayout.from_dict(spec["region"]), fds)

    def close(self) -> None:
        self.region.close()


def attach_weights(spec: dict[str, Any], fds: list[int]) -> AttachedWeights:
    """Map the weights another process exported (:meth:`SharedWeights.export`); ``fds`` may be closed after.

    Raises:
        ValueError: ``spec`` is not such a spec.
    """
    try:
        layout = SharedLayout.from_dict(spec["region"])
        entries = [
            (str(n), int(off), [int(x) for x in shape], _dtype(str(dt)))
            for n, off, shape, dt in spec["tensors"]
        ]
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"not a SharedWeights spec: {e!r}") from e
    region = Region.attach(layout, fds)
    return AttachedWeights(region, {n: region.view(off, shape, dt) for n, off, shape, dt in entries})
