"""The handle :func:`rlmem.offload_activations` returns, :class:`ActivationOffloader`: one step's state and
what runs around its saved tensors. It owns the scopes' side of the module hooks (``_scopes`` calls it
through its ``Host`` protocol, here :class:`_HookCalls`) and which layers and scopes route their saved
tensors through the hooks, the budget mode's choice of what each step records and offloads (``_autoplan``),
the context (a step's start and end) and the step's figures (``_stats``).

It owns the saved-tensor hooks too, and what they do per offloaded storage: ``_pack`` keeps a tensor,
shares a storage already copied, or starts its copy into the host pool; the in-flight queue lets device
copies go once their copies are seen complete or waited for in stream order (``RELEASE_LAG`` layers
behind); in backward, ``_unpack`` serves a storage from the device or reloads it (on demand, or the layer
below one layer ahead), with autograd's in-place check. They are methods of the handle that read the
step's state from ``self`` directly: they run once per saved tensor, and an object of their own would add
a call and an attribute read to that path.
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
from ._pool import HostPool
from ._saved import Entry, Kept, Packed, eligible, storage_bytes, version_error, view_of
from ._stats import STEP_FIELDS, ActivationStats, ActivationTotals, new_step
from ._transfer import make_copies
from .modmap import LayerMap

__all__ = ["RELEASE_LAG", "ActivationOffloader"]

log = logging.getLogger("rlmem")

# At the start of layer i, the compute stream waits for the copies of layers <= i - RELEASE_LAG and their
# device memory is freed: one layer of compute to hide each layer's copies behind.
RELEASE_LAG = 2


class ActivationOffloader:
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
        self._scope: list[tuple[str, int] | None] = []  # the scope stack (None: not offloaded)
        self._pushed: list[bool] = []
        self._quiet: list[bool] = []  # per block entered: whether its hooks were lifted
        self._modes: list[TorchFunctionMode | None] = []
        self._gen = 0  # the step's number: a packed tensor of another step may not be unpacked
        self._entries: list[Entry] = []
        self._by_storage: dict[int, Entry] = {}  # by the storage's data_ptr
        self._inflight: deque[Entry] = deque()  # device tensors held until their copy is seen done
        self._groups: dict[int, list[Entry]] = {}  # entries per layer
        self._fetched: set[int] = set()  # layers backward has begun to unpack
        self._selected: set[tuple[str, int]] | None = None  # the plan's scopes (None: every chosen one)
        # Layers whose saved tensors pass through the hooks: those with a chosen scope. The others run
        # with no Python in their saved tensors' path (a hook call per saved tensor costs the host).
        self._all_layers = {t.layer for n in names for t in layer_map.targets.get(n, [])}
        self._hook_layers = self._all_layers
        # A measured step's [bytes, first mark, count] per scope.
        self._measure: dict[tuple[str, int], list[Any]] | None = None
        # Budget mode: what each step does (measure, reference, check a plan, run it) per input shape.
        self._control = None if budget is None else _autoplan.BudgetControl(budget, max_overhead, RELEASE_LAG)
        self._bypass = False  # this step runs without the offloader (the budget mode's reference step)
        self._seen: set[int] = set()  # storages a measured step has counted
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

    # ------------------------------------------------------- saved tensors
    def _pack(self, t: torch.Tensor) -> Any:
        scope = self._scope[-1] if self._scope else None
        if scope is None or (self._selected is not None and scope not in self._selected):
            if self._by_storage and type(t) is torch.Tensor and t.device == self.device:
                # Saved again outside the chosen modules (a norm's output is also the MLP's input): share
                # the copy, or the device storage would stay referenced and offloading would free nothing.
                e = self._shared(t, t.untyped_storage())
                if e is not None:
                    e.refs += 1
                    return Packed(e, t, self._gen)
            return Kept(t)
        if self._copies.capturing():
            raise RuntimeError(
                "rlmem.offload_activations does not support CUDA graph capture yet: run the captured "
                "region outside the offload context or disable offloading for it"
            )
        if not eligible(t, self.device):
            self._step["kept_ineligible"] += 1
            return Kept(t)
        storage = t.untyped_storage()
        nbytes = storage.nbytes()
        if nbytes < self.min_bytes or nbytes == 0:
            self._step["kept_small"] += 1
            return Kept(t)
        if self._measure is not None:
            key = storage.data_ptr()
            if key not in self._seen:
                self._seen.add(key)
                rec = self._measure.setdefault(scope, [0, None, 0])
                rec[0] += nbytes
                rec[2] += 1
                if rec[1] is None:
                    rec[1] = self._copies.mark()
            return Kept(t)
        e = self._shared(t, storage)
        if e is None:
            e = self._offload(t, storage, nbytes, scope)
            self._by_storage[storage.data_ptr()] = e
        e.refs += 1
        return Packed(e, t, self._gen)

    def _shared(self, t: torch.Tensor, storage: Any) -> Entry | None:
        """The entry already holding ``t``'s storage, unchanged since it was copied, if any."""
        e = self._by_storage.get(storage.data_ptr())
        if e is not None and e.storage() is storage and e.version == t._version:
            self._step["dedup_hits"] += 1
            return e
        return None

    def _offload(self, t: torch.Tensor, storage: Any, nbytes: int, scope: tuple[str, int]) -> Entry:
        assert self._pool is not None
        name, layer = scope
        e = Entry(nbytes, layer, storage, t._version)
        host = self._pool.alloc(nbytes)
        e.d2h_done = self._copies.copy_out(storage_bytes(storage), host)
        if self._copies.asynchronous:
            e.dev = t
            self._inflight.append(e)
            if layer >= self._keep_from:
                self._kept.append(e)
        e.host = host
        self._entries.append(e)
        self._groups.setdefault(layer, []).append(e)
        st = self._step
        st["offloaded_bytes"] += nbytes
        st["offloaded_tensors"] += 1
        st["by_name"][name] = st["by_name"].get(name, 0) + nbytes
        return e

    def _release_through(self, group: int) -> None:
        """Free the device copies of layers <= ``group`` in stream order: the compute stream waits for their
        copies, so what it allocates next may reuse the memory.

        The caching allocator counts memory in the order the host issues work, and the host runs ahead of
        the device: a copy the host has not yet seen complete cannot be freed by polling, however early the
        device finished it. Waiting in stream order frees it on time; it stalls the compute only if the
        copies fall more than ``RELEASE_LAG`` layers behind, which the budget mode avoids.
        """
        q = self._inflight
        n = 0
        while n < len(q) and q[n].group <= group:
            n += 1
        if not n:
            return
        # One wait covers them all (the copies run in order on one stream), enqueued before the memory
        # goes back to the allocator.
        self._copies.order_after(q[n - 1].d2h_done)
        for _ in range(n):
            self._copied(q.popleft())

    def _poll(self) -> None:
        q = self._inflight
        while q and q[0].group < self._keep_from and self._copies.done(q[0].d2h_done):
            self._copied(q.popleft())
        if self._kept_seen < len(self._kept):
            self._note_kept()

    def _note_kept(self) -> None:
        """Note which of the kept layers' copies completed before any in-place change of their tensor (the
        host copy then holds the saved value, should the device tensor change later)."""
        k = self._kept
        while self._kept_seen < len(k) and self._copies.done(k[self._kept_seen].d2h_done):
            e = k[self._kept_seen]
            e.clean = e.dev is not None and e.dev._version == e.version
            self._kept_seen += 1

    @staticmethod
    def _copied(e: Entry) -> None:
        """Let go of the device storage of an entry whose copy is done (or waited for)."""
        if e.dev is not None and e.dev._version != e.version:
            e.modified = True  # changed in place while its copy was in flight
        e.dev = None

    def _unpack(self, p: Any) -> torch.Tensor:
        if not self._backward and self._active:
            self._backward_started()
        if isinstance(p, Kept):
            if p.tensor._version != p.version:
                raise version_error()
            return p.tensor
        if p.gen != self._gen:
            raise RuntimeError(
                "rlmem.offload_activations: backward ran after the offload context that saved its tensors "
                "ended; put forward and backward inside one `with` block"
            )
        e = p.entry
        if e.dev is not None and e.dev._version != e.version:
            if not e.clean:
                raise version_error()
            # Changed in place after its copy completed: the host copy holds the saved value (letting go
            # of the device tensor also lets go of the saved view, checked next, if nothing else holds it).
            self._drop(e)
        orig = p.ref()
        if e.modified or (orig is not None and orig._version != p.version):
            raise version_error()
        if e.group not in self._fetched:
            self._release_after(e.group)
        buf = self._device_copy(e)
        self._prefetch_before(e.group)
        out = view_of(buf, p)
        e.refs -= 1
        if e.refs <= 0:
            self._drop(e)
        return out

    def _backward_started(self) -> None:
        # Where the forward pass left the offloaded bytes: still on the device because the copy had not
        # completed, or released by rlmem but kept alive by another reference (then offloading frees nothing).
        # What is still in flight stays on the device until backward is done with it (not polled away:
        # the last layers' copies have completed by now, and letting their memory go would mean reloading
        # what backward needs first).
        self._backward = True
        self._times.backward_start = self._copies.mark()
        self._note_kept()
        st = self._step
        for e in self._entries:
            if e.dev is not None:
                if not self._copies.done(e.d2h_done):
                    st["copying_at_backward_bytes"] += e.nbytes
            elif e.storage() is not None:
                st["held_elsewhere_bytes"] += e.nbytes
        st["allocated_at_backward"] = self._times.allocated_at_backward = self._copies.allocated()

    def _device_copy(self, e: Entry) -> torch.Tensor:
        st = self._step
        if e.dev is not None:
            st["served_resident"] += 1
            return storage_bytes(e.dev.untyped_storage())
        if e.reload is None:
            self._reload(e)
            st["reloaded_on_demand"] += 1
        else:
            st["reloaded_prefetched"] += 1
        self._copies.order_after(e.ready)
        assert e.reload is not None
        return e.reload

    def _reload(self, e: Entry) -> None:
        assert e.host is not None
        buf = torch.empty(e.nbytes, dtype=torch.uint8, device=self.device)
        e.ready = self._copies.copy_in(e.host, buf, e.d2h_done)
        e.reload = buf
        self._step["reloaded_bytes"] += e.nbytes

    def _release_after(self, group: int) -> None:
        # Backward reached an earlier layer: the later layers' reloads are done with. Not every saved
        # tensor is unpacked, so reference counts alone would keep some reloads until the step ends.
        for g, entries in self._groups.items():
            if g > group:
                for e in entries:
                    if e.reload is not None or e.dev is not None:
                        self._drop(e)

    def _reload_ahead(self, below: int) -> None:
        """Start the copies back of the highest offloaded layer under ``below`` (not yet reloaded)."""
        prev = [g for g in self._groups if g < below]
        if not prev:
            return
        for e in self._groups[max(prev)]:
            if e.dev is None and e.reload is None and e.refs > 0:
                self._reload(e)

    def _prefetch_before(self, group: int) -> None:
        if group in self._fetched:
            return
        self._fetched.add(group)
        if self.prefetch:
            self._reload_ahead(group)

    def _drop(self, e: Entry) -> None:
        if e.dev is not None:
            # Its copy may still be reading it: free it in stream order after the copy.
            self._copies.order_after(e.d2h_done)
        e.dev = None
        e.reload = None

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
