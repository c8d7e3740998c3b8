"""Where the fine-grained activation names live in a model: decoder layers and the modules inside them.

The names are Megatron-Core's (``attn_norm, qkv_linear, core_attn, attn_proj, mlp_norm, expert_fc1,
moe_act``). Hugging Face Llama, Qwen2, Qwen2-MoE, Qwen3-MoE, Mixtral and GPT-2 (and models built like them)
are mapped by module type and structure: the decoder layers are the longest ``ModuleList`` of identical
blocks that hold an attention module; inside a layer the norms are its norm-typed children in order, the
attention is the child typed as attention, its last linear child is the output projection and the others
project q, k and v, and experts are a module with 3-D weights or a list of identical MLPs.

Megatron-Core's ``TransformerLayer`` (the names' own home) is recognised by the submodules its layer spec
defines (``input_layernorm``, ``self_attention.{linear_qkv, core_attention, linear_proj}``,
``pre_mlp_layernorm``, ``mlp``), which are the same in the local and the Transformer Engine spec: each name
maps to the module Megatron's own offloading wraps. In the Transformer Engine spec the norms are fused into
``linear_qkv`` / ``linear_fc1`` (``input_layernorm`` is an ``IdentityOp``), so ``attn_norm`` and ``mlp_norm``
have no module of their own there and are absent. MoE layers: ``expert_fc1`` is each local expert's
``linear_fc1`` (``SequentialMLP``) or the grouped ``linear_fc1`` (``TEGroupedMLP``); Megatron's experts apply
their activation as a function, not a module, so ``moe_act`` is absent. Other models pass a
:class:`ModuleMap` of module-path patterns.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

__all__ = ["DENSE_NAMES", "NAMES", "SHARED_INPUT", "ModuleMap", "Target", "check_names", "find_module_map"]

# In the order a decoder layer's forward pass produces them; a dense layer has the first five.
NAMES = ("attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm", "expert_fc1", "moe_act")
DENSE_NAMES = NAMES[:5]
# Name -> the name whose output is its saved input (one storage, saved by both): attn_proj's input is
# core_attn's output. Offloading attn_proj alone would copy a storage core_attn still holds on the device
# (freeing nothing), and once core_attn is offloaded attn_proj costs no further bytes.
SHARED_INPUT = {"attn_proj": "core_attn"}


def check_names(names: object, field: str, valid: tuple[str, ...] = NAMES) -> tuple[str, ...]:
    """Validate a list of activation names; returns them as a tuple without duplicates.

    Raises:
        ValueError: naming ``field``: a string instead of a list, an empty list, an unknown name (listing
            the valid ones), or a name without the one whose output it saves (:data:`SHARED_INPUT`).
    """
    if isinstance(names, str) or not isinstance(names, (list, tuple)):
        raise ValueError(f"{field} must be a list of names, got {names!r}; valid names: {', '.join(valid)}")
    if not names:
        raise ValueError(f"{field} must not be empty; valid names: {', '.join(valid)}")
    unknown = [m for m in names if m not in valid]
    if unknown:
        raise ValueError(f"{field}: unknown name(s) {unknown}; valid names: {', '.join(valid)}")
    for name, src in SHARED_INPUT.items():
        if name in names and src not in names:
            raise ValueError(f"{field}: {name!r} requires {src!r} (its input is {src}'s output)")
    return tuple(dict.fromkeys(names))


_NUM = re.compile(r"(?:^|\.)(\d+)(?:\.|$)")


@dataclass(frozen=True)
class Target:
    """One place a name's activations are produced.

    ``module``'s forward is the scope, except where ``param`` names one of its parameters: then only calls
    inside ``module`` that take that parameter (or a view of it) are, as for fused experts whose first
    matmul is not a module. The name, not the object, is kept: FSDP2 swaps parameter objects.
    """

    name: str
    layer: int
    path: str
    module: nn.Module = field(compare=False, repr=False)
    param: str | None = None


@dataclass(frozen=True, kw_only=True)
class ModuleMap:
    """Module-path patterns for a model rlmem does not recognise: ``fnmatch`` globs matched one path
    component at a time over ``model.named_modules()`` paths (``*`` never crosses a ``.``, so
    ``"blocks.*"`` matches ``blocks.3`` and not ``blocks.3.attn``).

    Args:
        layers: pattern of the decoder layers, e.g. ``"model.layers.*"``; a layer's index is the first
            number in its path.
        modules: for each name, a pattern or a list of patterns, e.g.
            ``{"core_attn": "model.layers.*.attn", "qkv_linear": "model.layers.*.attn.wqkv"}``.

    Raises:
        ValueError: an unknown name, or a pattern that is not a string.

    Example:
        >>> ModuleMap(layers="blocks.*", modules={"attn_norm": "blocks.*.norm1"})  # doctest: +SKIP
    """

    layers: str
    modules: dict[str, str | list[str]]

    def __post_init__(self) -> None:
        if not isinstance(self.layers, str) or not self.layers:
            raise ValueError(f"ModuleMap.layers must be a non-empty pattern string, got {self.layers!r}")
        if not isinstance(self.modules, dict):
            raise ValueError(f"ModuleMap.modules must be a dict of name -> pattern(s), got {self.modules!r}")
        for name, pats in self.modules.items():
            if name not in NAMES:
                raise ValueError(f"ModuleMap.modules: unknown name {name!r}; valid names: {', '.join(NAMES)}")
            for p in [pats] if isinstance(pats, str) else pats:
                if not isinstance(p, str) or not p:
                    raise ValueError(f"ModuleMap.modules[{name!r}]: patterns must be strings, got {p!r}")


@dataclass
class LayerMap:
    """What :func:`find_module_map` found: decoder layers in order and each name's targets."""

    model_class: str
    layers: list[tuple[str, nn.Module]]
    targets: dict[str, list[Target]]
    hidden_size: int | None = None

    def names(self) -> list[str]:
        """The names this model has, in :data:`NAMES` order."""
        return [n for n in NAMES if self.targets.get(n)]


def _is_linear(m: nn.Module) -> bool:
    # HF GPT-2's Conv1D is a linear layer with a transposed weight.
    return isinstance(m, nn.Linear) or type(m).__name__ == "Conv1D"


def _is_norm(m: nn.Module) -> bool:
    if isinstance(m, (nn.LayerNorm, nn.RMSNorm, nn.GroupNorm)):
        return True
    name = type(m).__name__.lower()
    params = list(m.parameters(recurse=False))
    return (
        name.endswith("norm")
        and not list(m.children())
        and bool(params)
        and all(p.dim() == 1 for p in params)
    )


def _is_attention(m: nn.Module) -> bool:
    name = type(m).__name__.lower()
    return ("attention" in name or "attn" in name) and any(_is_linear(c) for c in m.children())


def _is_activation(m: nn.Module) -> bool:
    if list(m.parameters()) or list(m.children()):
        return False
    name = type(m).__name__.lower()
    return isinstance(m, (nn.SiLU, nn.GELU, nn.ReLU, nn.Tanh, nn.Sigmoid, nn.Mish)) or any(
        k in name for k in ("activation", "silu", "gelu", "relu", "swish", "quickgelu")
    )


# Megatron-Core's TransformerLayer: the submodule names its layer spec fills in.
_MC_LAYER = ("input_layernorm", "self_attention", "pre_mlp_layernorm", "mlp")


def _is_megatron_layer(m: nn.Module) -> bool:
    kids = dict(m.named_children())
    return all(n in kids for n in _MC_LAYER) and isinstance(
        getattr(kids["self_attention"], "core_attention", None), nn.Module
    )


def _decoder_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    best: list[tuple[str, nn.Module]] = []
    for path, m in model.named_modules():
        if not isinstance(m, nn.ModuleList) or len(m) == 0:
            continue
        kinds = {type(c) for c in m}
        if len(kinds) != 1 or not (
            _is_megatron_layer(m[0]) or any(_is_attention(c) for c in m[0].children())
        ):
            continue
        if len(m) > len(best):
            best = [(f"{path}.{i}" if path else str(i), c) for i, c in enumerate(m)]
    return best


def _experts(block: nn.Module) -> nn.Module | None:
    for m in block.modules():
        if any(p.dim() == 3 for p in m.parameters(recurse=False)):
            return m
        same = isinstance(m, nn.ModuleList) and len(m) >= 2 and len({type(c) for c in m}) == 1
        if same and any(_is_linear(c) for c in m[0].modules()):
            return m
    return None


def _map_megatron_layer(layer: nn.Module, add: Callable[[str, str, nn.Module], None]) -> int | None:
    attn = layer.self_attention
    hidden = None
    norm = layer.input_layernorm
    if list(norm.parameters()):  # an IdentityOp when the norm is fused into linear_qkv (TE spec)
        add("attn_norm", "input_layernorm", norm)
        w = getattr(norm, "weight", None)
        hidden = int(w.shape[0]) if isinstance(w, torch.Tensor) else None
    for name, sub in (
        ("qkv_linear", "linear_qkv"),
        ("core_attn", "core_attention"),
        ("attn_proj", "linear_proj"),
    ):
        m = getattr(attn, sub, None)
        if isinstance(m, nn.Module):
            add(name, f"self_attention.{sub}", m)
    qkv_w = getattr(getattr(attn, "linear_qkv", None), "weight", None)
    if hidden is None and isinstance(qkv_w, torch.Tensor) and qkv_w.dim() == 2:
        hidden = int(qkv_w.shape[1])
    if list(layer.pre_mlp_layernorm.parameters()):
        add("mlp_norm", "pre_mlp_layernorm", layer.pre_mlp_layernorm)
    experts = getattr(layer.mlp, "experts", None)
    if isinstance(experts, nn.Module):
        local = getattr(experts, "local_experts", None)
        if isinstance(local, nn.ModuleList):  # SequentialMLP: one MLP per local expert
            for k, e in enumerate(local):
                if isinstance(getattr(e, "linear_fc1", None), nn.Module):
                    add("expert_fc1", f"mlp.experts.local_experts.{k}.linear_fc1", e.linear_fc1)
        elif isinstance(getattr(experts, "linear_fc1", None), nn.Module):  # grouped experts (TEGroupedMLP)
            add("expert_fc1", "mlp.experts.linear_fc1", experts.linear_fc1)
    return hidden


def _map_layer(i: int, path: str, layer: nn.Module, targets: dict[str, list[Target]]) -> int | None:
    def add(name: str, sub: str, m: nn.Module, param: str | None = None) -> None:
        targets.setdefault(name, []).append(Target(name, i, f"{path}.{sub}" if sub else path, m, param))

    if _is_megatron_layer(layer):
        return _map_megatron_layer(layer, add)

    norms = [(n, c) for n, c in layer.named_children() if _is_norm(c)]
    hidden = None
    if norms:
        add("attn_norm", norms[0][0], norms[0][1])
        w = getattr(norms[0][1], "weight", None)
        hidden = int(w.shape[0]) if w is not None else None
    if len(norms) >= 2:
        add("mlp_norm", norms[1][0], norms[1][1])
    for an, attn in layer.named_children():
        if not _is_attention(attn):
            continue
        add("core_attn", an, attn)
        lins = [(n, c) for n, c in attn.named_children() if _is_linear(c)]
        for n, c in lins[:-1]:
            add("qkv_linear", f"{an}.{n}", c)
        if len(lins) >= 2:
            add("attn_proj", f"{an}.{lins[-1][0]}", lins[-1][1])
        break
    for bn, block in layer.named_children():
        if _is_attention(block) or _is_norm(block):
            continue
        experts = _experts(block)
        if experts is None:
            continue
        epath = next(p for p, m in block.named_modules() if m is experts)
        epath = f"{bn}.{epath}" if epath else bn
        fused = [n for n, p in experts.named_parameters(recurse=False) if p.dim() == 3]
        if fused:
            add("expert_fc1", epath, experts, fused[0])
            for n, c in experts.named_modules():
                if n and _is_activation(c):
                    add("moe_act", f"{epath}.{n}", c)
        else:
            for k, expert in enumerate(experts):
                for n, c in expert.named_modules():
                    sub = f"{epath}.{k}.{n}"
                    if _is_linear(c) and hidden is not None and _in_features(c) == hidden:
                        add("expert_fc1", sub, c)
                    elif n and _is_activation(c):
                        add("moe_act", sub, c)
        break
    return hidden


def _in_features(m: nn.Module) -> int:
    if isinstance(m, nn.Linear):
        return m.in_features
    return int(m.weight.shape[0])  # Conv1D stores (in, out)


def find_module_map(model: nn.Module, module_map: ModuleMap | None = None) -> LayerMap:
    """Locate the decoder layers and each name's modules in ``model``.

    Args:
        model: the model (a wrapper such as FSDP2's keeps the same module tree).
        module_map: patterns for a model rlmem does not recognise; ``None`` finds them by structure.

    Raises:
        ValueError: no decoder layers were found (naming the model class), or a pattern matched nothing.
    """
    cls = type(model).__name__
    targets: dict[str, list[Target]] = {}
    hidden = None
    if module_map is None:
        layers = _decoder_layers(model)
        if not layers:
            raise ValueError(
                f"{cls}: no decoder layers found (a ModuleList of identical blocks holding an attention "
                "module); pass module_map=rlmem.ModuleMap(layers=..., modules={...}) for this model"
            )
        for i, (path, layer) in enumerate(layers):
            h = _map_layer(i, path, layer, targets)
            hidden = hidden or h
        return LayerMap(cls, layers, targets, hidden)
    named = list(model.named_modules())
    layers = [(p, m) for p, m in named if _match(p, module_map.layers)]
    if not layers:
        raise ValueError(f"{cls}: ModuleMap.layers pattern {module_map.layers!r} matched no module")
    index = {p: i for i, (p, _) in enumerate(layers)}
    for name, pats in module_map.modules.items():
        for pat in [pats] if isinstance(pats, str) else pats:
            hits = [(p, m) for p, m in named if _match(p, pat)]
            if not hits:
                raise ValueError(f"{cls}: ModuleMap.modules[{name!r}] pattern {pat!r} matched no module")
            for p, m in hits:
                layer = next((index[lp] for lp in index if p == lp or p.startswith(lp + ".")), None)
                if layer is None:
                    found = _NUM.search(p)
                    layer = int(found.group(1)) if found else 0
                targets.setdefault(name, []).append(Target(name, layer, p, m))
    return LayerMap(cls, layers, targets, hidden)


def _match(path: str, pattern: str) -> bool:
    parts, pats = path.split("."), pattern.split(".")
    if len(parts) != len(pats):
        return False
    return all(fnmatch.fnmatchcase(a, b) for a, b in zip(parts, pats, strict=True))
