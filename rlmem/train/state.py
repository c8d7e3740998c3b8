"""TrainState: a model's parameters, gradients and optimizer states adopted into Regions, by category.

Adoption moves each tensor into a :class:`rlmem.Region` of its category (``params``, ``grads``,
``optimizer``, ``buffers``) and device, and rebinds the original holders to the new views (``p.data``,
``p.grad``, ``optimizer.state[p][k]``, ``module._buffers[name]``). The user's references (the Parameter
objects, the optimizer, the model) keep working, and every address stays fixed across offload and reload.

Gradients follow PyTorch's own conventions (``_plain.py`` says how), so training is bit-for-bit what it
would be without rlmem; offloading them with ``"discard"`` sets ``p.grad`` to None, as ``zero_grad()`` does.

Optimizer states that ``step()`` creates lazily are adopted after the step that creates them (and at every
offload, which also catches states replaced by ``load_state_dict``). Host-side scalars of CUDA parameters
(the ``step`` counter of non-fused Adam/AdamW) stay where they are.

While a category is offloaded its holders point at its bytes in the host backup, so reading the model or the
optimizer (``state_dict()``, ``torch.save``, ``save_pretrained``, norms) gives exactly what training resumes
from, and writes are what reload brings back. On a GPU they stay tensors of the same device and dtype, over
the pinned backup mapped into the device's address space: moving ``p.data`` to another device would make
autograd drop the parameter's gradient accumulator, on which DistributedDataParallel (and Megatron-Core's DDP)
hook their gradient reduction. Discarded parameters and buffers point at placeholders of the same device,
dtype and shape that hold no memory and raise an error naming rlmem on any use of their values.

What this module owns: the Regions by category (through ``_adopted.Adopted``), the policy of each
category and the state machine of offload / reload / close, the operations in flight, and the stats (formed
by ``_stats.py``). The hooks that refuse a forward pass, an optimizer step or a ``state_dict()`` on released
state are ``_guards.py``'s, registered and kept up to date from here. What belongs to a stack (plain
PyTorch, FSDP1, FSDP2 / DTensor, Megatron-Core) is found and adopted by that stack's source (``_plain.py``,
``_fsdp1.py``, ``_dtensor.py``, ``_megatron.py``, the protocol in ``_source.py``), asked in the order of
:data:`SOURCES`.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from .._checks import check_choice, check_flag
from ..memory.region import Handle, Region
from . import _holders
from ._adopted import CATEGORIES, Adopted
from ._dtensor import DTensorSource
from ._fsdp1 import FlatParamSource
from ._guards import Guards
from ._holders import ViewHolders
from ._megatron import MegatronSource
from ._plain import PlainSource
from ._source import Source, StateItem
from ._stats import CategoryStats, SwitchRecord, TrainStateStats, collect

__all__ = [
    "CATEGORIES",
    "POLICIES",
    "SOURCES",
    "CategoryStats",
    "SwitchRecord",
    "TrainState",
    "TrainStateStats",
]

POLICIES = ("keep", "offload", "discard")
# The stacks a TrainState adopts through, asked in this order: each takes what is its own and passes the
# rest on (Megatron's buffers cover parameters that are plain tensors; FSDP1's FlatParameters and DTensors
# before plain tensors).
SOURCES: tuple[type[Source], ...] = (MegatronSource, FlatParamSource, DTensorSource, PlainSource)


def check_policy(name: str, value: object) -> str:
    return check_choice(name, value, POLICIES)


class TrainState:
    """Parameters, gradients and optimizer states of a model, adopted into Regions so they can be offloaded.

    Args:
        model: any ``nn.Module`` (or a list of them: Megatron's virtual-pipeline chunks), DDP- or
            FSDP2-wrapped too (DTensor parameters: each rank adopts its own shards, and FSDP's sharded
            storage is re-pointed so FSDP keeps working unchanged; gradients FSDP makes are adopted when
            offloaded), FSDP1-wrapped (``FullyShardedDataParallel`` with FULL_SHARD or SHARD_GRAD_OP,
            ``use_orig_params`` either way: each sharded ``FlatParameter``'s storage is re-pointed whole,
            the original parameters' views included; CPU offload, ``param_dtype`` and other strategies are
            refused), or wrapped in Megatron-Core's ``DistributedDataParallel`` (its contiguous parameter
            and gradient buffers are adopted whole, one storage each, and every view of them, ``main_grad``
            and the buckets' included, stays valid). Tied parameters keep one storage; frozen parameters
            count as params;
            parameters with dense non-contiguous strides (a transposed weight) keep them, and the rare ones
            with gaps between elements become contiguous. Parameters may live on several devices
            (one Region per category and device) or on the CPU (host backend).
        optimizer: any ``torch.optim.Optimizer`` over parameters of ``model``, an optimizer that
            Megatron-Core's ``get_megatron_optimizer`` returns (its fp32 main parameters are adopted with
            the optimizer states), or None.
        buffers: also adopt the model's buffers (category ``"buffers"``).
        grads: adopt the gradients (category ``"grads"``). False leaves them PyTorch's own, made by backward
            and freed by ``zero_grad()`` as without rlmem, for a loop that never offloads them: a Region
            would hold their bytes between steps, where PyTorch holds none.
        optimizer_on_step: an ``optimizer.step()`` called while the optimizer states are offloaded brings
            them back for the step and offloads them again after it (both blocking), instead of refusing
            it: the states stay in host memory through the forward and backward passes, whose peak is
            lower by their size, for a loop that reloads everything but the optimizer before training.
        name: a label for Regions, errors and stats.

    Raises:
        ValueError: the optimizer holds a parameter the model does not own, two parameters overlap in
            memory without being the same tensor, a parameter is of a kind that cannot be adopted, or an
            FSDP1 unit has a layout that cannot be (named; nothing is adopted).

    Example:
        >>> model = torch.nn.Linear(4, 4)
        >>> opt = torch.optim.AdamW(model.parameters())
        >>> state = TrainState(model, opt)
        >>> model(torch.ones(2, 4)).sum().backward(); opt.step()
        >>> state.offload(params="offload", grads="discard", optimizer="offload", blocking=True)
        >>> state.reload(blocking=True)
    """

    def __init__(
        self,
        model: nn.Module | list[nn.Module],
        optimizer: Any = None,
        *,
        buffers: bool = False,
        grads: bool = True,
        optimizer_on_step: bool = False,
        name: str = "train",
    ) -> None:
        if isinstance(model, (list, tuple)) and model and all(isinstance(m, nn.Module) for m in model):
            root: nn.Module = nn.ModuleList(model)  # a view of the chunks; they stay as they are
        elif isinstance(model, nn.Module):
            root = model
        else:
            raise ValueError(
                "model must be a torch.nn.Module or a non-empty list of them (model chunks), got "
                f"{type(model).__name__}"
            )
        opts = next((o for o in (s.unwrap(optimizer) for s in SOURCES) if o is not None), None)
        if optimizer is not None and opts is None:
            raise ValueError(
                "optimizer must be a torch.optim.Optimizer, a Megatron-Core optimizer (one with an inner "
                f"torch optimizer, or chained ones) or None, got {type(optimizer).__name__}"
            )
        check_flag("buffers", buffers)
        check_flag("grads", grads)
        check_flag("optimizer_on_step", optimizer_on_step)
        self._adopts_grads = grads
        self._on_step = optimizer_on_step
        self._stepping = False  # the states came back for this step and go away again after it
        self.model = model
        self.optimizer = optimizer
        self.name = name
        self._opts: list[torch.optim.Optimizer] = opts or []
        self._policy: dict[str, str] = dict.fromkeys(CATEGORIES, "keep")
        self._pending: dict[str, list[Handle]] = {c: [] for c in CATEGORIES}
        # Holders pointed away from each category's Regions while they are paused (or until a non-blocking
        # reload has been waited for).
        self._away: dict[str, list[ViewHolders]] = {c: [] for c in CATEGORIES}
        self._last: dict[str, Any] = {
            "offload_s": None,
            "reload_s": None,
            "offload_bytes": 0,
            "reload_bytes": 0,
        }
        self._closed = False
        self._kit = Adopted(name, self.paused)
        params = list(root.parameters())
        self._param_ids = {id(p) for p in params}
        self._sources = [s(self._kit, root, params, self._opts, optimizer) for s in SOURCES]
        self._check_params(params)
        rest = params
        for s in self._sources:
            rest = s.adopt_params(rest)
        if grads:
            rest = params
            for s in self._sources:
                rest = s.adopt_grads(rest)
        # Whether a forward pass with autograd on would write gradients into Regions (FSDP's are made by its
        # reduce-scatter and adopted only when offloaded).
        autograd_grads = bool(self._kit.records("grads"))
        if buffers:
            for s in self._sources:
                s.adopt_buffers(root)
        hooks = self._kit.hooks
        for opt in self._opts:
            hooks.append(opt.register_step_pre_hook(self._before_step))
            hooks.append(opt.register_state_dict_pre_hook(lambda *_: self._drain(("optimizer",), host=True)))
            hooks.append(opt.register_step_post_hook(lambda *_: self.adopt_optimizer_states()))
            hooks.append(opt.register_step_post_hook(self._after_step))
        self.adopt_optimizer_states()
        guarded = [m for m in root.modules() if m._parameters or (buffers and m._buffers)]
        self._guards = Guards(name, self._policy, self.paused, self._param_ids, guarded, autograd_grads)
        for m in guarded:
            hooks.append(m.register_state_dict_pre_hook(self._guards.before_state_dict))
        if any(t.device.type == "cuda" for t in params):
            torch.cuda.empty_cache()  # the tensors adopted from the caching allocator are free now

    # -- adoption ------------------------------------------------------------------------------------
    def _check_params(self, params: list[nn.Parameter]) -> None:
        for p in params:
            if p.is_sparse or p.is_quantized or p.is_meta or not any(s.accepts(p) for s in self._sources):
                raise ValueError(
                    "TrainState adopts dense, materialised parameters (plain tensors or DTensors); got a "
                    f"{type(p.data).__name__} {'meta ' if p.is_meta else ''}parameter of shape "
                    f"{tuple(p.shape)}"
                )
        owned = {id(p) for p in params}
        for opt in self._opts:
            for gi, group in enumerate(opt.param_groups):
                for p in group["params"]:
                    if id(p) not in owned and not any(s.owns(p) for s in self._sources):
                        raise ValueError(
                            f"optimizer param_groups[{gi}] holds a parameter of shape {tuple(p.shape)} "
                            "that is not in the model; TrainState needs a model that owns every optimized "
                            "parameter"
                        )

    def adopt_optimizer_states(self) -> int:
        """Adopt optimizer state tensors not adopted yet (new, or replaced by ``load_state_dict``).

        Called after every ``optimizer.step()`` and at every offload; returns the number of tensors adopted.
        """
        if not self._opts or self._closed or self.paused("optimizer"):
            return 0
        self._drain(("optimizer",), host=False)  # states still pointing at the backup are not new ones
        kit = self._kit
        todo: dict[int, list[StateItem]] = {}
        live: set[tuple[int, str]] = set()
        for opt, p, st in ((o, p, st) for o in self._opts for p, st in o.state.items()):
            for k, v in st.items():
                if not isinstance(v, torch.Tensor) or v.device != p.device:
                    continue  # host scalars of device parameters (Adam's step) stay where they are
                taken = next(
                    ((i, t) for i, s in enumerate(self._sources) if (t := s.takes_state(v)) is not None), None
                )
                if taken is None:
                    continue
                i, t = taken
                item = StateItem(opt, p, k, v, t)
                live.add(item.key)
                had = kit.states.get(item.key)
                if had is None or had[1] != t.data_ptr():
                    todo.setdefault(i, []).append(item)
        for i, items in todo.items():
            self._sources[i].adopt_states(items)
        for key in [k for k in kit.states if k not in live]:
            kit.forget_state(key)
        # A Region whose every view was replaced (load_state_dict) holds nothing live: give it back.
        kit.drop_empty("optimizer")
        adopted = sum(len(items) for items in todo.values())
        if adopted and any(r.device.type == "cuda" for r in kit.regions["optimizer"]):
            torch.cuda.empty_cache()
        return adopted

    # -- hooks ---------------------------------------------------------------------------------------
    def _before_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self._on_step and self._policy["optimizer"] == "offload" and not self._closed:
            if any(r.device.type == "cuda" for r in self._kit.regions["optimizer"]):
                # the blocks PyTorch cached for the forward's and backward's activations go back to the
                # driver first: the states take their place instead of adding to them
                torch.cuda.empty_cache()
            self.reload(params=False, buffers=False, grads=False, optimizer=True, blocking=True)
            self._stepping = True
        self._guards.before_step()
        self._drain(("grads", "optimizer"), host=False)

    def _after_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self._stepping:
            self._stepping = False
            self.offload(params="keep", grads="keep", optimizer="offload", blocking=True)

    def _drain(self, categories: Iterable[str], *, host: bool) -> None:
        """Finish the operations in flight of ``categories``: ordered on the current stream, or with the
        host blocked (``host=True``; a checkpoint must read the states, not memory a reload is filling)."""
        for cat in categories:
            back = bool(self._away[cat]) and not self.paused(cat)
            if back and host:
                # The host waits below before anything can read them: re-point while the copies run.
                self._attach(cat)
            for h in self._pending[cat]:
                h.synchronize() if host else h.wait()
            self._pending[cat] = []
            if back and not host:
                # Stream-ordered: work queued from now on sees the reloaded bytes.
                self._attach(cat)
            if back:
                for s in self._sources:
                    s.on_return(cat)

    def _attach(self, cat: str) -> None:
        _holders.attach(self._away[cat])
        self._away[cat] = []

    # -- offload / reload ----------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        """The device of its Regions (of the first, should they span several); the CPU without any."""
        for c in CATEGORIES:
            for r in self._kit.regions[c]:
                return r.device
        return torch.device("cpu")

    def in_flight(self) -> list[Handle]:
        """The offloads and reloads not waited for yet (``Handle.done()`` tells which have completed)."""
        return [h for c in CATEGORIES for h in self._pending[c]]

    def paused(self, category: str) -> bool:
        """True while ``category``'s memory is released (offloaded or discarded)."""
        return self._policy[category] != "keep"

    def regions(self, category: str | None = None) -> list[Region]:
        """The Regions of one category (or all of them)."""
        if category is None:
            return [r for c in CATEGORIES for r in self._kit.regions[c]]
        return list(self._kit.regions[category])

    def offload(
        self,
        *,
        params: str = "offload",
        grads: str | None = None,
        optimizer: str = "offload",
        buffers: str = "keep",
        blocking: bool = False,
    ) -> None:
        """Release device memory per category: ``"offload"`` (to pinned host memory), ``"discard"`` or
        ``"keep"``. Categories already offloaded are left as they are.

        While a category is offloaded, the model's and optimizer's references to it (``p.data``, a kept
        ``p.grad``, ``optimizer.state[p][k]``, buffers, FSDP2's shards) point at its bytes in the host
        backup: reading them, ``state_dict()``, ``torch.save`` and ``save_pretrained`` give exactly what
        training resumes from, and writes made meanwhile are what ``reload()`` brings back. On a GPU these
        are tensors of the same device over the pinned backup mapped into its address space (a kernel reads
        them over the link, at PCIe speed); on the host backend, CPU tensors over the backup. Calling the
        model or ``optimizer.step()`` meanwhile is refused with a clear error (a call of the model's modules
        over other weights, ``torch.func.functional_call`` over a rollout copy, is not refused).

        Args:
            params, grads, optimizer, buffers: the policy of each category. Discarded parameters and
                buffers become placeholders (same device, dtype and shape, no memory; any use of their
                values raises an error naming rlmem) until ``reload()``, which brings them back
                uninitialised (for weights the caller reloads itself; ``state_dict()`` meanwhile is
                refused); discarded
                gradients become None (as after ``zero_grad()``); discarded optimizer states are forgotten
                (``step()`` starts from fresh state, as a new optimizer would). ``grads`` None:
                ``"discard"``, or ``"keep"`` for a state made with ``grads=False``.
            blocking: return once the memory is released; otherwise release continues in the background
                (``reload()``, ``synchronize()`` and the next ``offload()`` wait for it). Either way the
                references are re-pointed before the call returns, and on a GPU the current stream is
                ordered after the copies (without blocking the host): work queued on it reads the kept
                bytes, and work that does not touch the state waits for the copies too (run it on another
                stream to overlap it with them).

        Raises:
            ValueError: a policy is not one of "keep", "offload", "discard", or ``params="discard"`` is
                asked for FSDP2 parameters (see :meth:`check_policies`).
            HostOutOfMemoryError: a backup could not be allocated; nothing has been released.
        """
        if grads is None:
            grads = "discard" if self._adopts_grads else "keep"
        policies = self.check_policies(params=params, grads=grads, optimizer=optimizer, buffers=buffers)
        check_flag("blocking", blocking)
        self._check_open()
        self._drain(CATEGORIES, host=False)
        self.adopt_optimizer_states()
        t0 = time.perf_counter()
        if policies["optimizer"] == "discard":
            self._kit.forget_states(self._opts)
        moving = [c for c, p in policies.items() if p != "keep" and not self.paused(c)]
        for s in self._sources:
            s.before_offload(policies, moving)
        # Forgotten optimizer states have nothing left to release.
        todo = [c for c in ("optimizer", "grads", "params", "buffers") if c in moving]
        todo = [c for c in todo if not (c == "optimizer" and policies[c] == "discard")]
        # A category with nothing adopted keeps its policy: there is nothing to refuse a forward pass over.
        regions = {c: list(self._kit.regions[c]) for c in todo if self._kit.regions[c]}
        for (
            cat,
            rs,
        ) in regions.items():  # every backup first: a host that cannot hold them errs before any release
            for region in rs:
                if policies[cat] == "offload" or self._kit.zeroed(region):
                    region.reserve_backup()
        nbytes = 0
        handles: list[tuple[str, Handle]] = []
        for cat, rs in regions.items():
            for region in rs:
                h, entries = self._kit.release(cat, region, policies[cat], blocking)
                if policies[cat] == "offload":
                    nbytes += region.used_bytes
                self._away[cat].extend(entries)
                handles.append((cat, h))
            self._policy[cat] = policies[cat]
        self._guards.update(self._closed)
        if not blocking:
            for cat, h in handles:
                self._pending[cat].append(h)
        self._last.update(offload_s=time.perf_counter() - t0 if blocking else None, offload_bytes=nbytes)

    def check_policies(
        self, *, params: str = "keep", grads: str = "keep", optimizer: str = "keep", buffers: str = "keep"
    ) -> dict[str, str]:
        """Validate an offload request for this model; returns the policies by category. Each stack refuses
        what it cannot carry out (``params="discard"`` for FSDP2's sharded storage or Megatron's buffers,
        which cannot be placeholders; ``optimizer="discard"`` of Megatron's main parameters).

        Raises:
            ValueError: naming the category and what to use instead.
        """
        pol = {
            "params": check_policy("params", params),
            "grads": check_policy("grads", grads),
            "optimizer": check_policy("optimizer", optimizer),
            "buffers": check_policy("buffers", buffers),
        }
        if not self._adopts_grads and pol["grads"] != "keep":
            raise ValueError(
                f"grads={grads!r}: TrainState {self.name!r} was made with grads=False, so its gradients are "
                "PyTorch's own and only grads='keep' applies"
            )
        for s in self._sources:
            s.check(pol)
        return pol

    def reload(
        self,
        *,
        params: bool = True,
        buffers: bool = True,
        grads: bool = True,
        optimizer: bool = True,
        blocking: bool = False,
    ) -> None:
        """Bring offloaded categories back: parameters first, optimizer states last; those set False stay
        away (a rollout or an evaluation that needs the weights only, the optimizer states left in host
        memory until ``optimizer.step()`` needs them), with the same guards as after :meth:`offload`.

        Every reference that was pointed at the backup (and still is) is pointed back at the same device
        addresses as before the offload, so views and CUDA graphs taken in the train phase stay valid.

        With ``blocking=False`` the copies run on a dedicated stream: the current stream is ordered after
        the parameter, buffer and gradient copies (so a forward queued now starts as soon as the weights are
        in), and ``optimizer.step()`` waits for the optimizer states, and only it. Until then (or until
        ``optimizer.state_dict()`` or :meth:`synchronize`) ``optimizer.state`` keeps pointing at the backup,
        which holds the same values.

        Args:
            params, buffers, grads, optimizer: whether each category comes back (default: all).
            blocking: wait for the copies.

        Raises:
            ValueError: an argument that is not a bool (named).
            OutOfMemoryError: the device cannot take a category back; categories already back stay back, the
                rest stay offloaded and ``reload()`` can be retried after freeing memory.

        Example:
            >>> state.offload()                                # rollout
            >>> state.reload(optimizer=False)                  # evaluation: the weights only
            >>> state.reload()                                 # train: the rest, before optimizer.step()
        """
        wanted = {"params": params, "buffers": buffers, "grads": grads, "optimizer": optimizer}
        for name, flag in wanted.items():
            check_flag(name, flag)
        check_flag("blocking", blocking)
        self._check_open()
        self._drain(CATEGORIES, host=False)
        t0 = time.perf_counter()
        nbytes = 0
        try:
            for cat in CATEGORIES:
                if not wanted[cat] or not self.paused(cat):
                    continue
                for region in self._kit.regions[cat]:
                    if region.paused:
                        h = region.resume(blocking=blocking)
                        nbytes += region.stats().last_resume_bytes
                        if not blocking:
                            self._pending[cat].append(h)
                self._policy[cat] = "keep"
        finally:
            self._guards.update(self._closed)
            # Holders go back once their bytes are ordered (non-blocking: on the current stream).
            self._drain(CATEGORIES if blocking else ("params", "buffers", "grads"), host=False)
        self._last.update(reload_s=time.perf_counter() - t0 if blocking else None, reload_bytes=nbytes)

    def backup_categories(self, policies: dict[str, str]) -> list[str]:
        """The categories whose offload under ``policies`` needs a pinned backup: those offloaded, and those
        discarded to a zeroed backup (Megatron's gradient buffers)."""
        return [
            c
            for c, p in policies.items()
            if p == "offload" or (p == "discard" and any(self._kit.zeroed(r) for r in self._kit.regions[c]))
        ]

    def reserve_backups(
        self, categories: Iterable[str] = ("params", "optimizer"), *, blocking: bool = False
    ) -> None:
        """Allocate the pinned backups of ``categories`` now (in the background by default), so that the
        first offload runs at link speed instead of waiting for page-locking."""
        for cat in categories:
            for region in self._kit.regions[cat]:
                region.reserve_backup(blocking=blocking)

    def synchronize(self) -> None:
        """Block until every offload or reload in flight has completed."""
        self._drain(CATEGORIES, host=True)

    # -- stats and teardown --------------------------------------------------------------------------
    def stats(self) -> TrainStateStats:
        """Bytes per category (total, resident, host backup), the current policy, and the last switch."""
        return collect(self._kit.regions, self._policy, self._last)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"TrainState {self.name!r} is closed")

    def close(self) -> None:
        """Give every tensor back to PyTorch's allocator (reloading first if needed) and remove the hooks.

        The model and optimizer keep working without rlmem afterwards. Idempotent.
        """
        if self._closed:
            return
        self.reload(blocking=True)
        self.synchronize()
        for s in self._sources:
            s.before_close()
        self._kit.restore()
        for h in self._kit.hooks:
            h.remove()
        self._kit.hooks.clear()
        for region in self.regions():
            region.close()
        self._closed = True
