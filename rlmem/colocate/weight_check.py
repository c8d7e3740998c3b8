"""A served model's checkpoint, and a weight update checked against it, with no inference framework
imported here: SGLang's client (``rollout/remote/sglang.py``) checks an update before sending it, rlmem's vLLM
backend (``integrations/vllm_transfer.py``) before loading it, and ``rlmem bench verify`` times the
verification without vLLM.

- :func:`read_checkpoint`: the names, shapes and dtypes of the checkpoint a server loaded (the headers of
  its safetensors files; no tensor is read), and whether its config ties ``lm_head`` to the embedding;
- :func:`check_update`: an update against it before a byte is loaded: every name known and given once,
  every shape equal, every dtype one the loaders cast into, the set complete unless partial, a tied head
  that the server would ignore refused;
- :func:`shadow_verify`: after an update, what the model holds against what loading the sent tensors gives,
  parameter by parameter, on the model's device: the sent tensors are loaded again through the model's own
  weight loaders into shadow tensors (one group of names at a time, so the extra memory is one group's
  parameters), and each shadow is compared with the parameter exactly.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch

__all__ = ["Checkpoint", "check_update", "read_checkpoint", "shadow_verify"]

# Checkpoint tensors the models skip when loading (SGLang 0.5.23's qwen3.py:725-730 and its kin, vLLM's
# models alike): never required.
_SKIPPED = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")
# safetensors' names of the dtypes a tensor is sent in; a checkpoint tensor in one of _WIDE is a parameter
# default_weight_loader casts into with copy_, any other (fp8, int8, packed ints) is quantized data whose
# cast would be silently wrong
_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
_WIDE = frozenset({"F64", "F32", "F16", "BF16"})


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """The tensors of the checkpoint a server loaded: name to (shape, safetensors dtype), where it lies, and
    whether its config ties ``lm_head`` to the embedding."""

    path: str
    tensors: dict[str, tuple[tuple[int, ...], str]]
    tied: bool


def read_checkpoint(model_path: str, info: Mapping[str, Any] | None = None) -> Checkpoint:
    """The checkpoint at ``model_path`` as a server found it: a directory, or a Hugging Face name in the
    local cache (``info``: the server's ``download_dir`` and ``revision``, where it has them); only the
    headers of its safetensors files are read.

    Raises:
        LookupError: it cannot be read here (the message says why).
    """
    folder = _folder(str(model_path), dict(info or {}))
    files = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):  # only the files the index names, as weight_utils.py:777-783 keeps them
        with open(index) as f:
            named = set(json.load(f).get("weight_map", {}).values())
        files = [f for f in files if f in named]
    elif files == ["consolidated.safetensors", "model.safetensors"]:  # weight_utils.py:766-775
        files = ["model.safetensors"]
    if not files:
        raise LookupError(f"{folder} has no safetensors files (the server's --load-format says what it read)")
    tensors: dict[str, tuple[tuple[int, ...], str]] = {}
    for name in files:
        tensors.update(_header(os.path.join(folder, name)))
    config: dict[str, Any] = {}
    if os.path.isfile(os.path.join(folder, "config.json")):
        with open(os.path.join(folder, "config.json")) as f:
            config = json.load(f)
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    tied = bool(config.get("tie_word_embeddings", text.get("tie_word_embeddings", False)))
    return Checkpoint(folder, tensors, tied)


def _folder(model_path: str, info: Mapping[str, Any]) -> str:
    if os.path.isdir(model_path):
        return model_path
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise LookupError(
            f"{model_path!r} is not a directory here, and huggingface_hub is not installed to look for it in "
            "the Hugging Face cache"
        ) from None
    try:
        return snapshot_download(
            model_path,
            revision=info.get("revision"),
            cache_dir=info.get("download_dir"),
            local_files_only=True,
            allow_patterns=["*.safetensors", "*.json"],
        )
    except Exception as e:
        raise LookupError(
            f"{model_path!r} is neither a directory here nor in the Hugging Face cache ({type(e).__name__})"
        ) from None


def _header(path: str) -> dict[str, tuple[tuple[int, ...], str]]:
    """A safetensors file's tensors: an 8-byte little-endian length, then that many bytes of JSON."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        if not 2 <= n <= 1 << 28:
            raise LookupError(f"{path} is not a safetensors file (header of {n} bytes)")
        head = json.loads(f.read(n))
    head.pop("__metadata__", None)
    return {k: (tuple(int(d) for d in v["shape"]), str(v["dtype"])) for k, v in head.items()}


def check_update(
    pairs: Sequence[tuple[str, torch.Tensor]],
    ckpt: Checkpoint,
    partial: bool,
    where: str,
    what: str = "update_weights",
) -> None:
    """Refuse an update the server would load wrong or die on: a name its model does not have, another
    shape, a dtype its loaders would not cast into (a quantized tensor's), a name given twice, a tied head
    the server would ignore while it differs from the embedding sent, or (unless ``partial``) a set without
    every tensor the model loads.

    Args:
        pairs: the update, ``(name, tensor)``; only shapes and dtypes are read (and a tied head's values).
        ckpt: the checkpoint the server loaded.
        partial: a subset of the model's tensors is meant.
        where: the server, as the message names it.
        what: the call, as the message names it.

    Raises:
        ValueError: naming the parameter, what was given and what the server's model has.
    """
    where = f"{where} (its checkpoint {ckpt.path})"
    given: dict[str, torch.Tensor] = {}
    for name, t in pairs:
        if name in given:
            raise ValueError(f"{what}: {name!r} is given twice; nothing was loaded")
        given[name] = t
    embed = "model.embed_tokens.weight"
    for name, t in given.items():
        want = ckpt.tensors.get(name)
        if name == "lm_head.weight" and ckpt.tied:
            # the server's head is its embedding: a head sent apart is ignored, so it must be that one
            head = given.get(embed)
            # equal to the embedding sent (meta tensors: shapes only, their values are not here)
            if (
                head is not None
                and head.shape == t.shape
                and (head.is_meta or t.is_meta or torch.equal(head, t.to(head.dtype)))
            ):
                continue
            raise ValueError(
                f"{what}: {name!r} is not a tensor of the model of {where} apart from its embedding: its "
                f"lm_head is tied to the embedding, which the server loads it from and would ignore this "
                f"one; send {embed} (the two equal, or the head not at all); nothing was loaded"
            )
        if want is None:
            raise ValueError(
                f"{what}: {name!r} is not a tensor of the model of {where}; nothing was loaded (a server "
                "skips such a name, or fails on it half way)"
            )
        shape, dtype = want
        if tuple(t.shape) != shape:
            raise ValueError(
                f"{what}: {name!r} was given with shape {list(t.shape)}, the model of {where} has "
                f"{list(shape)}; nothing was loaded (a larger weight would be narrowed silently, a smaller "
                "one fail half way)"
            )
        sent = _DTYPES.get(t.dtype, str(t.dtype))
        if not (dtype in _WIDE and sent in _WIDE) and sent != dtype:
            raise ValueError(
                f"{what}: {name!r} was given as {t.dtype}, the model of {where} has it as {dtype}; nothing "
                "was loaded (the loaders cast between 16-, 32- and 64-bit floats only)"
            )
    if partial:
        return
    tied = ckpt.tied and embed in given
    missing = [
        n
        for n in ckpt.tensors
        if n not in given and not any(s in n for s in _SKIPPED) and not (tied and n == "lm_head.weight")
    ]
    if missing:
        some = ", ".join(map(repr, missing[:3])) + (", ..." if len(missing) > 3 else "")
        raise ValueError(
            f"{what}: {len(missing)} of the {len(ckpt.tensors)} tensors of the model of {where} were not "
            f"given ({some}); nothing was loaded. Give them all, or pass partial=True to update only these"
        )


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
        def write(*args: Any, **kwargs: Any) -> Any:
            # the parameter comes first, or by name (vLLM's fused experts: ``param=``)
            p = kwargs["param"] if "param" in kwargs else args[0]
            key = id(p)
            if key not in shadows:
                shadows[key] = _shadow_of(p, like, original)
            if "param" in kwargs:
                return original(*args, **{**kwargs, "param": shadows[key]})
            return original(shadows[key], *args[1:], **kwargs)

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
