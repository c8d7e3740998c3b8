"""One GEMM for a decode step's query, key and value projections.

At decode batch sizes a projection is a GEMM of a few dozen rows against its weight, bound by reading the
weight; the key and value projections of a grouped-query model are small (two KV heads of 128: a 2048 x 256
weight) and each costs a GEMM's fixed latency more than its bytes. On the 2.5B Qwen2 shape at batch 64 the
three GEMMs of a layer took 18 us on an H100 where one GEMM of the concatenated weight took 6 us
(``bench/NOTES.md``). :class:`FusedQKV` keeps that concatenation, a copy derived from the model's weights in
memory the sampler owns, refreshed from them before each generation (the weights may have moved on since:
an optimizer step, a weight sync), and makes the attention modules' ``q_proj`` compute all three while
``k_proj`` and ``v_proj`` hand back their slices of it.

Only Llama-family attention modules (Llama, Mistral, Qwen2, Qwen3) whose three projections are
``nn.Linear`` over the same input, all with a bias or none, are fused; the arithmetic of each output element
is the same dot product, though the GEMM kernel (and so the rounding of its reduction) may differ from the
three separate ones.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

from ._fused import ATTENTIONS

__all__ = ["FusedQKV"]

_PROJ = ("q_proj", "k_proj", "v_proj")


class FusedQKV:
    """The concatenated query/key/value weights of a model's attention modules.

    Args:
        model: the module the sampler runs.
        dtype: the dtype the projections compute in (the copy's).
    """

    def __init__(self, model: nn.Module, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.layers: list[tuple[str, nn.Module]] = []
        for name, m in model.named_modules():
            if type(m).__name__ not in ATTENTIONS:
                continue
            projs = [getattr(m, p, None) for p in _PROJ]
            if not all(isinstance(p, nn.Linear) for p in projs):
                continue
            if len({p.in_features for p in projs}) != 1 or len({p.bias is None for p in projs}) != 1:
                continue
            self.layers.append((name, m))
        self.weights: list[torch.Tensor] = []
        self.biases: list[torch.Tensor | None] = []

    def shapes(self) -> list[tuple[int, ...]]:
        """The tensors the copy needs, in order: each layer's weight (and bias)."""
        out: list[tuple[int, ...]] = []
        for _, m in self.layers:
            rows = sum(getattr(m, p).out_features for p in _PROJ)
            out.append((rows, m.q_proj.in_features))
            if m.q_proj.bias is not None:
                out.append((rows,))
        return out

    def bind(self, tensors: list[torch.Tensor]) -> None:
        """Hold the copy in ``tensors`` (allocated by the caller, in :meth:`shapes`' order)."""
        it = iter(tensors)
        self.weights, self.biases = [], []
        for _, m in self.layers:
            self.weights.append(next(it))
            self.biases.append(next(it) if m.q_proj.bias is not None else None)

    @torch.no_grad()
    def refresh(self, state: Mapping[str, torch.Tensor]) -> None:
        """Copy the current weights in: from ``state`` by parameter name where it has them (a rollout copy,
        shared weights), else the modules' own."""
        for (name, m), w, b in zip(self.layers, self.weights, self.biases, strict=True):
            for part, out in (("weight", w), ("bias", b)):
                if out is None:
                    continue
                src = [state.get(f"{name}.{p}.{part}", getattr(getattr(m, p), part)) for p in _PROJ]
                torch.cat([t.detach().to(self.dtype) for t in src], out=out)

    @contextlib.contextmanager
    def swapped(self) -> Iterator[None]:
        """Within the block, each fused module's ``q_proj`` runs the one GEMM and keeps the key and value
        slices for ``k_proj`` and ``v_proj`` called next on the same input (any other input: their own
        GEMM)."""
        mods: list[nn.Module] = []
        for (_, m), w, b in zip(self.layers, self.weights, self.biases, strict=True):
            sizes = [getattr(m, p).out_features for p in _PROJ]
            kept: dict[str, Any] = {}

            def q(
                x: torch.Tensor, w: torch.Tensor = w, b: Any = b, sizes: Any = sizes, kept: Any = kept
            ) -> Any:
                qs, ks, vs = nn.functional.linear(x, w, b).split(sizes, -1)
                kept.update(x=x, k=ks, v=vs)
                return qs

            def kv(x: torch.Tensor, which: str, proj: nn.Module, kept: Any = kept) -> torch.Tensor:
                if kept.get("x") is x and which in kept:
                    out = kept.pop(which)
                    if "k" not in kept and "v" not in kept:
                        kept.clear()  # hold nothing between steps
                    return out
                return type(proj).forward(proj, x)

            m.q_proj.forward = q
            m.k_proj.forward = lambda x, kv=kv, p=m.k_proj: kv(x, "k", p)
            m.v_proj.forward = lambda x, kv=kv, p=m.v_proj: kv(x, "v", p)
            mods.append(m)
        try:
            yield
        finally:
            for m in mods:
                for p in _PROJ:
                    del getattr(m, p).forward
