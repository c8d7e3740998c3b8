"""Cost of verifying a weight update (rlmem's vLLM backend, ``update_weights(verify=True)``), without vLLM.

The served model's weights are laid out as vLLM lays out a Qwen2's (q, k and v stacked in one ``qkv_proj``,
gate and up in one ``gate_up_proj``, each loaded through a ``weight_loader`` into its rows), on the device;
the shared weights are the Hugging Face tensors of the same model beside them. The load (one copy of every
byte into its place, what an update does) is timed against the verification
(:func:`rlmem.colocate.weight_check.shadow_verify`: every byte loaded again into a shadow, one decoder
layer at a time, and compared with the parameter), and a parameter changed by one element must be found.
Writes bench/results/verify-<machine>.json: ``rlmem bench verify --machine nvidia-h200``.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from ..colocate.weight_check import shadow_verify
from ..models.presets import QWEN2
from ._common import format_table, median
from ._harness import Run

NAME = "verify"
TARGETS: dict[str, tuple[str, float]] = {"detects_one_element": ("==", 1.0)}
TINY = QWEN2["qwen2-tiny"]  # --preset tiny: the one tiny model (rlmem.models.tiny), with a vocabulary
_STACKED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


def hf_shapes(cfg: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """The Hugging Face parameter names and shapes of a Qwen2 of ``cfg`` (``lm_head`` tied, not listed)."""
    h, inter, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    kv = cfg["num_key_value_heads"] * (h // cfg["num_attention_heads"])
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out |= {
            p + "self_attn.q_proj.weight": (h, h),
            p + "self_attn.q_proj.bias": (h,),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.k_proj.bias": (kv,),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.v_proj.bias": (kv,),
            p + "self_attn.o_proj.weight": (h, h),
            p + "mlp.gate_proj.weight": (inter, h),
            p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter),
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
        }
    out["model.norm.weight"] = (h,)
    return out


def _rows_loader(param: torch.Tensor, loaded: torch.Tensor, offset: int) -> None:
    rows = param.data.narrow(0, offset, loaded.shape[0])
    assert rows.shape == loaded.shape, (rows.shape, loaded.shape)
    rows.copy_(loaded)


def _whole_loader(param: torch.Tensor, loaded: torch.Tensor) -> None:
    assert param.shape == loaded.shape, (param.shape, loaded.shape)
    param.data.copy_(loaded)


class StackedLayout:
    """Parameters in vLLM's layout of a Qwen2, loaded from Hugging Face names as its ``load_weights`` does:
    a stacked parameter's rows taken in order by the names stacked into it.

    Args:
        shapes: the Hugging Face names and shapes (:func:`hf_shapes`).
        dtype, device: the parameters'.
    """

    def __init__(self, shapes: dict[str, tuple[int, ...]], dtype: torch.dtype, device: torch.device) -> None:
        self.targets: dict[str, tuple[str, int | None]] = {}  # HF name -> (own name, row offset or None)
        sizes: dict[str, list[int]] = {}
        for name, shape in shapes.items():
            mod, _, leaf = name.rpartition(".")
            parent, _, proj = mod.rpartition(".")
            if proj in _STACKED:
                own = f"{parent}.{_STACKED[proj][0]}.{leaf}"
                rows = sizes.setdefault(own, [0, *shape[1:]])
                self.targets[name] = (own, rows[0])
                rows[0] += shape[0]
            else:
                self.targets[name] = (name, None)
                sizes[name] = list(shape)
        self.params: dict[str, nn.Parameter] = {}
        for own, shape in sizes.items():
            p = nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)
            if own.rsplit(".", 2)[-2] in ("qkv_proj", "gate_up_proj"):
                p.weight_loader = _rows_loader  # type: ignore[attr-defined]
            self.params[own] = p

    @torch.no_grad()
    def load_weights(self, pairs: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, t in pairs:
            own, offset = self.targets[name]
            p = self.params[own]
            loader = getattr(p, "weight_loader", _whole_loader)
            if offset is None:
                loader(p, t)
            else:
                loader(p, t, offset)


def layer_groups(names: Iterable[str]) -> list[list[str]]:
    """Names grouped by decoder layer (those of no layer in one group of their own)."""
    groups: dict[str, list[str]] = {}
    for n in names:
        parts = n.split(".")
        key = ".".join(parts[:3]) if len(parts) > 3 and parts[1] == "layers" else ""
        groups.setdefault(key, []).append(n)
    return list(groups.values())


def measure(cfg: dict[str, Any], dtype: torch.dtype, device: torch.device, repeats: int) -> dict[str, Any]:
    """Load and verification seconds of a model of ``cfg``, and whether a changed element was found."""
    shapes = hf_shapes(cfg)
    gen = torch.Generator(device=device).manual_seed(0)
    sent = {n: torch.randn(s, generator=gen, device=device).to(dtype) for n, s in shapes.items()}
    served = StackedLayout(shapes, dtype, device)
    groups = [[(n, sent[n]) for n in g] for g in layer_groups(sent)]
    nbytes = sum(t.numel() * t.element_size() for t in sent.values())

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    loads, checks = [], []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        served.load_weights(sent.items())
        sync()
        loads.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        differ = shadow_verify(served.params, served.load_weights, groups, default_loader=_whole_loader)
        sync()
        checks.append(time.perf_counter() - t0)
        assert not differ, differ
    # one element of one stacked parameter changed after the load: the verification must name it
    victim = "model.layers.0.self_attn.qkv_proj.weight"
    served.params[victim].data.view(-1)[7] += 1
    found = shadow_verify(served.params, served.load_weights, groups, default_loader=_whole_loader)
    load_s, verify_s = median(loads), median(checks)
    return {
        "params": sum(t.numel() for t in sent.values()),
        "gib": nbytes / 2**30,
        "load_s": load_s,
        "verify_s": verify_s,
        "load_gbps": nbytes / load_s / 1e9,
        "verify_s_per_gib": verify_s / (nbytes / 2**30),
        "verify_vs_load": verify_s / load_s,
        "detects_one_element": found == [victim],
    }


def main(argv: list[str] | None = None) -> int:
    run = Run(NAME, __doc__.splitlines()[0], TARGETS)
    run.parser.add_argument("--preset", default="qwen2-2.5b", choices=[*QWEN2, "tiny"])
    run.parser.add_argument(
        "--dtypes", default="bfloat16,float32", help="comma-separated; the summary: the first"
    )
    run.parser.add_argument("--repeats", type=int, default=3)
    args = run.parse(argv)
    dtypes = [d for d in args.dtypes.split(",") if d]
    bad = [d for d in dtypes if d not in ("bfloat16", "float32")]
    if bad or not dtypes:
        run.parser.error(f"--dtypes: bfloat16 and/or float32, got {args.dtypes!r}")
    cfg = TINY if args.preset == "tiny" else QWEN2[args.preset]
    rows = []
    for dt in dtypes:
        row = {
            "preset": args.preset,
            "dtype": dt,
            **measure(cfg, getattr(torch, dt), run.device, args.repeats),
        }
        rows.append(row)
        print(
            f"{dt}: {row['gib']:.2f} GiB, load {row['load_s']:.4f} s, verify {row['verify_s']:.4f} s",
            flush=True,
        )
    cols = [
        ("preset", "preset", ""),
        ("dtype", "dtype", ""),
        ("gib", "GiB", ".2f"),
        ("load_s", "load s", ".4f"),
    ]
    cols += [("verify_s", "verify s", ".4f"), ("verify_s_per_gib", "verify s/GiB", ".4f")]
    cols += [("verify_vs_load", "verify/load", ".2f"), ("detects_one_element", "finds 1 element", "")]
    print(format_table(rows, cols))
    first = rows[0]
    summary = {k: first[k] for k in ("verify_s_per_gib", "verify_vs_load", "load_gbps", "gib")}
    summary["detects_one_element"] = float(all(r["detects_one_element"] for r in rows))
    run.finish(summary, config={"preset": args.preset, "dtypes": dtypes, "repeats": args.repeats}, rows=rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
