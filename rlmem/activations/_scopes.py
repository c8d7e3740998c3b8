"""Where the activation offloader's scopes come from: module hooks that mark "inside name of layer i" while
the forward pass runs through a chosen module, and the offloader active in this thread.

A chosen module pushes its scope on entry and pops it on exit; modules nested inside a chosen one push an
empty scope (their tensors are not offloaded under the outer name). A target that is a parameter instead of
a module (fused experts' first matmul) is scoped by a torch-function mode around the calls that take it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, Protocol

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from .modmap import LayerMap, Target

__all__ = ["Active", "Host", "current", "enter", "install_layers", "install_scopes", "leave"]


class Active(Protocol):
    """The offloader of a thread's active context, as :func:`rlmem.checkpoint` uses it."""

    def scope(self, name: str, layer: int) -> AbstractContextManager[None]: ...

    def owns_layer(self, layer: nn.Module) -> bool: ...


class Host(Protocol):
    """What the hooks :func:`install` registers call: the offloader's scope stack (``push`` / ``pop``, a
    ``None`` scope offloads nothing), whether it offloads now (``live``) and wants a scope (``wants``), the
    blocks and layers of the forward pass, and ``modes``, the torch-function modes the parameter scopes
    entered (innermost last)."""

    layer_map: LayerMap
    names: list[str]
    modes: list[TorchFunctionMode | None]
    live: Callable[[], bool]
    wants: Callable[[tuple[str, int]], bool]
    push: Callable[..., None]
    pop: Callable[[], None]
    scope: Callable[[str, int], AbstractContextManager[None]]
    enter_block: Callable[[frozenset, tuple, dict], None]
    leave_block: Callable[[], None]
    enter_layer: Callable[[int, tuple, dict], None]
    first_layer: Callable[[tuple, dict], None]
    forward_done: Callable[[], None]


_tls = threading.local()


def current() -> Active | None:
    """The offloader whose context is active in this thread, if any (used by :func:`rlmem.checkpoint`)."""
    stack = getattr(_tls, "stack", None)
    return stack[-1] if stack else None


def enter(off: Active) -> None:
    stack = getattr(_tls, "stack", None)
    if stack is None:
        stack = _tls.stack = []
    stack.append(off)


def leave(off: Active) -> None:
    _tls.stack.remove(off)


class _ParamCalls(TorchFunctionMode):
    """Scopes the calls inside a module that take one of its parameters (fused experts' first matmul)."""

    def __init__(self, off: Host, name: str, layer: int, param: torch.Tensor) -> None:
        super().__init__()
        self._off, self._name, self._layer = off, name, layer
        storage = param.untyped_storage()
        self._lo = storage.data_ptr()
        self._hi = self._lo + storage.nbytes()

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        # Every op inside the module comes here: the test is an address range (a view of the parameter,
        # one expert's slice, lies inside it), not a storage lookup.
        lo, hi = self._lo, self._hi
        for a in args:
            if isinstance(a, torch.Tensor) and lo <= a.data_ptr() < hi:
                with self._off.scope(self._name, self._layer):
                    return func(*args, **kwargs)
        return func(*args, **kwargs)


def install_layers(off: Host) -> list[Any]:
    """Register the hooks of ``off`` on its model's decoder layers (where each begins and ends: the step's
    shape, the release of copies in flight, the measured marks); returns the handles. They stay for the
    handle's life; the scopes' hooks come and go with what it offloads (:func:`install_scopes`)."""
    hooks: list[Any] = []
    for i, (_, layer) in enumerate(off.layer_map.layers):
        # Outermost on the layer (it may itself be a chosen module): first in, last out.
        hooks.append(layer.register_forward_pre_hook(_layer_start(off, i), with_kwargs=True, prepend=True))
        hooks.append(layer.register_forward_hook(_layer_end(off, i), always_call=True))
    return hooks


def install_scopes(off: Host, selected: set[tuple[str, int]] | None = None) -> list[Any]:
    """Register the scopes' hooks of ``off``: on the modules of the ``selected`` scopes (``(name, layer)``;
    None: every scope of its names), the modules nested inside them, and the blocks of their layers.
    Modules of no selected scope carry no hook at all: a hook is a Python call at every forward, which a
    small model's step, launched as fast as the host can, pays in full (a settled budget that offloads
    nothing cost 1-2% of such a step in hooks that did nothing). Returns the handles."""
    hooks: list[Any] = []
    lm = off.layer_map
    chosen = [
        t for n in off.names for t in lm.targets.get(n, []) if selected is None or (n, t.layer) in selected
    ]
    inside: set[int] = set()
    for t in chosen:
        if t.param is None:
            inside.update(id(m) for m in t.module.modules() if m is not t.module)
    picked = {id(t) for t in chosen}
    for name, targets in lm.targets.items():
        for t in targets:
            if id(t) in picked:
                hooks += _scope_hooks(off, t, name)
            elif id(t.module) in inside and t.param is None:
                hooks += _scope_hooks(off, t, None)
    layers = {t.layer for t in chosen}
    for i, (_, layer) in enumerate(lm.layers):
        if i in layers:
            hooks += _quiet_hooks(off, layer, i, chosen)
    return hooks


def _quiet_hooks(off: Host, layer: nn.Module, i: int, targets: list[Target]) -> list[Any]:
    """On each block of layer ``i`` that holds modules of its own (attention, MLP, MoE block): the saved
    tensors inside it skip the offloader's hooks when none of its own scopes is chosen and none of its
    inputs shares an offloaded storage. In a layer with a chosen scope every saved tensor otherwise passes
    the hooks (it might share an offloaded storage), and a block such as an MoE's expert loop saves
    hundreds of tensors per layer, each a Python call there and back."""
    hooks: list[Any] = []
    for child in layer.children():
        if next(child.children(), None) is None:
            continue  # a leaf (a norm): one op, nothing to save time on
        inside = {id(m) for m in child.modules()}
        scopes = frozenset((t.name, i) for t in targets if t.layer == i and id(t.module) in inside)

        def pre(mod: nn.Module, args: Any, kwargs: Any, scopes: frozenset = scopes) -> None:
            off.enter_block(scopes, args, kwargs)

        hooks.append(child.register_forward_pre_hook(pre, with_kwargs=True, prepend=True))
        hooks.append(child.register_forward_hook(lambda *_: off.leave_block(), always_call=True))
    return hooks


def _scope_hooks(off: Host, t: Target, name: str | None) -> list[Any]:
    layer = t.layer
    scope = None if name is None else (name, layer)
    if t.param is not None:
        pname = t.param
        modes = off.modes

        def pre_param(mod: nn.Module, args: Any) -> None:
            if not off.live() or not off.wants(scope):
                modes.append(None)
                return
            mode = _ParamCalls(off, t.name, layer, getattr(mod, pname))
            mode.__enter__()
            modes.append(mode)

        def post_param(mod: nn.Module, args: Any, out: Any) -> None:
            if modes:
                mode = modes.pop()
                if mode is not None:
                    mode.__exit__(None, None, None)

        return [
            t.module.register_forward_pre_hook(pre_param),
            t.module.register_forward_hook(post_param, always_call=True),
        ]

    def pre(mod: nn.Module, args: Any) -> None:
        off.push(scope if scope is not None and off.live() and off.wants(scope) else None)

    def post(mod: nn.Module, args: Any, out: Any) -> None:
        off.pop()

    return [t.module.register_forward_pre_hook(pre), t.module.register_forward_hook(post, always_call=True)]


def layer_input(args: tuple, kwargs: dict) -> torch.Tensor | None:
    """A decoder layer's hidden states: its first tensor argument, or ``hidden_states=``."""
    t = next((a for a in args if isinstance(a, torch.Tensor)), kwargs.get("hidden_states"))
    return t if isinstance(t, torch.Tensor) else None


def _layer_end(off: Host, i: int) -> Any:
    if i == len(off.layer_map.layers) - 1:

        def last(*_: Any) -> None:
            off.pop()
            off.forward_done()

        return last
    return lambda *_: off.pop()


def _layer_start(off: Host, i: int) -> Any:
    if i == 0:

        def first(mod: nn.Module, args: Any, kwargs: Any) -> None:
            off.first_layer(args, kwargs)
            off.enter_layer(0, args, kwargs)

        return first

    def pre(mod: nn.Module, args: Any, kwargs: Any) -> None:
        off.enter_layer(i, args, kwargs)

    return pre
