"""The handle :func:`rlmem.offload_activations` returns, :class:`ActivationOffloader`: one step's state and
what runs around its saved tensors. It owns the scopes' side of the module hooks (``_scopes`` calls it
through its ``Host`` protocol, here :class:`_HookCalls`) and which layers and scopes route their saved
tensors through the hooks, the budget mode's choice of what each step records and offloads (``_autoplan``),
the context (a step's start and end) and the step's figures (``_stats``). The saved-tensor hooks themselves,
and the release order of what they offload, are its base class :class:`SavedTensorHooks` (``_packing``).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from . import _autoplan, _budget, _scopes
from ._packing import RELEASE_LAG, SavedTensorHooks
from ._pool import HostPool
from ._saved import Entry
from ._stats import STEP_FIELDS, ActivationStats, ActivationTotals, new_step
from ._transfer import make_copies
from .modmap import LayerMap

__all__ = ["ActivationOffloader"]

log = logging.getLogger("rlmem")


class ActivationOffloader(SavedTensorHooks):
    """Handle returned by :func:`offload_activations`: a context manager around forward + backward.

    Use one ``with`` block per forward + backward (per micro-batch): host memory is reused from the next
    block on, and a graph must not be backpropagated after its block ends.
    """

    def __init__(
        self,
        model: nn.Module,
        layer_map: LayerMap,
        names: list[str],
        *,
        min_bytes: int,
        budget: str | int | None,
        max_overhead: float,
        prefetch: bool,
        enabled: bool,
    ) -> None:
        self.enabled = enabled
        self.names = names
        self.min_bytes = min_bytes
        self.budget = budget
        self.max_overhead = max_overhead
        self.prefetch = prefetch
        self.layer_map = layer_map
        self._layer_ids = {id(m) for _, m in layer_map.layers}
        # The last RELEASE_LAG layers' copies are never let go in the forward pass (not even when seen
        # complete): backward needs them first, and reloading them would hold it up.
        self._keep_from = len(layer_map.layers) - RELEASE_LAG
        self._kept: list[Entry] = []  # this step's entries of those layers, in copy order
        self._kept_seen = 0  # how many of them were seen copied
        self._hooks: list[Any] = []
        self._scope_hooks: list[Any] = []
        self._hooked: set[tuple[str, int]] | None = None  # the selection the scopes' hooks are on (None: all)
        self._active = False
        self._scope: list[tuple[str, int] | None] = []
        self._pushed: list[bool] = []
        self._quiet: list[bool] = []  # per block entered: whether its hooks were lifted
        self._modes: list[TorchFunctionMode | None] = []
        self._gen = 0
        self._entries: list[Entry] = []
        self._by_storage: dict[int, Entry] = {}
        self._inflight: deque[Entry] = deque()
        self._groups: dict[int, list[Entry]] = {}
        self._fetched: set[int] = set()
        self._selected: set[tuple[str, int]] | None = None
        # Layers whose saved tensors pass through the hooks: those with a chosen scope. The others run
        # with no Python in their saved tensors' path (a hook call per saved tensor costs the host).
        self._all_layers = {t.layer for n in names for t in layer_map.targets.get(n, [])}
        self._hook_layers = self._all_layers
        self._measure: dict[tuple[str, int], list[Any]] | None = None
        # Budget mode: what each step does (measure, reference, check a plan, run it) per input shape.
        self._control = None if budget is None else _autoplan.BudgetControl(budget, max_overhead, RELEASE_LAG)
        self._bypass = False  # this step runs without the offloader (the budget mode's reference step)
        self._seen: set[int] = set()
        self._times = _autoplan.StepTimes()
        self._backward = False  # this step's backward has begun (its first unpack)
        self._totals = {"steps": 0, "offloaded_bytes": 0, "reloaded_bytes": 0}
        self._step: dict[str, Any] = new_step()
        self.device = next((p.device for p in model.parameters()), torch.device("cpu"))
        self._copies = make_copies(self.device)
        self._pool: HostPool | None = None
        # Bound once: the identity tells our hooks apart from other saved-tensor hooks on the stack.
        self._pack_fn = self._pack
        self._unpack_fn = self._unpack
        if not enabled:
            return
        self._pool = HostPool(self.device.index if self.device.type == "cuda" else None)
        self._calls = _HookCalls(self)
        self._hooks = _scopes.install_layers(self._calls)
        self._scope_hooks = _scopes.install_scopes(self._calls)

    # ----------------------------------------------------------------- scopes
    def _layer_started(self, i: int) -> None:
        if self._measure is not None and i not in self._times.layers:
            self._times.layers[i] = self._copies.mark()
        if self._inflight:
            self._release_through(i - RELEASE_LAG)
            self._poll()

    def _forward_done(self) -> None:
        """The last decoder layer's forward ended: a measured step (the budget mode's, with the offloader
        in it or not) marks when, so its plan can scale the forward pass apart from the backward."""
        c = self._control
        if (
            self._active
            and c is not None
            and c.mode in _autoplan.TIMED_FORWARD
            and self._times.start is not None
            and self._times.layers_end is None
            and torch._C._current_graph_task_id() == -1  # not a checkpoint's recomputation in backward
        ):
            self._times.layers_end = self._copies.mark()

    def _live(self) -> bool:
        # Not while backward runs: a checkpoint's recomputation needs its tensors at once.
        return (
            self._active
            and not self._bypass
            and torch.is_grad_enabled()
            and torch._C._current_graph_task_id() == -1
        )

    def _select(self, selected: set[tuple[str, int]] | None) -> None:
        self._selected = selected
        self._hook_layers = self._all_layers if selected is None else {layer for _, layer in selected}
        if self.enabled and selected != self._hooked:
            # Only the chosen scopes' modules carry hooks (a step out of the offloader: none at all). Called
            # between steps, or from the first layer's pre-hook, before any scope's module has run.
            for h in self._scope_hooks:
                h.remove()
            self._scope_hooks = _scopes.install_scopes(self._calls, selected)
            self._hooked = None if selected is None else set(selected)

    def _wants(self, scope: tuple[str, int]) -> bool:
        # A scope the plan did not choose opens no hooks of its own: its tensors take the shared path.
        return self._selected is None or scope in self._selected

    def _enter_layer(self, i: int, args: tuple, kwargs: dict) -> None:
        live = self._live()
        self._push(None, hooks=live and i in self._hook_layers)
        if not live:
            return
        self._layer_started(i)
        if self.prefetch and i not in self._hook_layers and self._groups and min(self._groups) < i - 1:
            # The gradient of this layer's input is computed when backward leaves it: the next layer down
            # starts then, and the one below that is reloaded. Layers with nothing offloaded unpack nothing
            # through the hooks, so without this the first reload of a plan that offloads only early
            # layers would start when its tensors are needed. (A layer with a chosen scope starts that
            # reload from its own first unpack: a tensor hook per layer would cost the host ~30 us.)
            x = _scopes.layer_input(args, kwargs)
            if x is not None and x.requires_grad:
                x.register_hook(lambda g, below=i - 1: self._reload_ahead(below))

    def _first_layer(self, args: tuple, kwargs: dict) -> None:
        """Budget mode: the step's input shape is known; a shape other than the last step's is planned on
        its own (measured now if it is new)."""
        c = self._control
        if c is None or not self._active or c.key_seen:
            return
        if not torch.is_grad_enabled() or torch._C._current_graph_task_id() != -1:
            return
        if c.first_layer(_autoplan.shape_key(args, kwargs), self._bypass):
            self._apply(c.mode)

    def _apply(self, mode: str) -> None:
        """Budget mode: what this step records (a measured step) and offloads (the plan's selection)."""
        assert self._control is not None
        profile = mode == _autoplan.PROFILE
        self._measure = {} if profile else None
        # Out of the step (a reference step too): no layer keeps a hook, whose host time would count.
        out = mode in _autoplan.OUT_OF_STEP
        self._select(None if profile else set() if out else self._control.selection())

    @property
    def plan(self) -> _budget.OffloadPlan | None:
        """Budget mode: the plan of the last step's input shape (``None`` until its reference steps ran)."""
        return None if self._control is None else self._control.current_plan(self._control.expect)

    @property
    def plans(self) -> dict[int | None, _budget.OffloadPlan]:
        """Budget mode: the plan per input-shape bucket (the bit length of the first layer's input size)."""
        c = self._control
        if c is None:
            return {}
        return {k: p for k in c.shapes if (p := c.current_plan(k)) is not None}

    @property
    def settled(self) -> bool:
        """Whether the next step runs a settled plan (always, without a budget): the budget mode measures
        and checks its plan on the first steps of each input shape."""
        return self._control is None or self._control.settled

    def _push(self, scope: tuple[str, int] | None, *, hooks: bool = False) -> None:
        """Enter a scope (``None``: not offloaded); ``hooks``: route saved tensors through this handle's
        hooks even without a scope (a chosen layer: its tensors may share a storage with an offloaded one).
        """
        self._scope.append(scope)
        if scope is not None and self._inflight:
            # Completed copies are let go where a chosen module or a layer begins, not at every saved
            # tensor: a poll is a Python call and an event query, and a layer saves dozens of tensors.
            self._poll()
        push = False
        if scope is not None or hooks:
            top = torch._C._autograd._top_saved_tensors_default_hooks(False)
            if top is None or top[0] is self._pack_fn:
                push = True
            else:
                # Another mechanism (torch.utils.checkpoint, save_on_cpu) owns these tensors: defer to it.
                self._step["deferred_scopes"] += 1
        if push:
            torch._C._autograd._push_saved_tensors_default_hooks(self._pack_fn, self._unpack_fn)
        self._pushed.append(push)

    def _enter_block(self, scopes: frozenset[tuple[str, int]], args: tuple, kwargs: dict) -> None:
        """A block of a layer begins (``_scopes._quiet_hooks``): lift this handle's hooks for its duration
        when they are on only because the layer has a chosen scope elsewhere."""
        quiet = False
        if self._pushed and self._pushed[-1] and self._scope[-1] is None and self._live():
            top = torch._C._autograd._top_saved_tensors_default_hooks(False)
            quiet = (
                top is not None
                and top[0] is self._pack_fn
                and not any(self._wants(s) for s in scopes)
                and not any(self._holds(a) for a in (*args, *kwargs.values()))
            )
        if quiet:
            torch._C._autograd._pop_saved_tensors_default_hooks()
        self._quiet.append(quiet)

    def _leave_block(self) -> None:
        if self._quiet and self._quiet.pop():
            torch._C._autograd._push_saved_tensors_default_hooks(self._pack_fn, self._unpack_fn)

    def _holds(self, t: Any) -> bool:
        """Whether ``t`` is a tensor over a storage offloaded this step."""
        return (
            isinstance(t, torch.Tensor)
            and t.device == self.device
            and t.untyped_storage().data_ptr() in self._by_storage
        )

    def _pop(self) -> None:
        if not self._scope:
            return
        self._scope.pop()
        if self._pushed.pop():
            torch._C._autograd._pop_saved_tensors_default_hooks()

    def owns_layer(self, layer: nn.Module) -> bool:
        """Whether ``layer`` is one of the decoder layers this handle offloads from (``rlmem.checkpoint``
        offloads a checkpointed layer's inputs under its scope)."""
        return id(layer) in self._layer_ids

    @contextmanager
    def scope(self, name: str, layer: int) -> Iterator[None]:
        """Offload what autograd saves inside this block as ``name`` of ``layer`` (for checkpoint inputs)."""
        self._push((name, layer) if self._live() else None)
        try:
            yield
        finally:
            self._pop()

    # ------------------------------------------------------------- context
    def __enter__(self) -> ActivationOffloader:
        if not self.enabled:
            return self
        if self._active:
            raise RuntimeError("this offload_activations handle is already active (nested `with`)")
        if self._copies.capturing():
            raise RuntimeError(
                "rlmem.offload_activations does not support CUDA graph capture yet: enter it outside "
                "the captured region"
            )
        self._active = True
        self._backward = False
        self._step = new_step()
        c = self._control
        if c is not None:
            mode = c.begin()
            self._bypass = mode in _autoplan.OUT_OF_STEP
            self._apply(mode)
            self._times = (
                _autoplan.StepTimes()
                if mode == _autoplan.IDLE
                else _autoplan.StepTimes(start=self._copies.mark(), alloc_start=self._copies.allocated())
            )
            if self._bypass:
                return self
        else:
            self._times = _autoplan.StepTimes()
        _scopes.enter(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        if not self.enabled or not self._active:
            return
        self._active = False
        c = self._control
        if self._bypass:
            self._bypass = False
            self._finish_step()
            if exc[0] is None and c is not None:
                c.end(self._measured(), None)
            return
        _scopes.leave(self)
        while self._quiet:  # a block left by an exception: its layer's hooks back before they are popped
            self._leave_block()
        while self._scope:
            self._pop()
        while self._modes:
            mode = self._modes.pop()
            if mode is not None:
                mode.__exit__(None, None, None)
        self._finish_step()
        if exc[0] is not None or c is None:
            return
        measured, self._measure = self._measure, None
        before = self.plan
        c.end(self._measured(), measured)
        if self.plan is not before and self.plan is not None and self.plan.settled:
            log.info("%s", self.plan)

    def _measured(self) -> _autoplan.Measured:
        assert self._pool is not None
        return _autoplan.Measured(self._times, self._copies, self._pool)

    def _finish_step(self) -> None:
        if self._inflight:
            # Device copies still held are freed in stream order after their copies.
            self._copies.order_after(self._inflight[-1].d2h_done)
        self._copies.end_step()
        for e in self._entries:
            e.dev = e.reload = e.host = None
        self._entries.clear()
        self._by_storage.clear()
        self._inflight.clear()
        self._kept.clear()
        self._kept_seen = 0
        self._groups.clear()
        self._fetched.clear()
        self._seen.clear()
        if self._pool is not None:
            self._step["pool_bytes"] = self._pool.capacity
            self._step["pool_peak_bytes"] = self._pool.peak
            self._pool.reset()
        self._gen += 1
        t = self._totals
        t["steps"] += 1
        t["offloaded_bytes"] += self._step["offloaded_bytes"]
        t["reloaded_bytes"] += self._step["reloaded_bytes"]

    # ------------------------------------------------------------ reporting
    def stats(self) -> ActivationStats:
        """Figures of the last step (bytes offloaded in total and per name, storages shared by several saved
        views, tensors kept as too small or not activations, bytes reloaded and how: prefetched, on demand,
        or still on the device; host pool bytes) and totals over all steps; see :class:`ActivationStats`.
        """
        st = self._step
        return ActivationStats(
            **{k: st[k] for k in STEP_FIELDS},
            by_name=dict(st["by_name"]),
            totals=ActivationTotals(**self._totals),
            plan=None if self.plan is None else self.plan.selection(),
        )

    def remove(self) -> None:
        """Remove the module hooks and free the host pool; the handle becomes a no-op."""
        for h in (*self._hooks, *self._scope_hooks):
            h.remove()
        self._hooks.clear()
        self._scope_hooks.clear()
        if self._pool is not None:
            self._pool.free()
        self.enabled = False


class _HookCalls:
    """The offloader's side of the hooks ``_scopes.install`` registers (its ``Host`` protocol): bound methods,
    so that a hook costs no more than a call of the method itself."""

    def __init__(self, off: ActivationOffloader) -> None:
        self.layer_map, self.names, self.modes = off.layer_map, off.names, off._modes
        self.live, self.wants, self.push, self.pop, self.scope = (
            off._live,
            off._wants,
            off._push,
            off._pop,
            off.scope,
        )
        self.enter_block, self.leave_block = off._enter_block, off._leave_block
        self.enter_layer, self.first_layer, self.forward_done = (
            off._enter_layer,
            off._first_layer,
            off._forward_done,
        )
