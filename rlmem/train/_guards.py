"""The hooks that refuse to use a :class:`~rlmem.TrainState`'s released state: a forward pass over offloaded
parameters or buffers (or one with autograd on while gradients are offloaded), an optimizer step while
parameters, gradients or optimizer states are, and ``state_dict()`` of discarded values, each with an error
naming rlmem and what to do instead.

The forward guards are there only while something they check is released (:meth:`Guards.update` says why);
``state.py`` registers the state_dict and step hooks once and calls :meth:`Guards.update` after every offload
and reload.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

__all__ = ["Guards"]


class Guards:
    """The refusals of one TrainState.

    Args:
        name: the TrainState's label, in every message.
        policy: its policy by category (the live dict: it changes with every offload and reload).
        paused: whether a category is released now.
        param_ids: ``id()`` of the model's own parameters.
        guarded: the modules a forward guard goes on (those with parameters, or buffers when adopted).
        autograd_grads: whether a forward pass with autograd on would write gradients into Regions.
    """

    def __init__(
        self,
        name: str,
        policy: dict[str, str],
        paused: Callable[[str], bool],
        param_ids: set[int],
        guarded: list[nn.Module],
        autograd_grads: bool,
    ) -> None:
        self.name = name
        self._guarded = guarded
        self._policy = policy
        self._paused = paused
        self._param_ids = param_ids
        self._autograd_grads = autograd_grads
        self._hooks: list[Any] = []  # forward guards, there only while what they check is released

    def before_state_dict(self, module: nn.Module, prefix: str, keep_vars: bool) -> None:
        """A module's state_dict pre-hook: refuses while parameters or buffers are discarded."""
        for cat in ("params", "buffers"):
            if self._policy[cat] == "discard":
                raise RuntimeError(
                    f"rlmem TrainState {self.name!r}: state_dict() was called while the {cat} are discarded "
                    f"(offload({cat}='discard')), so there are no values to save until reload() and the "
                    f"caller's own reload of them; offload with {cat}='offload' to keep them readable"
                )

    def before_forward(self, module: nn.Module, args: Any) -> None:
        """The forward pre-hook: refuses a call over released parameters, gradients or buffers."""
        if self._paused("params") and self.own_weights(module):
            raise RuntimeError(
                f"rlmem TrainState {self.name!r}: the model was called while its parameters are offloaded "
                f"(params={self._policy['params']!r}); call reload() first, or offload with params='keep' "
                "if the rollout runs on the training model"
            )
        if (
            self._paused("grads")
            and torch.is_grad_enabled()
            and self._autograd_grads
            and self.own_weights(module)
        ):
            raise RuntimeError(
                f"rlmem TrainState {self.name!r}: the model was called with autograd on while its gradients "
                "are offloaded; run the rollout under torch.no_grad() / torch.inference_mode(), or reload() "
                "first"
            )
        if self._paused("buffers"):
            raise RuntimeError(
                f"rlmem TrainState {self.name!r}: the model was called while its buffers are offloaded; "
                "call reload() first, or offload with buffers='keep'"
            )

    def before_step(self) -> None:
        """Refuses an optimizer step while parameters, gradients or optimizer states are released."""
        for cat in ("params", "grads", "optimizer"):
            if self._paused(cat):
                raise RuntimeError(
                    f"TrainState {self.name!r}: optimizer.step() was called while {cat} are offloaded; "
                    "call reload() first"
                )

    def update(self, closed: bool) -> None:
        """Forward guards on the model's modules while its parameters, gradients or buffers are released
        (and the state is not ``closed``), and none otherwise: a module with a forward hook takes PyTorch's
        slow call path, a few microseconds a call that a train step would pay for nothing."""
        want = not closed and any(self._paused(c) for c in ("params", "grads", "buffers"))
        if want and not self._hooks:
            # prepend: run before FSDP's own pre-forward all-gather reads the sharded parameters
            self._hooks = [
                m.register_forward_pre_hook(self.before_forward, prepend=True) for m in self._guarded
            ]
        elif not want:
            for h in self._hooks:
                h.remove()
            self._hooks = []

    def own_weights(self, module: nn.Module) -> bool:
        """Whether ``module`` runs on its own parameters now. A module called over other weights
        (``torch.func.functional_call`` over a rollout copy, as HFSampler does) reads none of the training
        state, so only a module holding its own is refused."""
        return any(id(t) in self._param_ids for t in module._parameters.values())
