"""The seam between :class:`~rlmem.TrainState` and a training stack: a :class:`Source` finds, adopts, keeps
in sync, refuses and restores the tensors of one stack (plain PyTorch, FSDP2 / DTensor, Megatron-Core).

``TrainState`` asks every source, in a fixed order (``state.SOURCES``: Megatron, DTensor, plain), for each
step; a source takes what belongs to its stack and passes the rest on, so a later source never sees what an
earlier one claimed. Everything a source adopts goes through :class:`~rlmem.train._adopted.Adopted` as
records that know how to restore themselves, so offload, reload and close need no knowledge of the stack.
Adding a stack is one new module with a ``Source`` subclass, named in ``SOURCES``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ._adopted import Adopted

__all__ = ["Source", "StateItem"]


@dataclass(frozen=True)
class StateItem:
    """One optimizer state tensor to adopt: ``optimizer.state[param][name] = value``, whose data is held by
    the plain tensor ``local`` (``value`` itself unless the stack wraps it)."""

    optimizer: torch.optim.Optimizer
    param: Any
    name: str
    value: torch.Tensor
    local: torch.Tensor

    @property
    def key(self) -> tuple[int, str]:
        return (id(self.param), self.name)


class Source:
    """One stack's part in a TrainState. Every method has a do-nothing default; a stack overrides what it
    needs.

    Args:
        kit: the TrainState's :class:`Adopted` (Regions, records, hooks, ``paused()``).
        root: the model (a ``ModuleList`` over chunks when several were given).
        params: every parameter of ``root``.
        optimizers: the ``torch.optim`` optimizers behind the one given (see :meth:`unwrap`).
        optimizer: the optimizer as given (a framework's wrapper, or a ``torch.optim`` one, or None).
    """

    def __init__(
        self,
        kit: Adopted,
        root: nn.Module,
        params: list[nn.Parameter],
        optimizers: list[torch.optim.Optimizer],
        optimizer: Any,
    ) -> None:
        self.kit = kit

    @staticmethod
    def unwrap(optimizer: Any) -> list[torch.optim.Optimizer] | None:
        """The ``torch.optim`` optimizers behind ``optimizer`` if this stack knows its kind, else None."""
        return None

    def accepts(self, p: nn.Parameter) -> bool:
        """Whether a parameter of this kind can be adopted (by this source or a later one)."""
        return False

    def owns(self, t: torch.Tensor) -> bool:
        """Whether ``t``, optimized but not a model parameter, is this stack's to adopt (main parameters)."""
        return False

    def adopt_params(self, params: list[nn.Parameter]) -> list[nn.Parameter]:
        """Adopt what this stack holds of ``params`` (and the storages behind them); return the rest."""
        return params

    def adopt_grads(self, params: list[nn.Parameter]) -> list[nn.Parameter]:
        """Adopt the gradients this stack keeps of ``params``; return the parameters left to later
        sources."""
        return params

    def adopt_buffers(self, root: nn.Module) -> None:
        """Adopt the model's buffers."""

    def takes_state(self, value: torch.Tensor) -> torch.Tensor | None:
        """The plain tensor holding an optimizer state's data if this stack adopts it, else None."""
        return None

    def adopt_states(self, items: list[StateItem]) -> None:
        """Adopt optimizer states this source took (new ones, or ones replaced since), each recorded with
        ``kit.set_state(item.key, record, item.local.data_ptr())``."""

    def check(self, policies: dict[str, str]) -> None:
        """Refuse, with a ``ValueError`` naming the category and what to use instead, a policy this stack
        cannot carry out."""

    def before_offload(self, policies: dict[str, str], moving: list[str]) -> None:
        """Bring this stack's holders in line before ``moving`` (the categories about to be released) go:
        drop gradients that are discarded, adopt tensors made since, or refuse before anything is released."""

    def on_return(self, category: str) -> None:
        """``category`` is back on the device (stream-ordered): restore what the stack expects of it."""

    def before_close(self) -> None:
        """Find what was made over adopted storages since, so that close gives it back too."""
