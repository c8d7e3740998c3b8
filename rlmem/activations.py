"""Fine-grained activation offloading: the tensors autograd saves inside chosen modules go to host memory
during the forward pass and come back, one layer ahead, during the backward pass.

Mechanics (why each is there):

- Saved-tensor hooks scope the chosen modules (forward pre-hook to forward hook). Outside them a hook only
  looks up storages already offloaded: a tensor saved in a chosen module and again outside it (a norm's
  output is the next projection's input) shares the copy, otherwise the device storage would stay held.
  Tensors kept on the device get autograd's in-place check from the hooks.
- Each copy runs on a dedicated device-to-host stream, ordered after the producing kernel by an event, into
  a host pool allocated once and reused every step (page-locked on a GPU). The device tensor is released as
  soon as its copy's event has completed (polled, never synchronised).
- A storage shared by several saved views is copied once; parameters, buffers, inputs, casts of parameters
  and tensor subclasses are never offloaded.
- In backward, the first tensor needed from a layer starts the copy back of the layer before it, on a
  host-to-device stream, so reloads run under the backward compute. A tensor whose copy has not completed
  yet is served from the device, not reloaded.
- In-place changes to a saved tensor are detected at unpack (saved-tensor hooks switch off autograd's
  version check), and CUDA graph capture is refused.
- On a CPU-only machine the same path runs with host-to-host copies, so the hooks are tested for real.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections import deque
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from . import _actplan
from ._actpool import HostPool
from .modmap import NAMES, LayerMap, ModuleMap, Target, find_module_map

__all__ = ["ActivationOffloader", "CHECKPOINT_INPUT", "current", "offload_activations"]

log = logging.getLogger("rlmem")

CHECKPOINT_INPUT = "checkpoint_input"
# At the start of layer i, the compute stream waits for the copies of layers <= i - RELEASE_LAG and their
# device memory is freed: one layer of compute to hide each layer's copies behind.
RELEASE_LAG = 2
_tls = threading.local()


def current() -> ActivationOffloader | None:
    """The offloader whose context is active in this thread, if any (used by :func:`rlmem.checkpoint`)."""
    stack = getattr(_tls, "stack", None)
    return stack[-1] if stack else None


class _Kept:
    """A saved tensor left where it is; its version is checked at unpack as autograd would."""

    __slots__ = ("tensor", "version")

    def __init__(self, t: torch.Tensor) -> None:
        self.tensor = t
        self.version = t._version


class _Entry:
    """One offloaded storage."""

    __slots__ = (
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
        self.storage = storage  # weak reference: the key is valid only while the storage lives
        self.version = version
        self.host: torch.Tensor | None = None
        self.dev: torch.Tensor | None = None
        self.d2h_done: torch.cuda.Event | None = None
        self.reload: torch.Tensor | None = None
        self.ready: torch.cuda.Event | None = None
        self.refs = 0
        self.modified = False


class _Packed:
    __slots__ = ("dtype", "entry", "gen", "offset", "ref", "size", "stride", "version")

    def __init__(self, entry: _Entry, t: torch.Tensor, gen: int) -> None:
        self.entry = entry
        self.size = t.size()
        self.stride = t.stride()
        self.offset = t.storage_offset()
        self.dtype = t.dtype
        self.ref = weakref.ref(t)
        self.version = t._version
        self.gen = gen


def _version_error() -> RuntimeError:
    return RuntimeError(
        "one of the variables needed for gradient computation has been modified by an inplace operation "
        "after rlmem.offload_activations saved it; the gradient would be wrong"
    )


def _view(buf: torch.Tensor, p: _Packed) -> torch.Tensor:
    return torch.empty(0, dtype=p.dtype, device=buf.device).set_(
        buf.untyped_storage(), p.offset, p.size, p.stride
    )


def _storage_bytes(storage: Any) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def _is_param_cast(t: torch.Tensor) -> bool:
    # Autocast's copy of a parameter lives in autocast's cache for the whole forward pass anyway.
    fn = t.grad_fn
    if fn is None or type(fn).__name__ != "ToCopyBackward0":
        return False
    nxt = fn.next_functions
    return bool(nxt) and nxt[0][0] is not None and type(nxt[0][0]).__name__ == "AccumulateGrad"


class _ParamCalls(TorchFunctionMode):
    """Scopes the calls inside a module that take one of its parameters (fused experts' first matmul)."""

    def __init__(self, off: ActivationOffloader, name: str, layer: int, ptr: int) -> None:
        super().__init__()
        self._off, self._name, self._layer, self._ptr = off, name, layer, ptr

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        for a in args:
            if isinstance(a, torch.Tensor) and a.untyped_storage().data_ptr() == self._ptr:
                with self._off.scope(self._name, self._layer):
                    return func(*args, **kwargs)
        return func(*args, **kwargs)


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
        self.plan: _actplan.OffloadPlan | None = None
        self._model_ref = weakref.ref(model)
        self._hooks: list[Any] = []
        self._active = False
        self._scope: list[tuple[str, int] | None] = []
        self._pushed: list[bool] = []
        self._modes: list[TorchFunctionMode] = []
        self._gen = 0
        self._entries: list[_Entry] = []
        self._by_storage: dict[int, _Entry] = {}
        self._inflight: deque[_Entry] = deque()
        self._groups: dict[int, list[_Entry]] = {}
        self._fetched: set[int] = set()
        self._selected: set[tuple[str, int]] | None = None
        self._measure: dict[tuple[str, int], list[Any]] | None = None
        self._seen: set[int] = set()
        self._times: dict[str, Any] = {}
        self._h2d_fence: torch.cuda.Event | None = None
        self._totals = {"steps": 0, "offloaded_bytes": 0, "reloaded_bytes": 0}
        self._step: dict[str, Any] = self._new_step()
        self.device = next((p.device for p in model.parameters()), torch.device("cpu"))
        self._cuda = self.device.type == "cuda"
        self._pool: HostPool | None = None
        # Bound once: the identity tells our hooks apart from other saved-tensor hooks on the stack.
        self._pack_fn = self._pack
        self._unpack_fn = self._unpack
        if not enabled:
            return
        self._pool = HostPool(self.device.index if self._cuda else None)
        if self._cuda:
            from . import _cuda

            self._d2h, self._h2d = _cuda.copy_streams(self.device.index or 0, role="activations")
        if budget is not None:
            self._measure = {}
        self._install()

    # ----------------------------------------------------------------- hooks
    def _install(self) -> None:
        wanted = set(self.names)
        chosen = [t for n in self.names for t in self.layer_map.targets.get(n, [])]
        inside: set[int] = set()
        for t in chosen:
            if t.param is None:
                inside.update(id(m) for m in t.module.modules() if m is not t.module)
        for name, targets in self.layer_map.targets.items():
            for t in targets:
                if name in wanted:
                    self._hook(t, name)
                elif id(t.module) in inside and t.param is None:
                    self._hook(t, None)
        for i, (_, layer) in enumerate(self.layer_map.layers):
            self._hooks.append(layer.register_forward_pre_hook(self._layer_start(i)))

    def _hook(self, t: Target, name: str | None) -> None:
        layer = t.layer
        if t.param is not None:
            pname = t.param

            def pre_param(mod: nn.Module, args: Any) -> None:
                if not self._live():
                    self._modes.append(None)  # type: ignore[arg-type]
                    return
                mode = _ParamCalls(self, t.name, layer, getattr(mod, pname).untyped_storage().data_ptr())
                mode.__enter__()
                self._modes.append(mode)

            def post_param(mod: nn.Module, args: Any, out: Any) -> None:
                if self._modes:
                    mode = self._modes.pop()
                    if mode is not None:
                        mode.__exit__(None, None, None)

            self._hooks.append(t.module.register_forward_pre_hook(pre_param))
            self._hooks.append(t.module.register_forward_hook(post_param, always_call=True))
            return

        scope = None if name is None else (name, layer)

        def pre(mod: nn.Module, args: Any) -> None:
            self._push(scope if self._live() else None)

        def post(mod: nn.Module, args: Any, out: Any) -> None:
            self._pop()

        self._hooks.append(t.module.register_forward_pre_hook(pre))
        self._hooks.append(t.module.register_forward_hook(post, always_call=True))

    def _layer_start(self, i: int):  # type: ignore[no-untyped-def]
        def pre(mod: nn.Module, args: Any) -> None:
            if not self._live():
                return
            if self._measure is not None and i not in self._times.setdefault("layers", {}):
                self._times["layers"][i] = self._mark()
            if self._inflight and self._cuda:
                self._release_through(i - RELEASE_LAG)

        return pre

    def _live(self) -> bool:
        # Not while backward runs: a checkpoint's recomputation needs its tensors at once.
        return self._active and torch.is_grad_enabled() and torch._C._current_graph_task_id() == -1

    def _push(self, scope: tuple[str, int] | None) -> None:
        self._scope.append(scope)
        push = False
        if scope is not None:
            top = torch._C._autograd._top_saved_tensors_default_hooks(False)
            if top is None or top[0] is self._pack_fn:
                push = True
            else:
                # Another mechanism (torch.utils.checkpoint, save_on_cpu) owns these tensors: defer to it.
                self._step["deferred_scopes"] += 1
        if push:
            torch._C._autograd._push_saved_tensors_default_hooks(self._pack_fn, self._unpack_fn)
        self._pushed.append(push)

    def _pop(self) -> None:
        if not self._scope:
            return
        self._scope.pop()
        if self._pushed.pop():
            torch._C._autograd._pop_saved_tensors_default_hooks()

    @contextmanager
    def scope(self, name: str, layer: int) -> Iterator[None]:
        """Offload what autograd saves inside this block as ``name`` of ``layer`` (for checkpoint inputs)."""
        self._push((name, layer) if self._live() else None)
        try:
            yield
        finally:
            self._pop()

    # ----------------------------------------------------------- pack/unpack
    def _eligible(self, t: torch.Tensor) -> bool:
        if type(t) is not torch.Tensor or t.layout != torch.strided or t.is_nested or t.is_quantized:
            return False
        if t.is_leaf or t.device != self.device:
            return False  # parameters, buffers, inputs, constants made without grad
        base = t._base
        if base is not None and base.is_leaf:
            return False  # a view of a parameter or an input
        return not _is_param_cast(t)

    def _pack(self, t: torch.Tensor) -> Any:
        if self._inflight:
            self._poll()  # every saved tensor, not only chosen ones: later layers may offload nothing
        scope = self._scope[-1] if self._scope else None
        if scope is None or (self._selected is not None and scope not in self._selected):
            if self._by_storage and type(t) is torch.Tensor and t.device == self.device:
                # Saved again outside the chosen modules (a norm's output is also the MLP's input): share
                # the copy, or the device storage would stay referenced and offloading would free nothing.
                e = self._shared(t, t.untyped_storage())
                if e is not None:
                    e.refs += 1
                    return _Packed(e, t, self._gen)
            return _Kept(t)
        if self._cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "rlmem.offload_activations does not support CUDA graph capture yet: run the captured "
                "region outside the offload context or disable offloading for it"
            )
        if not self._eligible(t):
            self._step["kept_ineligible"] += 1
            return _Kept(t)
        storage = t.untyped_storage()
        nbytes = storage.nbytes()
        if nbytes < self.min_bytes or nbytes == 0:
            self._step["kept_small"] += 1
            return _Kept(t)
        if self._measure is not None:
            key = storage.data_ptr()
            if key not in self._seen:
                self._seen.add(key)
                rec = self._measure.setdefault(scope, [0, None])
                rec[0] += nbytes
                if rec[1] is None:
                    rec[1] = self._mark()
            return _Kept(t)
        e = self._shared(t, storage)
        if e is None:
            e = self._offload(t, storage, nbytes, scope)
            self._by_storage[storage.data_ptr()] = e
        e.refs += 1
        return _Packed(e, t, self._gen)

    def _shared(self, t: torch.Tensor, storage: Any) -> _Entry | None:
        """The entry already holding ``t``'s storage, unchanged since it was copied, if any."""
        e = self._by_storage.get(storage.data_ptr())
        if e is not None and e.storage() is storage and e.version == t._version:
            self._step["dedup_hits"] += 1
            return e
        return None

    def _offload(self, t: torch.Tensor, storage: Any, nbytes: int, scope: tuple[str, int]) -> _Entry:
        assert self._pool is not None
        name, layer = scope
        e = _Entry(nbytes, layer, weakref.ref(storage), t._version)
        src = _storage_bytes(storage)
        host = self._pool.alloc(nbytes)
        if self._cuda:
            cur = torch.cuda.current_stream(self.device)
            self._d2h.wait_stream(cur)
            if self._h2d_fence is not None:
                # The previous step's reloads may still read these host bytes.
                self._d2h.wait_event(self._h2d_fence)
                self._h2d_fence = None
            with torch.cuda.stream(self._d2h):
                host.copy_(src, non_blocking=True)
                e.d2h_done = torch.cuda.Event()
                e.d2h_done.record(self._d2h)
            e.dev = t  # held (and its version watched) until the copy has completed
            self._inflight.append(e)
        else:
            host.copy_(src)
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
        done = q[n - 1].d2h_done
        assert done is not None
        # One wait covers them all (the copies run in order on one stream), enqueued before the memory
        # goes back to the allocator.
        torch.cuda.current_stream(self.device).wait_event(done)
        for _ in range(n):
            self._copied(q.popleft())

    def _poll(self) -> None:
        q = self._inflight
        while q and q[0].d2h_done is not None and q[0].d2h_done.query():
            self._copied(q.popleft())

    @staticmethod
    def _copied(e: _Entry) -> None:
        """Let go of the device storage of an entry whose copy is done (or waited for)."""
        if e.dev is not None and e.dev._version != e.version:
            e.modified = True  # changed in place while its copy was in flight
        e.dev = None

    def _unpack(self, p: Any) -> torch.Tensor:
        if "backward_start" not in self._times and self._active:
            self._backward_started()
        if isinstance(p, _Kept):
            if p.tensor._version != p.version:
                raise _version_error()
            return p.tensor
        if p.gen != self._gen:
            raise RuntimeError(
                "rlmem.offload_activations: backward ran after the offload context that saved its tensors "
                "ended; put forward and backward inside one `with` block"
            )
        orig = p.ref()
        if orig is not None and orig._version != p.version:
            raise _version_error()
        e = p.entry
        if self._inflight:
            self._poll()
        if e.modified or (e.dev is not None and e.dev._version != e.version):
            raise _version_error()
        if e.group not in self._fetched:
            self._release_after(e.group)
        buf = self._device_copy(e)
        self._prefetch_before(e.group)
        out = _view(buf, p)
        e.refs -= 1
        if e.refs <= 0:
            self._drop(e)
        return out

    def _backward_started(self) -> None:
        # Where the forward pass left the offloaded bytes: still on the device because the copy had not
        # completed, or released by rlmem but kept alive by another reference (then offloading frees nothing).
        self._times["backward_start"] = self._mark()
        if self._inflight:
            self._poll()
        st = self._step
        for e in self._entries:
            if e.dev is not None:
                st["copying_at_backward_bytes"] += e.nbytes
            elif e.storage() is not None:
                st["held_elsewhere_bytes"] += e.nbytes
        if self._cuda:
            st["allocated_at_backward"] = torch.cuda.memory_allocated(self.device)

    def _device_copy(self, e: _Entry) -> torch.Tensor:
        st = self._step
        if e.dev is not None:
            st["served_resident"] += 1
            return _storage_bytes(e.dev.untyped_storage())
        if e.reload is None:
            self._reload(e)
            st["reloaded_on_demand"] += 1
        else:
            st["reloaded_prefetched"] += 1
        if e.ready is not None:
            torch.cuda.current_stream(self.device).wait_event(e.ready)
        assert e.reload is not None
        return e.reload

    def _reload(self, e: _Entry) -> None:
        assert e.host is not None
        buf = torch.empty(e.nbytes, dtype=torch.uint8, device=self.device)
        if self._cuda:
            cur = torch.cuda.current_stream(self.device)
            self._h2d.wait_stream(cur)  # buf's memory may still be read by work queued before it
            if e.d2h_done is not None:
                self._h2d.wait_event(e.d2h_done)
            with torch.cuda.stream(self._h2d):
                buf.copy_(e.host, non_blocking=True)
                e.ready = torch.cuda.Event()
                e.ready.record(self._h2d)
        else:
            buf.copy_(e.host)
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

    def _prefetch_before(self, group: int) -> None:
        if group in self._fetched:
            return
        self._fetched.add(group)
        if not self.prefetch:
            return
        prev = [g for g in self._groups if g < group]
        if not prev:
            return
        for e in self._groups[max(prev)]:
            if e.dev is None and e.reload is None and e.refs > 0:
                self._reload(e)

    def _drop(self, e: _Entry) -> None:
        if e.dev is not None and self._cuda and e.d2h_done is not None:
            # Its copy may still be reading it: free it in stream order after the copy.
            torch.cuda.current_stream(self.device).wait_event(e.d2h_done)
        e.dev = None
        e.reload = None

    # ------------------------------------------------------------- context
    def __enter__(self) -> ActivationOffloader:
        if not self.enabled:
            return self
        if self._active:
            raise RuntimeError("this offload_activations handle is already active (nested `with`)")
        if self._cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "rlmem.offload_activations does not support CUDA graph capture yet: enter it outside "
                "the captured region"
            )
        self._active = True
        self._step = self._new_step()
        self._times = {"start": self._mark()}
        if self._measure is not None:
            self._times["alloc_start"] = torch.cuda.memory_allocated(self.device) if self._cuda else 0
        stack = getattr(_tls, "stack", None)
        if stack is None:
            stack = _tls.stack = []
        stack.append(self)
        # Outside the chosen modules the hooks only look up storages already offloaded (see _pack).
        torch._C._autograd._push_saved_tensors_default_hooks(self._pack_fn, self._unpack_fn)
        return self

    def __exit__(self, *exc: Any) -> None:
        if not self.enabled or not self._active:
            return
        self._active = False
        _tls.stack.remove(self)
        while self._scope:
            self._pop()
        while self._modes:
            mode = self._modes.pop()
            if mode is not None:
                mode.__exit__(None, None, None)
        torch._C._autograd._pop_saved_tensors_default_hooks()
        self._finish_step()
        if self._measure is not None and exc[0] is None:
            self._make_plan()

    def _finish_step(self) -> None:
        if self._cuda:
            cur = torch.cuda.current_stream(self.device)
            if self._inflight:
                # Device copies still held are freed in stream order after their copies.
                last = self._inflight[-1].d2h_done
                assert last is not None
                cur.wait_event(last)
            fence = torch.cuda.Event()
            fence.record(self._h2d)
            self._h2d_fence = fence
        for e in self._entries:
            e.dev = e.reload = e.host = None
        self._entries.clear()
        self._by_storage.clear()
        self._inflight.clear()
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

    @staticmethod
    def _new_step() -> dict[str, Any]:
        return {
            "offloaded_bytes": 0,
            "offloaded_tensors": 0,
            "by_name": {},
            "dedup_hits": 0,
            "kept_small": 0,
            "kept_ineligible": 0,
            "reloaded_bytes": 0,
            "reloaded_prefetched": 0,
            "reloaded_on_demand": 0,
            "served_resident": 0,
            "deferred_scopes": 0,
            "copying_at_backward_bytes": 0,
            "held_elsewhere_bytes": 0,
            "allocated_at_backward": 0,
            "pool_bytes": 0,
            "pool_peak_bytes": 0,
        }

    # ---------------------------------------------------------- budget mode
    def _mark(self) -> Any:
        if self._cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record(torch.cuda.current_stream(self.device))
            return ev
        return time.perf_counter()

    def _elapsed(self, a: Any, b: Any) -> float:
        if self._cuda:
            return a.elapsed_time(b) / 1e3
        return b - a

    def _make_plan(self) -> None:
        assert self._measure is not None
        measured, self._measure = self._measure, None
        times = self._times
        end = self._mark()
        if self._cuda:
            torch.cuda.synchronize(self.device)  # once, after the warm-up step, to read its events
        start = times["start"]
        fwd_end = times.get("backward_start", end)
        forward_s = self._elapsed(start, fwd_end)
        step_s = self._elapsed(start, end)
        cands = [
            _actplan.Candidate(name, layer, nbytes, self._elapsed(start, t0))
            for (name, layer), (nbytes, t0) in measured.items()
        ]
        total = sum(c.nbytes for c in cands)
        at_backward = self._step["allocated_at_backward"]
        act = max(0, int(at_backward - times["alloc_start"])) or total if self._cuda else total
        rate = self._link_rate(max(min(total, 512 << 20), 1 << 20))
        budget = self.budget if self.budget == "auto" else int(self.budget)  # type: ignore[arg-type]
        layer_starts = {i: self._elapsed(start, t) for i, t in times.get("layers", {}).items()}
        plan = _actplan.choose(
            cands,
            layer_starts=layer_starts or None,
            lag=RELEASE_LAG,
            budget=budget,
            d2h_bytes_per_s=rate,
            forward_s=forward_s,
            step_s=step_s,
            activation_bytes=act,
            max_overhead=self.max_overhead,
        )
        self.plan = plan
        self._selected = {(c.name, c.layer) for c in plan.chosen}
        if self._pool is not None and plan.offload_bytes:
            self._pool.reserve(plan.offload_bytes + (64 << 20))
        log.info("%s", plan)

    def _link_rate(self, nbytes: int) -> float:
        """Measured device-to-host bytes per second into this handle's host pool."""
        assert self._pool is not None
        self._pool.reserve(nbytes)
        host = self._pool.alloc(nbytes)
        src = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        best = float("inf")
        for _ in range(3):
            if self._cuda:
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                with torch.cuda.stream(self._d2h):
                    a.record(self._d2h)
                    host.copy_(src, non_blocking=True)
                    b.record(self._d2h)
                b.synchronize()
                best = min(best, a.elapsed_time(b) / 1e3)
            else:
                t0 = time.perf_counter()
                host.copy_(src)
                best = min(best, time.perf_counter() - t0)
        self._pool.reset()
        return nbytes / max(best, 1e-9)

    # ------------------------------------------------------------ reporting
    def stats(self) -> dict[str, Any]:
        """Figures of the last step (bytes offloaded in total and per name, storages shared by several saved
        views, tensors kept as too small or not activations, bytes reloaded and how: prefetched, on demand,
        or still on the device; host pool bytes) and totals over all steps.

        When backward starts: ``copying_at_backward_bytes`` are offloaded storages whose copy had not
        completed (still on the device), ``held_elsewhere_bytes`` those rlmem released but something else
        still references (offloading them freed nothing), ``allocated_at_backward`` the device bytes then.
        """
        out = dict(self._step)
        out["by_name"] = dict(self._step["by_name"])
        out["totals"] = dict(self._totals)
        if self.plan is not None:
            out["plan"] = self.plan.selection()
        return out

    def remove(self) -> None:
        """Remove the module hooks and free the host pool; the handle becomes a no-op."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        if self._pool is not None:
            self._pool.free()
        self.enabled = False


def offload_activations(
    model: nn.Module,
    modules: Sequence[str] | None = None,
    *,
    min_bytes: int = 1 << 20,
    budget: str | int | None = None,
    max_overhead: float = 0.05,
    prefetch: bool = True,
    module_map: ModuleMap | None = None,
    enabled: bool = True,
) -> ActivationOffloader:
    """Offload the activations saved inside the named modules of every decoder layer to host memory.

    Args:
        model: the model (plain, or wrapped in FSDP2: the module tree is the same).
        modules: names among ``attn_norm, qkv_linear, core_attn, attn_proj, mlp_norm, expert_fc1, moe_act``
            (``core_attn`` is the attention computation from q, k, v to its output; ``attn_proj`` needs it,
            since its input is that output). With ``budget``: the candidates (default: all the model has).
        min_bytes: saved tensors whose storage is smaller stay on the device.
        budget: ``"auto"`` measures the first step (nothing offloaded) and then offloads, per name and layer,
            what the link can copy under the forward pass plus ``max_overhead`` of the step; an integer is
            a byte budget for the activations left on the device (offloading more, hidden or not, until
            they fit). The choice is in ``handle.plan`` and logged.
        max_overhead: the share of the step the budget mode may add waiting for copies.
        prefetch: reload the previous layer's tensors while the current one's backward runs.
        module_map: patterns for a model whose layout rlmem does not recognise.
        enabled: ``False`` returns a handle whose context does nothing.

    Raises:
        ValueError: an empty or unknown name list (the message lists the valid names), ``attn_proj``
            without ``core_attn``, a name the model does not have (naming the model class), or a bad
            ``min_bytes``, ``budget`` or ``max_overhead``.

    Example:
        >>> off = rlmem.offload_activations(model, ["core_attn", "attn_proj", "mlp_norm"])  # doctest: +SKIP
        >>> with off:  # doctest: +SKIP
        ...     model(**batch).loss.backward()
        >>> off.stats()["offloaded_bytes"]  # doctest: +SKIP
    """
    if (
        budget is not None
        and budget != "auto"
        and (isinstance(budget, bool) or not isinstance(budget, int) or budget <= 0)
    ):
        raise ValueError(f"budget must be 'auto', a positive number of bytes, or None; got {budget!r}")
    if isinstance(min_bytes, bool) or not isinstance(min_bytes, int) or min_bytes < 0:
        raise ValueError(f"min_bytes must be an integer >= 0, got {min_bytes!r}")
    if not isinstance(max_overhead, (int, float)) or not 0 <= max_overhead < 1:
        raise ValueError(f"max_overhead must be a fraction in [0, 1), got {max_overhead!r}")
    if modules is None and budget is None:
        raise ValueError("modules must list at least one of " + ", ".join(NAMES) + " (or pass budget=)")
    if modules is not None:
        if isinstance(modules, str):
            raise ValueError(f"modules must be a list of names, not the string {modules!r}")
        modules = list(modules)
        if not modules:
            raise ValueError("modules must not be empty; valid names: " + ", ".join(NAMES))
        unknown = [m for m in modules if m not in NAMES]
        if unknown:
            raise ValueError(f"modules: unknown name(s) {unknown}; valid names: {', '.join(NAMES)}")
        if "attn_proj" in modules and "core_attn" not in modules:
            raise ValueError("modules: 'attn_proj' requires 'core_attn' (its input is core_attn's output)")
    layer_map = find_module_map(model, module_map)
    has = layer_map.names()
    if modules is None:
        modules = has
    missing = [m for m in modules if m not in has]
    if missing:
        raise ValueError(
            f"modules: {layer_map.model_class} has no {', '.join(missing)} "
            f"(it has {', '.join(has) or 'none of the names'})"
        )
    return ActivationOffloader(
        model,
        layer_map,
        list(dict.fromkeys(modules)),
        min_bytes=min_bytes,
        budget=budget,
        max_overhead=float(max_overhead),
        prefetch=prefetch,
        enabled=enabled,
    )
