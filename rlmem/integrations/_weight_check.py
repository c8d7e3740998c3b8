"""Checks of a weight update against the model that takes it, with no inference framework imported here
(``vllm_transfer`` uses them inside vLLM's workers; the tests and ``rlmem bench verify`` use them without
vLLM):

- :func:`read_manifest`: the names, shapes and dtypes of the checkpoint a server loaded (its safetensors
  headers; no tensor is read);
- :func:`check_update`: the whole update against that manifest before a byte is loaded: every name known,
  every shape equal, every dtype one the loader casts, the set complete unless partial, a tied pair
  consistent;
- :func:`shadow_verify`: after an update, what the model holds against what loading the sent tensors gives,
  parameter by parameter, on the model's device: the sent tensors are loaded again through the model's own
  weight loaders into shadow tensors (one group of names at a time, so the extra memory is one group's
  parameters), and each shadow is compared with the parameter exactly.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

__all__ = ["Manifest", "check_update", "read_manifest", "shadow_verify"]

# name -> (shape, dtype)
Manifest = dict[str, tuple[tuple[int, ...], torch.dtype]]

_ST_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
_HEADER_MAX = 100 << 20  # safetensors' own bound on a header


def _header(path: Path) -> dict[str, Any]:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if not 0 < n <= _HEADER_MAX:
            raise ValueError(f"{path}: not a safetensors file (header of {n} bytes)")
        return json.loads(f.read(n))


def read_manifest(model_dir: str | Path) -> Manifest | None:
    """What the checkpoint in ``model_dir`` holds: each tensor's name, shape and dtype, from the headers of
    its ``*.safetensors`` files (the index's shards, or every file). None where there is none (a GGUF or
    ``.bin`` checkpoint, a hub name not on this disk).

    Raises:
        ValueError: a file that is not safetensors, or a dtype this reader does not know.
    """
    root = Path(model_dir)
    if not root.is_dir():
        return None
    index = root / "model.safetensors.index.json"
    if index.is_file():
        files = sorted({root / f for f in json.loads(index.read_text())["weight_map"].values()})
    else:
        files = sorted(root.glob("*.safetensors"))
    if not files:
        return None
    out: Manifest = {}
    for path in files:
        for name, meta in _header(path).items():
            if name == "__metadata__":
                continue
            if meta["dtype"] not in _ST_DTYPES:
                raise ValueError(f"{path}: tensor {name!r} has dtype {meta['dtype']!r}, not one rlmem reads")
            out[name] = (tuple(int(s) for s in meta["shape"]), _ST_DTYPES[meta["dtype"]])
    return out


def _castable(sent: torch.dtype, want: torch.dtype) -> bool:
    # The loaders copy into the parameter (``param.data.copy_``): a float cast to another float is what
    # loading a checkpoint does too; an integer or a quantized tensor must come as it is.
    return sent == want or (sent.is_floating_point and want.is_floating_point)


def check_update(
    manifest: Manifest,
    sent: Mapping[str, torch.Tensor],
    *,
    partial: bool = False,
    tied: Mapping[str, str] | None = None,
) -> None:
    """Refuse an update that would not load as ``manifest`` says, before anything is loaded.

    Args:
        manifest: the model's checkpoint (:func:`read_manifest`).
        sent: the update, by name (only shapes and dtypes are read, and the tied pair's values).
        partial: a subset of the names is allowed; otherwise every name of the manifest must come.
        tied: ``{tied name: the name it follows}`` of the serving model (``lm_head.weight`` ->
            ``model.embed_tokens.weight``): the tied name need not come, and if it comes it must equal the
            one it follows (the server would ignore it).

    Raises:
        ValueError: naming the first few parameters at fault and what was expected of each.
    """
    tied = dict(tied or {})
    faults: list[str] = []
    for name, t in sent.items():
        if name in tied:
            owner = tied[name]
            if owner not in sent:
                faults.append(
                    f"{name} is tied to {owner} on the server, which ignores it: send {owner} instead"
                )
            elif sent[owner].shape != t.shape or not torch.equal(sent[owner], t.to(sent[owner].dtype)):
                faults.append(
                    f"{name} is tied to {owner} on the server, which ignores it, and the two sent differ"
                )
            continue
        if name not in manifest:
            faults.append(f"{name} is not a weight of the server's model")
            continue
        shape, dtype = manifest[name]
        if tuple(t.shape) != shape:
            faults.append(f"{name} has shape {list(t.shape)}, the server's model takes {list(shape)}")
        elif not _castable(t.dtype, dtype):
            faults.append(f"{name} has dtype {t.dtype}, the server's model takes {dtype} (no cast)")
    if not partial:
        missing = sorted(n for n in manifest if n not in sent and n not in tied)
        if missing:
            more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
            faults.append(
                f"the update lacks {', '.join(missing[:5])}{more} (send every weight, or partial=True)"
            )
    if faults:
        more = f" (and {len(faults) - 5} more)" if len(faults) > 5 else ""
        raise ValueError("weight update refused, nothing loaded: " + "; ".join(faults[:5]) + more)


def _shadow_of(param: torch.Tensor, like: torch.Tensor, loader: Callable[..., Any]) -> torch.Tensor:
    """A tensor the parameter's loader can write into as into the parameter: the shape, class and
    attributes of ``like`` (the parameter as loaded), the parameter's values where it holds them (a loader
    writes part of it), NaN where it does not (a parameter emptied after loading, its values packed
    elsewhere)."""
    shape = tuple(like.shape)
    if param.numel() == math.prod(shape) and tuple(param.shape) == shape:
        data = param.detach().clone()
    elif param.dtype.is_floating_point:
        data = torch.full(tuple(shape), float("nan"), dtype=param.dtype, device=param.device)
    else:
        data = torch.zeros(tuple(shape), dtype=param.dtype, device=param.device)
    cls = type(like)
    if cls is not torch.Tensor:
        data.__class__ = cls
    data.__dict__ = like.__dict__.copy()
    # the recorder's (see shadow_verify) replaced by the original: a plain attribute, or the field behind
    # vLLM's ``weight_loader`` property
    for key in ("weight_loader", "_weight_loader"):
        if key in data.__dict__:
            data.__dict__[key] = loader
    return data


def shadow_verify(
    params: Mapping[str, torch.Tensor],
    load: Callable[[Iterable[tuple[str, torch.Tensor]]], Any],
    groups: Iterable[Sequence[tuple[str, torch.Tensor]]],
    *,
    default_loader: Callable[..., Any],
    template: Callable[[str, torch.Tensor], torch.Tensor] | None = None,
    probe: Callable[[Mapping[int, torch.Tensor]], list[str]] | None = None,
) -> list[str]:
    """The parameters of a model that differ from what loading ``groups`` into it gives (empty: all equal).

    Each group is loaded again by ``load`` (the model's own ``load_weights``), with every parameter's
    ``weight_loader`` replaced by one that writes into a shadow of it (:func:`_shadow_of`) instead; each
    shadow is then compared with its parameter, bit for bit. A parameter whose storage was emptied after
    loading (its values live in a packed copy) is left to ``probe``, which gets the shadows by parameter id
    and returns the names it found different.

    Args:
        params: the model's parameters by name (each once).
        load: loads ``(name, tensor)`` pairs through the model's loaders.
        groups: the sent tensors, in groups (the extra memory is one group's shadows).
        default_loader: the loader a parameter without ``weight_loader`` gets.
        template: a parameter as it was loaded (its shape, class, attributes and loader), where it differs
            from what the model holds now (default: the parameter itself).
        probe: checks the parameters whose storage is not what was loaded.

    Returns:
        The names of the parameters that differ, each once.
    """
    by_id = {id(p): n for n, p in params.items()}
    shadows: dict[int, torch.Tensor] = {}
    saved: dict[str, Any] = {}

    def recorder(like: torch.Tensor, original: Callable[..., Any]) -> Callable[..., Any]:
        def write(p: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            key = id(p)
            if key not in shadows:
                shadows[key] = _shadow_of(p, like, original)
            return original(shadows[key], *args, **kwargs)

        return write

    for name, p in params.items():
        saved[name] = getattr(p, "weight_loader", None)
        like = p if template is None else template(name, p)
        loader = getattr(like, "weight_loader", None) or saved[name] or default_loader
        p.weight_loader = recorder(like, loader)  # type: ignore[attr-defined]
    differ: list[str] = []
    try:
        with torch.no_grad():
            for group in groups:
                shadows.clear()
                load(iter(group))
                for key, shadow in shadows.items():
                    name = by_id.get(key, "?")
                    param = params[name]
                    whole = param.numel() == shadow.numel() and tuple(param.shape) == tuple(shadow.shape)
                    if whole and not torch.equal(param.detach(), shadow.as_subclass(torch.Tensor)):
                        differ.append(name)
                if probe is not None:
                    differ += probe({k: s.as_subclass(torch.Tensor) for k, s in shadows.items()})
    finally:
        shadows.clear()
        for name, p in params.items():
            if saved[name] is None:
                del p.weight_loader  # type: ignore[attr-defined]
            else:
                p.weight_loader = saved[name]  # type: ignore[attr-defined]
    return list(dict.fromkeys(differ))
