"""Fine-grained activation offloading: the tensors autograd saves inside chosen modules go to host memory
during the forward pass and come back, one layer ahead, during the backward pass.

Mechanics (why each is there):

- Saved-tensor hooks scope the chosen modules (forward pre-hook to forward hook). In a decoder layer with a
  chosen module, a hook outside it only looks up storages already offloaded: a tensor saved in a chosen
  module and again outside it (a norm's output is the next projection's input) shares the copy, otherwise
  the device storage would stay held. Tensors kept on the device get autograd's in-place check from the
  hooks. Layers with nothing chosen run without hooks: a Python call per saved tensor costs the host more
  than the copies do on small layers.
- Each copy runs on a dedicated device-to-host stream, ordered after the producing kernel by an event, into
  a host pool allocated once and reused every step (page-locked on a GPU). The device tensor is released as
  soon as its copy's event is seen complete (polled where a layer or a chosen module begins, never
  synchronised), or in stream order two layers later. Issuing a copy costs the host ~25 us (the current
  stream cached by id, events recorded directly): on small models the host barely keeps ahead of the GPU.
- A storage shared by several saved views is copied once; parameters, buffers, inputs, casts of parameters
  and tensor subclasses are never offloaded.
- In backward, the first tensor needed from a layer starts the copy back of the layer before it, on a
  host-to-device stream, so reloads run under the backward compute. What is still on the device when
  backward starts (the last ``RELEASE_LAG`` layers' tensors, which the forward pass never frees, and any
  copy not yet completed) is served from there, not reloaded: backward needs the last layers first, and
  their reload would make it wait (on the H100, a small MoE's step: +5-12% for 1.1 GiB offloaded with
  the last layers reloaded, +1.2% without).
- In-place changes to a saved tensor are detected at unpack (saved-tensor hooks switch off autograd's
  version check), and CUDA graph capture is refused.
- On a CPU-only machine the same path runs with host-to-host copies, so the hooks are tested for real.

What this module owns: the public entry, :func:`offload_activations` (its arguments checked, the model's
module map found), and the names other modules import from here. The handle it returns (``_handle``: one
step's state, the scopes' side of the hooks, its saved-tensor hooks and the release order of what they
offload, the budget mode's choice per step, the context), its figures (``_stats``), the scopes' hooks
(``_scopes``, called through its ``Host`` protocol), the saved-tensor records (``_saved``), the copies per
backend (``_transfer``), the host pool (``_pool``), the budget planner (``_budget``) and the budget mode's
per-step loop (``_autoplan``, which reads a step's ``StepTimes``) are their own modules, none of which
imports this one.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from . import _scopes
from ._handle import RELEASE_LAG as RELEASE_LAG  # read from here too (the release order is the handle's)
from ._handle import ActivationOffloader
from ._stats import ActivationStats, ActivationTotals
from .modmap import NAMES, ModuleMap, check_names, find_module_map

__all__ = [
    "CHECKPOINT_INPUT",
    "ActivationOffloader",
    "ActivationStats",
    "ActivationTotals",
    "current",
    "offload_activations",
]

CHECKPOINT_INPUT = "checkpoint_input"
current = _scopes.current


def offload_activations(
    model: nn.Module,
    modules: Sequence[str] | None = None,
    *,
    min_bytes: int = 1 << 20,
    budget: str | int | None = None,
    max_overhead: float = 0.03,
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
        budget: ``"auto"`` measures the first step (what each name and layer saves, and when; nothing
            offloaded; on a GPU measured again if it ran over 1.5x the steps after it, a cold start), then
            three steps with the offloader out of them (the reference, whose forward pass the plan's
            times are scaled to), chooses what the link can copy under the forward pass plus
            ``max_overhead`` of the step (a fixed cost per copy included; the
            last two layers left out: backward uses them first, from the device), and measures the
            steps that run with it against the reference, growing or shrinking the plan evenly over the
            layers until it adds no more than ``max_overhead`` (each size by the median of three steps;
            ``handle.plan.trials``, ``handle.settled``). A plan that settles empty keeps the offloader out
            of the step. Each input-shape bucket (a power of two of the first layer's input size) is
            planned on its own. An integer is a byte budget for the activations left on the device
            (offloading more, hidden or not, until they fit). The choice is in ``handle.plan`` and logged.
        max_overhead: the share of the step the budget mode may add (3% by default); a plan that offloads
            less than a tenth of the step's activation bytes may add no more than 2% (or this, if lower).
            A settled plan's modules alone carry hooks, and an empty one none.
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
        >>> off.stats().offloaded_bytes  # doctest: +SKIP
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
        modules = list(check_names(modules, "modules"))
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
